"""``tidefeed inspect``: print a committed feed from its log, in a table or any wire format."""

from __future__ import annotations

from typing import IO, Any

import pyarrow as pa

from feed.log.reader import FeedReader
from protocol import CheckpointError, Progress, Updates, get_codec

__all__ = ["format_table", "inspect_feed"]


def format_table(table: pa.Table, *, limit: int = 50) -> str:
    """A plain aligned text table of an Arrow table's first ``limit`` rows."""
    cols = table.column_names
    rows = table.slice(0, limit).to_pylist()
    cells = [[_cell(r[c]) for c in cols] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    if table.num_rows > limit:
        lines.append(f"… {table.num_rows - limit} more")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "∅"
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    s = str(v).replace("\n", "\\n")
    return s if len(s) <= 24 else s[:23] + "…"


def inspect_feed(
    *, log: str, feed: str, after: int | None, at: int | str | None, fmt: str, out: IO[str]
) -> int:
    reader = FeedReader(log, feed)
    if at == "latest":  # the newest complete time
        if reader.frontier == 0:
            raise CheckpointError(f"feed {feed!r} has no complete time yet (frontier 0)")
        at = reader.frontier - 1
    if at is not None:
        assert isinstance(at, int)
        snap = reader.snapshot(at)
        if fmt == "table":
            print(f"feed {feed} at time {at}: {snap.num_rows} record(s)", file=out)
            print(format_table(snap, limit=1000), file=out)
            return 0
        # as a feed: the whole collection consolidated to one time
        batch = reader.snapshot_updates(at)
        messages: Any = [
            Progress(reader.since, reader.since, ()),
            batch,
            Progress(reader.since, at + 1, ((at, snap.num_rows),) if snap.num_rows else ()),
        ]
    else:
        messages = reader.messages(after=after)
    if fmt == "table":
        print(f"feed {feed}: since {reader.since}, frontier {reader.frontier}", file=out)
        for v in reader.info.history()[1:]:
            print(f"-- schema version from time {v.start}: {v.describe()}", file=out)
        for m in messages:
            if isinstance(m, Updates):
                t = m.table(reader.record_type)
                data = t.column("data").combine_chunks()
                flat = pa.table(
                    {
                        "time": t.column("time"),
                        "diff": t.column("diff"),
                        **{f.name: data.field(i) for i, f in enumerate(data.type)},
                    }
                )
                print(format_table(flat), file=out)
            else:
                counts = ", ".join(f"{t}: {n}" for t, n in m.counts) or "none"
                print(f"-- progress [{m.lower}, {m.upper}) counts {counts}", file=out)
        return 0
    encoder = get_codec(fmt).encoder(
        out.buffer if hasattr(out, "buffer") else out,  # type: ignore[arg-type]
        schema=reader.info.schema,
    )
    for m in messages:
        encoder.write(m)
    encoder.close()
    return 0
