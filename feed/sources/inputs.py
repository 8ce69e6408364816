"""Input files and the emitter's position in them, in O(what is pending).

A folder source is read in file-name order (connectors and tidefeed's own capture name files
by sequence). The checkpoint does not list every file ever consumed; it keeps a
**high-water name** — every file named at or below it is consumed — plus the few files
above it that are consumed already while an earlier one is held back (an incomplete
Debezium transaction keeps its file unconsumed; the files after it may hold transactions
that did commit). ``source`` keys: ``file`` and ``file_beyond`` for the input folder,
``tx_file`` and ``tx_beyond`` for ``--tx-metadata``. A checkpoint from before (``files`` /
``tx_files``, the whole list) is read as "all of those beyond no high-water" and folded
into a high-water at the next commit.

A file that appears later under a name at or below the high-water is never read: name
input files in the order they are written.

A source path is a local path or a URI that pyarrow opens (``s3://bucket/prefix``, with
``?endpoint_override=…`` and the other options of ``pyarrow.fs.S3FileSystem.from_uri``):
listing and the few lines the driver reads itself go through that filesystem, and Spark
reads the same files under its own name for the store (``s3a://`` for ``s3://``).
"""

from __future__ import annotations

import collections
import itertools
import os
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.fs as pafs

from feed.sources.events import debezium_event
from feed.sources.file_text import codec_of, input_lines, tail
from feed.sources.registry import SourceKind
from feed.sources.stores import filesystem, is_remote, local_path
from protocol import SourceError

__all__ = [
    "FilePosition",
    "InputWindow",
    "edge_txn",
    "input_bytes",
    "list_files",
    "next_source",
    "spark_file_path",
    "spark_input",
    "spark_metadata_path",
]


def list_files(path: str, *, what: str = "source path") -> list[str]:
    """The input files of ``path`` (a file, or a folder's files not named ``.*``/``_*``),
    in name order: absolute paths, or ``scheme://bucket/key`` URIs for a store."""
    if not is_remote(path):
        full = local_path(path)
        if os.path.isfile(full):
            return [full]
        if not os.path.isdir(full):
            raise SourceError(f"{what} {path!r} does not exist")
        with os.scandir(full) as it:
            names = [e.name for e in it if not e.name.startswith((".", "_")) and e.is_file()]
        return [os.path.join(full, n) for n in sorted(names)]
    scheme = path.split("://", 1)[0]
    fs, root = filesystem(path, what)
    root = root.rstrip("/")
    try:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            found = [root]
        elif info.type == pafs.FileType.Directory:
            found = [
                f.path
                for f in fs.get_file_info(pafs.FileSelector(root))
                if f.type == pafs.FileType.File and not f.base_name.startswith((".", "_"))
            ]
        else:
            raise SourceError(f"{what} {path!r} does not exist")
    except (pa.ArrowInvalid, OSError) as e:
        raise SourceError(f"cannot list {what} {path!r}: {e}") from e
    return [f"{scheme}://{p}" for p in sorted(found, key=lambda p: p.rsplit("/", 1)[-1])]


def input_bytes(files: Sequence[str]) -> int:
    """The total size of input files (their stores are asked for remote ones)."""
    total = 0
    for f in files:
        fs, inner = filesystem(f)
        total += fs.get_file_info(inner).size or 0
    return total


def spark_input(path: str) -> str:
    """An input file as Spark reads it: Hadoop's ``s3a://`` for ``s3://``."""
    if not is_remote(path):
        return local_path(path)
    scheme, rest = path.split("://", 1)
    return f"{'s3a' if scheme == 's3' else scheme}://{rest}"


def spark_file_path(path: str) -> str:
    """An input file as Spark's ``_metadata.file_path`` shows it (percent-encoded; a
    local file without its ``file:`` scheme)."""
    p = spark_input(path)
    if "://" not in p:
        return urllib.parse.quote(p, safe="/")
    scheme, rest = p.split("://", 1)
    return f"{scheme}://{urllib.parse.quote(rest, safe='/')}"


