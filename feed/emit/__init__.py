"""The emitter: exactly-once transactions from input files into a feed, its loops and settings."""

__all__: list[str] = []
