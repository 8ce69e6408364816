"""The feed log: its store, checkpoints, manifests, commits, compaction and readers."""

__all__: list[str] = []