def spark_metadata_path(path: str) -> str:
    """An input file as the text source's ``_metadata.file_path`` column holds it (a
    local file with its ``file:`` scheme)."""
    uri = spark_file_path(path)
    return uri if is_remote(path) else "file:" + uri


@dataclass(frozen=True, slots=True)
class FilePosition:
    """Which files of one folder are consumed: every name ``<= last``, and ``beyond``."""

    last: str | None = None
    beyond: frozenset[str] = frozenset()

    @classmethod
    def from_source(cls, source: Mapping[str, Any], prefix: str = "file") -> FilePosition:
        legacy = "files" if prefix == "file" else "tx_files"
        beyond = set(source.get(f"{prefix}_beyond" if prefix == "file" else "tx_beyond", ()))
        beyond.update(source.get(legacy, ()))
        return cls(source.get(prefix), frozenset(beyond))

    def consumed(self, name: str) -> bool:
        return (self.last is not None and name <= self.last) or name in self.beyond

    def pending(self, paths: Iterable[str]) -> list[str]:
        """The paths whose file names are not consumed, in name order."""
        return [p for p in paths if not self.consumed(os.path.basename(p))]

    def advance(self, listed: Iterable[str], taken: Iterable[str]) -> FilePosition:
        """The position once the files ``taken`` (names) are consumed too. ``listed``
        (the names the poll saw) lets the high-water pass every consumed name up to the
        first one still pending."""
        done = set(self.beyond) | set(taken)
        last = self.last
        for name in sorted(set(listed) | done):
            if last is not None and name <= last:
                continue
            if name not in done:
                break
            last = name
        return FilePosition(last, frozenset(n for n in done if last is None or n > last))

    def to_source(self, prefix: str = "file") -> dict[str, Any]:
        beyond_key = "file_beyond" if prefix == "file" else "tx_beyond"
        return {prefix: self.last, beyond_key: sorted(self.beyond)}


def consumed_position(
    source: Mapping[str, Any],
    prefix: str,
    listed: Iterable[str],
    read: Iterable[str],
    held: set[str],
) -> dict[str, Any]:
    """The ``source`` keys of ``prefix`` once the files ``read`` (paths) are consumed,
    except those ``held`` back (names)."""
    taken = (n for n in map(os.path.basename, read) if n not in held)
    return FilePosition.from_source(source, prefix).advance(listed, taken).to_source(prefix)


def without_legacy(source: Mapping[str, Any]) -> dict[str, Any]:
    """``source`` without the whole-list keys of checkpoints from before high-waters."""
    return {k: v for k, v in source.items() if k not in ("files", "tx_files")}


def next_source(
    source: Mapping[str, Any],
    *,
    position: Sequence[int] | None,
    cdf: bool,
    replaces: tuple[int, str] | None,
    files: tuple[Sequence[str], Sequence[str]] | None,
    tx_files: tuple[Sequence[str], Sequence[str]] | None,
    held: set[str],
    update: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The checkpoint's ``source`` once a transaction commits: the committed ``position``
    in the source's own order, the input files consumed (``files``/``tx_files``: the
    names the poll listed and the paths read; ``held`` names stay pending), a new
    snapshot the feed's own from now on (``replaces``), and a source's own ``update``
    (a Delta version) where its input is not a folder of files."""
    out = {
        **without_legacy(source),
        "pos": list(position) if position is not None else source.get("pos", [0, 0, 0]),
    }
    if files is not None:
        out.update(consumed_position(source, "file", files[0], files[1], held))
    if cdf and position is not None:
        out["cdf_version"] = position[0]
    if replaces is not None:
        out["snapshot_lsn"], out["snapshot_txn"] = replaces
    if update is not None:
        out.update(update)
    if tx_files is not None:
        out.update(consumed_position(source, "tx_file", tx_files[0], tx_files[1], held))
    return out


def _debezium_txn(line: bytes) -> str | bool | None:
    """A Debezium line's ``source.txId`` (None: not known); False: the line is no change
    event (a tombstone, a heartbeat, transaction metadata)."""
    found = debezium_event(line)
    if found is None:
        return False
    src = found[1].get("source")
    v = src.get("txId") if isinstance(src, dict) else None
    return None if v is None else str(v)


def _commit_version(line: bytes) -> str | bool | None:
    """A change row's ``_commit_version`` (None: not known); False: not a JSON row."""
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    v = row.get("_commit_version") if isinstance(row, dict) else None
    return None if v is None else str(v)


