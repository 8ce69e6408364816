"""The tidefeed producer: sources, diffs, clock, consolidation, feed log, checkpoints, CLI.

Importing :mod:`feed` does not start or import Spark; the modules that need it import it
when they are used.
"""

__all__: list[str] = []
