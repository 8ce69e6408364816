"""The feed log (DESIGN §5) on any pyarrow filesystem: a local path or an ``s3://`` URI.

::

    <log>/<feed>/feed.json               name, record schema (Avro), key, clock, created
    <log>/<feed>/schemas/<from>.json     a later version of the record schema, from time <from>
    <log>/<feed>/_commits/<seq>.json     checkpoints (feed/log/checkpoint.py)
    <log>/<feed>/_manifests/…            what each checkpoint says the log holds (log/manifest.py)
    <log>/<feed>/times/<time>/*.parquet  consolidated updates at <time>: record columns + diff
    <log>/<feed>/packs/*.parquet         or, with ``--layout packs``, many times per file
                                         (feed/txn/packs.py)
    <log>/<feed>/compacted/<c>/*.parquet all updates at times <= c consolidated to time c
    <log>/<feed>/quarantine/<seq>/…      bad input rows with raw text and reason
    <log>/<feed>/state/<seq>/…           keyed-state snapshot that commit <seq> goes with
    <log>/<feed>/_staging/…              a transaction's output before it is moved in place

Update files are named ``part-e<epoch>-<n>.parquet``; which of them hold a committed time is
said by the checkpoint's manifest, so a fenced-out writer's late files are never read. This
module only moves bytes; what is committed is decided by the checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import uuid
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from feed._faults import maybe_die
from feed.log.info import Clock, FeedInfo, SchemaVersion
from protocol import CheckpointError

__all__ = ["FeedLog", "feed_names", "log_root", "valid_feed_name"]

#: how the log's Parquet files of updates are written: 64 KiB pages (data and dictionary)
#: instead of 1 MiB. A pull stream holds one page per column while its consumer does not
#: read: ~2 MB for a 1M-update file instead of ~9 MB (docs/operations.md); reads and
#: writes cost the same
PARQUET_PAGES = {"data_page_size": 64 << 10, "dictionary_pagesize_limit": 64 << 10}
_FEED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_PART = re.compile(r"^part-e(\d+)-(\d+)\.parquet$")


def feed_names(uri: str) -> list[str]:
    """The feeds of the log at ``uri`` (folders with a ``feed.json``), in name order."""
    fs, root = log_root(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return sorted(
        i.base_name
        for i in infos
        if i.type == pafs.FileType.Directory
        and valid_feed_name(i.base_name)
        and fs.get_file_info(f"{i.path}/feed.json").type == pafs.FileType.File
    )


def log_root(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and root folder of a log URI (a local path or ``scheme://…``)."""
    try:
        if "://" in uri:
            fs, root = pafs.FileSystem.from_uri(uri)
        else:
            import os

            fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
    except (pa.ArrowInvalid, OSError) as e:
        raise CheckpointError(f"cannot open log {uri!r}: {e}") from e
    return fs, str(root).rstrip("/")


def valid_feed_name(name: str) -> bool:
    """Feed names are path segments: letters, digits, ``_ . -``; no ``..``, no slashes."""
    return bool(_FEED_NAME.fullmatch(name)) and ".." not in name


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: the file whose exclusive creation commits a compaction
COMPACTION_COMMITTED = "_committed.json"


