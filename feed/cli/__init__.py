"""The ``tidefeed`` command line."""

__all__: list[str] = []
