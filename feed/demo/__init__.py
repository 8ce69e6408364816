"""``tidefeed demo``: the main job end to end, on the embedded default or a real PostgreSQL."""

__all__: list[str] = []
