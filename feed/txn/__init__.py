"""One transaction's dataflow: changes -> diffs against keyed state -> timed updates ->
segment files, computed in Spark or, for a small transaction, on the driver."""

__all__: list[str] = []