#: the functions a kind's ``line_txn`` names (feed/sources/registry.py)
_LINE_TXN = {"debezium": _debezium_txn, "commit_version": _commit_version}


def edge_txn(kind: SourceKind, path: str, *, last: bool) -> str | None:
    """The source transaction of the first (or last) change of a JSON-lines file, if the
    kind's lines name one (``SourceKind.line_txn``). Lines that carry no change
    (tombstones, heartbeats, transaction metadata) are passed."""
    if kind.line_txn is None or path.endswith(".parquet"):
        return None
    txn_of = _LINE_TXN[kind.line_txn]
    try:
        if last and codec_of(path) is None:
            lines = [x for x in tail(path, 1 << 20).splitlines() if x.strip()][::-1]
        elif last:  # (a compressed stream has no end to seek to: read through)
            lines = [*collections.deque((x for x in input_lines(path) if x.strip()), 100)][::-1]
        else:
            head = input_lines(path)
            lines = [x for x in itertools.islice(head, 100) if x.strip()]
            head.close()
    except (OSError, SourceError):
        return None
    for line in lines:
        v = txn_of(line)
        if v is not False:
            return v if isinstance(v, str) else None
    return None


class InputWindow:
    """What the emitter's next transaction reads from a folder source: the pending input
    files (and ``--tx-metadata`` files) in name order, up to the per-transaction limit,
    never ending inside a source transaction where none may be split. It remembers the
    names each poll listed, which the commit's position is computed from."""

    def __init__(self, source_path: str, tx_metadata: str | None) -> None:
        self.source_path = source_path
        self.tx_metadata = tx_metadata
        self.listed: list[str] = []  # file names the last poll saw (input, tx metadata)
        self.tx_listed: list[str] = []

    def all_files(self) -> list[str]:
        return list_files(self.source_path)

    def pending(self, source: Mapping[str, Any]) -> list[str]:
        """Input files not consumed yet (``source``: the checkpoint's), in name order."""
        listed = self.all_files()
        self.listed = [os.path.basename(f) for f in listed]
        return FilePosition.from_source(source).pending(listed)

    def pending_tx(self, source: Mapping[str, Any]) -> list[str]:
        """Transaction metadata files not consumed yet: all of them go into every read,
        they are small and say which transactions are complete."""
        if not self.tx_metadata:
            return []
        if not is_remote(self.tx_metadata) and not os.path.exists(local_path(self.tx_metadata)):
            # not there yet: a capture makes the folder with its first transaction (emit
            # --follow may start first; a batch emit is refused before this, in the CLI)
            self.tx_listed = []
            return []
        listed = list_files(self.tx_metadata, what="--tx-metadata path")
        self.tx_listed = [os.path.basename(f) for f in listed]
        return FilePosition.from_source(source, "tx_file").pending(listed)

    @staticmethod
    def first(pending: list[str], limit: int, *, kind: SourceKind, whole_txns: bool) -> list[str]:
        """The files of a transaction: the first ``limit`` pending ones and, when source
        transactions are not split (``whole_txns``), the next ones while they go on with
        the transaction the last file ended in (``kind``: the source kind)."""
        files = pending[:limit]
        while whole_txns and files and len(files) < len(pending):
            last = edge_txn(kind, files[-1], last=True)
            if last is None or last != edge_txn(kind, pending[len(files)], last=False):
                break
            files.append(pending[len(files)])
        return files