class FeedLog:
    """Paths and file operations of one feed in a log."""

    def __init__(self, uri: str, feed: str, *, own_folder: bool = False) -> None:
        # (own_folder: one of the log's own folders, such as _groups, no feed's name)
        if not own_folder and not valid_feed_name(feed):
            raise CheckpointError(
                f"invalid feed name {feed!r}: use letters, digits, '_', '.', '-' (no '..')"
            )
        self.uri = uri
        self.feed = feed
        fs, root = log_root(uri)
        self.fs: pafs.FileSystem = fs
        self.root = f"{root}/{feed}"
        self.local_root = self.root if isinstance(fs, pafs.LocalFileSystem) else None

    @property
    def store(self) -> str | None:
        """The log's URI where its filesystem is not local (for pyarrow in Spark's tasks)."""
        return None if self.local_root is not None else self.uri

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def spark_path(self, *parts: str) -> str:
        """The same path as Spark wants it (a URI for object stores)."""
        p = self.path(*parts)
        if self.local_root is not None:
            return p
        scheme = self.uri.split("://", 1)[0]
        return f"{'s3a' if scheme == 's3' else scheme}://{p}"

    # ---- generic file operations -------------------------------------------------------
    def list_dir(self, path: str) -> list[pafs.FileInfo]:
        try:
            return list(self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)))
        except OSError as e:
            raise CheckpointError(f"feed {self.feed!r}: cannot list {path}: {e}") from e

    def exists(self, path: str) -> bool:
        return bool(self.fs.get_file_info(path).type != pafs.FileType.NotFound)

    def delete_dir(self, path: str) -> None:
        if self.exists(path):
            self.fs.delete_dir(path)

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(path)

    def write_bytes(self, path: str, data: bytes, *, private: bool = False) -> None:
        """Write a whole small file: to a temporary name, then renamed into place.
        ``private``: readable by its owner only (mode 0600 on a local disk), for a file
        that holds a secret."""
        parent = path.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"  # two writers never share one
        if private and self.local_root is not None:
            # created 0600, so the secret is never readable by others, not even briefly
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            os.chmod(tmp, 0o600)
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def sync(self, path: str) -> None:
        """Make a written file durable: fsync of the file and of its folder on a local disk
        (object stores keep what a finished write returned)."""
        if self.local_root is None:
            return
        _fsync(path)
        _fsync(path.rsplit("/", 1)[0])

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` only if it does not exist, durably and whole;
        ``False`` when it existed.

        Locally the bytes go to a hidden temporary file in the same folder, which is
        fsynced and then hard-linked to ``path`` (``link`` fails if ``path`` exists: the
        exclusive create), then the folder is fsynced. A crash at any point leaves either
        no ``path`` or the whole file, never an empty or partial one; a leftover temporary
        file is only litter. Other filesystems get check-then-write (pyarrow has no
        conditional put): there a racing writer is not excluded (docs/emitter.md).
        """
        parent = path.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        if self.local_root is None:
            if self.exists(path):
                return False
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return True
        if os.path.exists(path):
            return False
        tmp = f"{parent}/.{path.rsplit('/', 1)[1]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            maybe_die("before_link")
            maybe_die(f"before_link:{parent.rsplit('/', 1)[-1]}")
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        except OSError as e:
            raise CheckpointError(f"feed {self.feed!r}: cannot create {path}: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _fsync(parent)
        return True

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return bytes(f.read())

    # ---- feed.json ---------------------------------------------------------------------
    def info(self) -> FeedInfo | None:
        path = self.path("feed.json")
        if not self.exists(path):
            return None
        d = orjson.loads(self.read_bytes(path))
        return FeedInfo(
            name=d["name"],
            schema=d["schema"],
            key=tuple(d.get("key") or ()),
            clock=d["clock"],
            created=d["created"],
            table=d.get("table"),
            source=d.get("source"),
            granularity=d.get("granularity"),
            order=d.get("order"),
            deleted=d.get("deleted"),
            group=tuple(d.get("group") or ()),
            layout=d.get("layout") or "times",
        ).evolved_to(self.schema_versions())

    def schema_versions(self) -> list[SchemaVersion]:
        """Every ``schemas/<from>.json`` in the log, oldest first (committed or not: see
        :meth:`FeedInfo.at`)."""
        out = []
        for i in self.list_dir(self.path("schemas")):
            name = i.base_name
            if name.endswith(".json") and name[:-5].isdigit():
                out.append(SchemaVersion.from_json(self.read_bytes(i.path)))
        return sorted(out, key=lambda v: v.start)

    def write_schema_version(self, version: SchemaVersion) -> None:
        """Write a schema version before the commit of its first time (a redo of that
        time writes it again)."""
        self.write_bytes(self.path("schemas", f"{version.start:020d}.json"), version.to_json())

    def create(
        self,
        *,
        schema: dict[str, Any],
        key: tuple[str, ...],
        clock: Clock,
        table: str | None = None,
        group: tuple[str, ...] = (),
        **settings: Any,
    ) -> FeedInfo:
        # (a version an earlier, never committed run of this feed left is not this feed's)
        self.delete_dir(self.path("schemas"))
        info = FeedInfo(
            name=self.feed,
            schema=schema,
            key=key,
            clock=clock,
            created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            table=table,
            group=group,
            **settings,
        )
        self.write_bytes(self.path("feed.json"), info.to_json())
        return info

    # ---- times -------------------------------------------------------------------------
    def time_dirs(self) -> list[int]:
        out = []
        for i in self.list_dir(self.path("times")):
            if i.type == pafs.FileType.Directory and i.base_name.isdigit():
                out.append(int(i.base_name))
        return sorted(out)

    def time_files(self, time: int, epoch: int) -> list[str]:
        """The update files of ``time`` written by ``epoch``, in order."""
        files = []
        for i in self.list_dir(self.path("times", str(time))):
            m = _PART.match(i.base_name)
            if m and int(m.group(1)) == epoch:
                files.append((int(m.group(2)), i.path))
        return [p for _, p in sorted(files)]

    def parquet_files(self, folder: str) -> list[str]:
        """The Parquet files directly in ``folder`` (a full path), in name order."""
        return sorted(i.path for i in self.list_dir(folder) if i.base_name.endswith(".parquet"))

    def row_count(self, files: list[str]) -> int:
        """Rows in these Parquet files, from their footers (the data is not read)."""
        return sum(pq.ParquetFile(self.fs.open_input_file(f)).metadata.num_rows for f in files)

    def read_time(self, time: int, epoch: int) -> pa.Table | None:
        files = self.time_files(time, epoch)
        if not files:
            return None
        return pa.concat_tables([pq.read_table(f, filesystem=self.fs) for f in files])

    def delete_times_from(self, lowest: int) -> list[int]:
        """Delete every time folder at ``lowest`` or above (rollback of uncommitted work)."""
        gone = [t for t in self.time_dirs() if t >= lowest]
        for t in gone:
            self.fs.delete_dir(self.path("times", str(t)))
        return gone

    def install_time(self, time: int, epoch: int, staged_files: list[str]) -> list[str]:
        """Move a transaction's staged files for ``time`` into place, replacing this epoch's;
        return their paths relative to the feed folder (as manifests name them)."""
        target = self.path("times", str(time))
        self.fs.create_dir(target, recursive=True)
        for old in self.time_files(time, epoch):
            self.fs.delete_file(old)
        out = []
        for n, src in enumerate(sorted(staged_files)):
            name = f"part-e{epoch}-{n:05d}.parquet"
            self.fs.move(src, f"{target}/{name}")
            out.append(f"times/{time}/{name}")
        return out

    # ---- compaction (DESIGN §8; see feed/log/compaction.py) --------------------------------
    def compacted_since(self) -> int:
        """The highest committed compaction point (0 for a feed never compacted)."""
        for c in reversed(self.numbered_dirs("compacted")):
            if self.exists(self.path("compacted", str(c), COMPACTION_COMMITTED)):
                return c
        return 0

    def read_compacted(self, since: int) -> pa.Table:
        """The collection at ``since``: the record columns and ``diff`` (the multiplicity)."""
        files = self.parquet_files(self.path("compacted", str(since)))
        return pa.concat_tables([pq.read_table(f, filesystem=self.fs) for f in files])

    def numbered_dirs(self, name: str) -> list[int]:
        return sorted(
            int(i.base_name)
            for i in self.list_dir(self.path(name))
            if i.type == pafs.FileType.Directory and i.base_name.isdigit()
        )
