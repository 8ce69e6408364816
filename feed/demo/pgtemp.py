"""A throwaway PostgreSQL cluster on 127.0.0.1 and its ground truth, for ``tidefeed demo
--postgres`` and the real-source tests.

It needs PostgreSQL's server programs (Debian: ``apt-get install postgresql``; they live in
``/usr/lib/postgresql/<version>/bin``). PostgreSQL refuses to run as root: as root the
cluster is created and run as the ``postgres`` system user, which the Debian package adds.
"""

from __future__ import annotations

import datetime as dt
import decimal
import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from protocol import SourceError

__all__ = [
    "TempPostgres",
    "feed_multiset",
    "feed_multisets",
    "find_pg_bin",
    "normalize",
    "table_multiset",
]


def find_pg_bin() -> str | None:
    """The folder holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is absent."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(found))
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0,
    )
    return os.path.dirname(versions[-1]) if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TempPostgres:
    """``start()`` a fresh cluster with ``wal_level=logical``; ``stop()`` deletes it."""

    port: int = 0
    root: str = ""
    _as_user: list[str] = field(default_factory=list, init=False, repr=False)
    _pg_ctl: str = field(default="", init=False, repr=False)
    _data: str = field(default="", init=False, repr=False)

    def start(self) -> TempPostgres:
        pg_bin = find_pg_bin()
        if pg_bin is None:
            raise SourceError(
                "PostgreSQL's server programs (initdb, pg_ctl) are not installed; on Debian or "
                "Ubuntu: apt-get install postgresql"
            )
        self.port = self.port or _free_port()
        self.root = tempfile.mkdtemp(prefix="tidefeed-pg-")
        try:
            return self._start(pg_bin)
        except BaseException:  # (a failed initdb, a Ctrl-C): no cluster folder left behind
            self.stop()
            raise

    def _start(self, pg_bin: str) -> TempPostgres:
        as_user: list[str] = []
        if os.geteuid() == 0:
            # the server refuses to run as root
            as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, user="postgres")
        data = os.path.join(self.root, "data")
        self._as_user, self._pg_ctl, self._data = as_user, f"{pg_bin}/pg_ctl", data
        self._run(
            [
                *as_user,
                f"{pg_bin}/initdb",
                "-D",
                data,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            "initdb",
        )
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c wal_level=logical "
            "-c max_wal_senders=8 -c max_replication_slots=8 -c fsync=off"
        )
        self._run(
            [
                *as_user,
                self._pg_ctl,
                "-D",
                data,
                "-o",
                options,
                "-l",
                os.path.join(self.root, "server.log"),
                "-w",
                "start",
            ],
            "pg_ctl start",
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        raise SourceError(f"PostgreSQL did not start on 127.0.0.1:{self.port}")

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        """Stop the server and delete the cluster's folder. A server already shutting
        down (a Ctrl-C reaches it too) may still write into the folder for a moment: the
        deletion is tried again until the folder is gone (at most 10 s)."""
        if not self.root:
            return
        if self._pg_ctl and os.path.isdir(self._data):
            subprocess.run(
                [*self._as_user, self._pg_ctl, "-D", self._data, "-m", "immediate", "stop"],
                capture_output=True,
                check=False,
            )
        deadline = time.monotonic() + 10
        while True:
            shutil.rmtree(self.root, ignore_errors=True)
            if not os.path.exists(self.root) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.root = ""

    @staticmethod
    def _run(cmd: list[str], what: str) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SourceError(f"{what} failed: {(r.stderr or r.stdout).strip()[-500:]}")


_EXACT = decimal.Context(prec=1000)


def normalize(v: Any) -> Any:
    """A column value in one comparable form, whichever side read it: PostgreSQL's driver
    (Decimal, aware datetimes, time, dict for jsonb) or the feed (Arrow's Python values,
    times of day as microseconds, json as text)."""
    if isinstance(v, decimal.Decimal):
        # (the default context would round to 28 digits)
        return format(v.normalize(_EXACT), "f")
    if isinstance(v, dt.datetime):
        return (v.astimezone(dt.UTC) if v.tzinfo else v).isoformat()
    if isinstance(v, dt.time):
        return ((v.hour * 60 + v.minute) * 60 + v.second) * 1_000_000 + v.microsecond
    if isinstance(v, dt.date):
        return v.isoformat()
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    return v


def table_multiset(cursor: Any, table: str) -> Counter[tuple[Any, ...]]:
    """``SELECT * FROM table`` as a multiset of normalized rows."""
    cursor.execute(f"SELECT * FROM {table}")
    cols = [d[0] for d in cursor.description]
    return Counter(
        tuple((c, normalize(v)) for c, v in zip(cols, row, strict=True)) for row in cursor
    )


def feed_multiset(
    reader: Any, at: int | None = None, json_columns: Iterable[str] = ()
) -> Counter[tuple[Any, ...]]:
    """A feed's collection at ``at`` as a multiset of rows normalized like
    :func:`table_multiset` (``json_columns`` hold JSON text, compared parsed)."""
    json_cols = set(json_columns)
    out: Counter[tuple[Any, ...]] = Counter()
    for row in reader.snapshot(at).to_pylist():
        n = row.pop("count")
        out[_row_key(row, json_cols)] += n
    return out


def _row_key(row: dict[str, Any], json_cols: set[str]) -> tuple[Any, ...]:
    return tuple(
        (k, normalize(json.loads(v) if k in json_cols and v is not None else v))
        for k, v in row.items()
    )


def feed_multisets(
    reader: Any, json_columns: Iterable[str] = ()
) -> Iterator[tuple[int, Counter[tuple[Any, ...]]]]:
    """The collection at every complete time of a feed of one schema version, from 0
    below its frontier, each as :func:`feed_multiset` gives it: each time's updates
    read once and applied in turn (asking :func:`feed_multiset` for every time reads the
    whole feed each time)."""
    if reader.since:
        raise ValueError("feed_multisets reads a feed from time 0: this one is compacted")
    json_cols = set(json_columns)
    names = [f.name for f in reader.record_type]
    out: Counter[tuple[Any, ...]] = Counter()
    with_updates = set(reader.times())
    for t in range(reader.frontier):
        if t in with_updates:
            for row in reader.table(t).select([*names, "diff"]).to_pylist():
                n = row.pop("diff")
                key = _row_key(row, json_cols)
                out[key] += n
                if not out[key]:
                    del out[key]
        yield t, Counter(out)
