"""Sources: input files of each kind -> canonical change rows, in source transactions."""

__all__: list[str] = []
