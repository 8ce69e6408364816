"""Keyed state bucketed by a hash of the key: a transaction costs O(its changes).

A keyed feed keeps the current row of every key (feed/txn/diffs.py). Kept whole, every
transaction would read and rewrite the whole table. Here the rows are split into
:data:`BUCKETS` buckets by ``pmod(xxhash64(key columns), BUCKETS)``; a transaction reads
only the buckets its changes touch and writes new versions of those buckets alone.

The bucket count follows the table: a new feed's state gets about one bucket per
:data:`ROWS_PER_BUCKET` rows of its first transaction's input, or of the keys it changed
where the engine counted them (the one pass: feed/txn/onepass_keyed.py), a power of two,
at least :data:`MIN_BUCKETS`; and once the buckets hold :data:`GROW_AT` times that on average
(the manifest counts each bucket's rows) the next transaction reads the whole state and
writes it into the count that fits: O(table) once per fourfold growth, so each row is
rewritten a bounded number of times on average and a small transaction stays small at
any size.

Layout and the commit point::

    state/<seq>-<r>/_bucket=<b>/*.parquet   bucket b as transaction <seq> left it
    state/<seq>-<r>.json                    the state manifest of commit <seq>:
        {"format": 1, "buckets": B, "files": {"<b>": "state/<s>-<r>/_bucket=<b>"},
         "rows": {"<b>": n}}

``<r>`` is random: a transaction redone at the same seq (after a crash, while the killed
process's Spark may still be finishing a write) never meets the files of the first attempt.

The manifest lists, for every non-empty bucket, the folder holding its latest version
(written by this or an earlier transaction). Both are written before the commit, and the
checkpoint's ``state`` names the manifest: a transaction that never commits leaves files
no commit names, which the next start deletes. Bucket folders that no kept commit's
manifest names are pruned after each commit.

A feed written before buckets existed has ``state`` naming one folder with every row: its
next transaction reads that folder whole once and writes every bucket (a migration that
costs O(table) once).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from feed.log.store import FeedLog
from feed.txn.grouped import by_group, read_files, strays, write_groups
from protocol import CheckpointError

__all__ = [
    "BUCKETS",
    "BucketedState",
    "LoadedState",
    "bucket_of",
    "fitting_buckets",
    "new_state",
]

#: buckets of a whole-state folder from before buckets, migrated (its size is unknown)
BUCKETS = 1024
#: rows a bucket is sized for: a 10-row transaction reads and writes ~10 buckets of this
ROWS_PER_BUCKET = 4096
#: the state is rebucketed once its buckets hold this many times ROWS_PER_BUCKET on average
GROW_AT = 4
MIN_BUCKETS = 8
MAX_BUCKETS = 1 << 16
_FORMAT = 1
_BUCKET_DIR = "_bucket="


def fitting_buckets(rows: int) -> int:
    """The bucket count for a state of ``rows`` rows: a power of two near
    ``rows / ROWS_PER_BUCKET``, within ``[MIN_BUCKETS, MAX_BUCKETS]``."""
    want = max(1, -(-rows // ROWS_PER_BUCKET))
    return min(MAX_BUCKETS, max(MIN_BUCKETS, 1 << (want - 1).bit_length()))


def new_state(rows: int = 0) -> LoadedState:
    """A new, empty state for a first transaction that read ``rows`` rows (at most a row
    per input row): :func:`fitting_buckets` of them."""
    return LoadedState(None, frozenset(), fitting_buckets(rows), {}, {})


def bucket_of(row: Column, key: Sequence[str], buckets: int) -> Column:
    """The bucket of a record struct ``row`` (hash of its key columns)."""
    return F.pmod(F.xxhash64(*[row[k] for k in key]), F.lit(buckets)).cast("int")


def _outgrown(rows: int, buckets: int) -> bool:
    """Whether a state of ``rows`` rows in ``buckets`` buckets is rebucketed next."""
    return rows > GROW_AT * ROWS_PER_BUCKET * buckets and buckets < MAX_BUCKETS


_FOLDER = re.compile(r"^\d+(-[0-9a-f]+)?$")  # state/<seq>-<r>/, or state/<seq>/ from before


#: the column of a state row holding the source position of its key's last change
#: (``pos_hi, pos_lo, pos_n``), for sources whose positions order changes per key
POS_COLUMN = "_pos"
#: with positions, a deleted key stays in the state as a tombstone (its key columns, its
#: position and this column true), so an older row of it arriving later is recognized
GONE_COLUMN = "_gone"
POS_TYPE = T.StructType([T.StructField(n, T.LongType()) for n in ("pos_hi", "pos_lo", "pos_n")])


@dataclass(frozen=True, slots=True)
class LoadedState:
    """The part of the state one transaction needs."""

    rows: DataFrame | None  # record struct column ``data``: the rows of the touched buckets
    touched: frozenset[int]  # buckets this transaction's changes fall in (all: migration)
    buckets: int  # the count the new state is written with
    files: dict[int, str]  # the committed manifest: bucket -> folder (relative to the feed)
    counts: dict[int, int]  # the committed manifest: bucket -> rows


@dataclass(frozen=True, slots=True)
class _Manifest:
    buckets: int
    files: dict[int, str]
    counts: dict[int, int] | None  # None: written before row counts


class BucketedState:
    """Reads and writes one feed's bucketed keyed state (see the module docstring)."""

    def __init__(
        self,
        spark: Callable[[], Any],
        feedlog: FeedLog,
        record_type: T.StructType,
        key: Sequence[str],
        spark_path: Callable[[str], str],
    ) -> None:
        self._spark = spark  # started only when state is read or written
        self.log = feedlog
        self.record_type = record_type
        self.key = tuple(key)
        self._spark_path = spark_path
        self._last: tuple[str, _Manifest] | None = None  # see _manifest

    # ---- reading ------------------------------------------------------------------------
    def _manifest(self, ref: str) -> _Manifest:
        """The bucket count, bucket folders and row counts of state manifest ``ref``.
        Manifests are immutable, so the last one read is kept: a transaction asks for its
        count (:meth:`buckets`) and then its folders (:meth:`load`)."""
        if self._last is not None and self._last[0] == ref:
            return self._last[1]
        path = self.log.path(ref)
        try:
            d = orjson.loads(self.log.read_bytes(path))
        except (OSError, orjson.JSONDecodeError) as e:
            raise CheckpointError(
                f"feed {self.log.feed!r}: cannot read the state manifest {path}: {e}"
            ) from e
        files = {int(b): f for b, f in d["files"].items()}
        counts = {int(b): int(n) for b, n in d["rows"].items()} if "rows" in d else None
        found = _Manifest(int(d["buckets"]), files, counts)
        self._last = (ref, found)
        return found

    def _rows_in(self, folder: str) -> int:
        """The rows of one bucket folder (relative to the feed), from its files' footers."""
        return self.log.row_count(self.log.parquet_files(self.log.path(folder)))

    def read(self, folders: Iterable[str], *, with_pos: bool = False) -> DataFrame | None:
        """The rows of these state folders (relative to the feed) as column ``data``, and
        with ``with_pos`` the source position of each key's last change as ``_pos`` (null
        in state written without positions)."""
        folders = list(folders)
        if not folders:
            return None
        schema = T.StructType(
            [
                *self.record_type.fields,
                T.StructField(POS_COLUMN, POS_TYPE),
                T.StructField(GONE_COLUMN, T.BooleanType()),
            ]
        )
        store = self.log.store
        if store is None:
            paths = [self._spark_path(self.log.path(f)) for f in folders]
            df = self._spark().read.schema(schema).parquet(*paths)
        else:  # (through pyarrow in the tasks: Spark's reader would need s3a:// and hadoop-aws)
            files = [p for f in folders for p in self.log.parquet_files(self.log.path(f))]
            df = read_files(self._spark(), store, files, schema)
        data = F.struct(*[F.col(c) for c in self.record_type.fieldNames()]).alias("data")
        gone = F.coalesce(F.col(GONE_COLUMN), F.lit(False))
        if not with_pos:
            live: DataFrame = df.where(~gone).select(data)  # a tombstone is not a row
            return live
        rows: DataFrame = df.select(data, POS_COLUMN, gone.alias(GONE_COLUMN))
        return rows

    def buckets(self, ref: str | None) -> int | None:
        """How many buckets the state ``ref`` has (None: a whole-state folder from before
        buckets, which the next transaction reads whole)."""
        if ref is not None and not ref.endswith(".json"):
            return None
        return self._manifest(ref).buckets if ref else BUCKETS

    def load(
        self,
        ref: str | None,
        changes: DataFrame,
        image: Column,
        *,
        touched: frozenset[int] | None = None,
        input_rows: int = 0,
    ) -> LoadedState:
        """The state rows that ``changes`` (whose record is ``image``) can meet.
        ``touched``, when the caller has counted them already (a superset is fine: the
        rows of every loaded bucket are carried into the new state), are the buckets of
        the changes' keys; otherwise a Spark job finds them. ``input_rows`` (the rows the
        transaction read) sizes a new state's buckets."""
        if ref is not None and not ref.endswith(".json"):
            # a whole-state folder from before buckets: read it all, rewrite every bucket
            return LoadedState(
                self.read([ref], with_pos=True), frozenset(range(BUCKETS)), BUCKETS, {}, {}
            )
        if not ref:
            return new_state(input_rows)
        m = self._manifest(ref)
        buckets, files = m.buckets, m.files
        # (a manifest from before row counts: its buckets' footers are read, once)
        counts = (
            m.counts if m.counts is not None else {b: self._rows_in(f) for b, f in files.items()}
        )
        total = sum(counts.values())
        if _outgrown(total, buckets):
            # outgrown: read it all, rewrite it into the count that fits
            grown = fitting_buckets(total)
            rows = self.read((files[b] for b in sorted(files)), with_pos=True)
            return LoadedState(rows, frozenset(files), grown, {}, {})
        if touched is None:
            touched = frozenset(
                r["b"]
                for r in changes.select(bucket_of(image, self.key, buckets).alias("b"))
                .distinct()
                .collect()
            )
        rows = self.read((files[b] for b in sorted(touched) if b in files), with_pos=True)
        return LoadedState(rows, touched, buckets, files, counts)

    def everything(self, ref: str | None) -> LoadedState:
        """Every row of the state ``ref`` (with positions and tombstones), to be written
        whole into the same bucket count (a new record schema: feed/txn/evolve.py)."""
        if not ref:
            return new_state()
        if not ref.endswith(".json"):
            return LoadedState(
                self.read([ref], with_pos=True), frozenset(range(BUCKETS)), BUCKETS, {}, {}
            )
        m = self._manifest(ref)
        rows = self.read((m.files[b] for b in sorted(m.files)), with_pos=True)
        return LoadedState(rows, frozenset(m.files), m.buckets, dict(m.files), dict(m.counts or {}))

    def committed(self, ref: str | None) -> LoadedState | None:
        """The committed bucketed state ``ref`` as it stands, no rows read (``touched`` is
        for the caller to fill in); None when the next transaction must go through
        :meth:`load`: no state yet, a folder from before buckets, a manifest from before
        row counts, or a state that has outgrown its buckets."""
        if not ref or not ref.endswith(".json"):
            return None
        m = self._manifest(ref)
        if m.counts is None or _outgrown(sum(m.counts.values()), m.buckets):
            return None
        return LoadedState(None, frozenset(), m.buckets, m.files, m.counts)

    # ---- writing ------------------------------------------------------------------------
    def write(self, seq: int, new_rows: DataFrame, loaded: LoadedState) -> str:
        """Write the touched buckets' new rows (``new_rows``: column ``data``) and the
        manifest of commit ``seq``; return the manifest's path for the checkpoint."""
        attempt = self.attempt(seq)
        pos = [c for c in (POS_COLUMN, GONE_COLUMN) if c in new_rows.columns]
        out = new_rows.select(
            "data.*", *pos, bucket_of(F.col("data"), self.key, loaded.buckets).alias("_bucket")
        )
        # all of a bucket's rows in one task: one file per bucket, not one per task and bucket
        root = self.log.path("state", attempt)
        written = write_groups(
            out.repartition("_bucket"), "_bucket", self.log.store, root, _BUCKET_DIR
        )
        for stray in strays(self.log.fs, root, written):  # a bucket's folder is read whole
            self.log.delete_file(stray)
        return self.publish(attempt, written, loaded)

    def write_whole(self, seq: int, new_rows: DataFrame) -> str:
        """Write ``new_rows`` (column ``data``) as a state of one folder, without buckets
        or manifest (the next transaction reads it whole and buckets it); return its
        reference. The tasks write through pyarrow, as :meth:`write`'s do."""
        attempt = self.attempt(seq)
        root = self.log.path("state", attempt)
        rows = new_rows.select(F.lit(0).alias("_g"), "data.*")
        written = write_groups(rows, "_g", self.log.store, root, _BUCKET_DIR)
        for stray in strays(self.log.fs, root, written):
            self.log.delete_file(stray)
        folder = f"{root}/{_BUCKET_DIR}0"
        if not written:  # no rows: a file of none, so the folder reads as an empty state
            import pyarrow.parquet as pq
            from pyspark.sql.pandas.types import to_arrow_schema

            self.log.fs.create_dir(folder, recursive=True)
            empty = to_arrow_schema(self.record_type).empty_table()
            pq.write_table(empty, f"{folder}/part-empty.parquet", filesystem=self.log.fs)
        return f"state/{attempt}/{_BUCKET_DIR}0"

    def attempt(self, seq: int) -> str:
        """A new attempt name for commit ``seq``'s state (see the module docstring)."""
        return f"{seq}-{uuid.uuid4().hex[:8]}"

    def bucket_folder(self, attempt: str, bucket: int) -> str:
        """Where an attempt writes a bucket (a full path)."""
        return self.log.path("state", attempt, f"{_BUCKET_DIR}{bucket}")

    def publish(
        self, attempt: str, written: list[tuple[int, str, int]], loaded: LoadedState
    ) -> str:
        """Write the state manifest of an attempt that wrote ``written`` (bucket, file,
        rows) for the buckets ``loaded.touched``; return its path for the checkpoint."""
        folder = f"state/{attempt}"
        files = {b: f for b, f in loaded.files.items() if b not in loaded.touched}
        counts = {b: n for b, n in loaded.counts.items() if b in files}
        for b, (_, n) in by_group(written).items():
            files[b] = f"{folder}/{_BUCKET_DIR}{b}"
            counts[b] = n
        ref = f"state/{attempt}.json"
        manifest = {
            "format": _FORMAT,
            "buckets": loaded.buckets,
            "files": {str(b): files[b] for b in sorted(files)},
            "rows": {str(b): counts[b] for b in sorted(files)},
        }
        if not self.log.create_exclusive(self.log.path(ref), orjson.dumps(manifest)):
            raise CheckpointError(f"feed {self.log.feed!r}: state manifest {ref} exists already")
        return ref

    # ---- pruning ------------------------------------------------------------------------
    def referenced(self, refs: Iterable[str | None]) -> set[str]:
        """Every state folder the given checkpoint ``state`` values need."""
        keep: set[str] = set()
        for ref in refs:
            if not ref:
                continue
            if not ref.endswith(".json"):
                keep.add(ref)
                continue
            keep.add(ref)
            with contextlib.suppress(CheckpointError):
                keep.update(self._manifest(ref).files.values())
        return keep

    def prune(self, refs: Iterable[str | None]) -> None:
        """Delete state files that none of ``refs`` (the kept commits' ``state``) needs."""
        keep = self.referenced(refs)
        kept_seqs = {k.split("/")[1].split(".")[0] for k in keep}
        root = self.log.path("state")
        for info in self.log.list_dir(root):
            name = info.base_name
            seq = name.split(".")[0]
            if name.endswith(".json"):
                if f"state/{name}" not in keep:
                    self.log.delete_file(info.path)
            elif _FOLDER.match(name):
                if seq not in kept_seqs:
                    self.log.delete_dir(info.path)
                elif f"state/{name}" not in keep:
                    # some of its buckets were rewritten since: drop those
                    for b in self.log.list_dir(info.path):
                        if b.base_name.startswith(_BUCKET_DIR) and (
                            f"state/{name}/{b.base_name}" not in keep
                        ):
                            self.log.delete_dir(b.path)
