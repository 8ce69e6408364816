"""The unkeyed half of the one-pass engine (:mod:`feed.txn.onepass`).

Without a key the images are trusted: a file's task turns each kept event into
``-before`` / ``+after`` (as :func:`feed.txn.diffs.unkeyed_diffs` does) and sums the diffs
of each record within the file (:func:`partial_sums`); a task of several files sums its
files' sums again (:func:`merge_sums`) before the shuffle that sums them across tasks.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["merge_sums", "partial_sums"]


def partial_sums(kept: pa.Table, record: pa.StructType) -> pa.Table:
    """``-before`` and ``+after`` of the ``kept`` events (each times its weight), summed
    per record, zero sums left out: columns ``data`` (the record) and ``diff``."""
    names = [f"c{i}" for i in range(record.num_fields)]
    parts = []
    for column, sign in (("before", -1), ("after", 1)):
        img = kept.select([column, "weight"])
        if kept[column].null_count:
            img = img.filter(pc.is_valid(kept[column]))
        if not img.num_rows:
            continue
        fields = img[column].combine_chunks().flatten()
        weight = img["weight"] if sign > 0 else pc.negate(img["weight"])
        parts.append(pa.table([*fields, weight], names=[*names, "diff"]))
    return _summed(parts, record)


def merge_sums(parts: list[pa.Table], record: pa.StructType) -> pa.Table:
    """Several files' :func:`partial_sums` as one: summed per record, zeros left out."""
    names = [*(f"c{i}" for i in range(record.num_fields)), "diff"]
    flat = [
        pa.table([*p["data"].combine_chunks().flatten(), p["diff"]], names=names) for p in parts
    ]
    return _summed(flat, record)


def _summed(parts: list[pa.Table], record: pa.StructType) -> pa.Table:
    """The rows of ``parts`` (a column per record field, ``c0``..., and ``diff``) summed
    per record, zero sums left out, as columns ``data`` and ``diff``."""
    if not parts:
        return pa.table({"data": pa.array([], record), "diff": pa.array([], pa.int64())})
    names = [f"c{i}" for i in range(record.num_fields)]
    summed = pa.concat_tables(parts).group_by(names).aggregate([("diff", "sum")])
    summed = summed.filter(pc.not_equal(summed["diff_sum"], 0))
    columns = [summed[n].combine_chunks() for n in names]
    data = pa.StructArray.from_arrays(columns, fields=list(record))
    return pa.table({"data": data, "diff": summed["diff_sum"]})
