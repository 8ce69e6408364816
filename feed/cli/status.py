"""``tidefeed status --log LOG``: what an operator asks first, read from the log alone.

For every feed: its frontier and ``since``, when it last committed, the emitter that
holds it (feed/log/lease.py: who, and whether its lease is live), and each subscription with
its kind, ACKed frontier, lag in times and state (a stopped push says why). No server
and no Spark are needed; a server running on the same log shows the same subscriptions
(it writes ACKed positions every few seconds).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from feed.log.checkpoint import CheckpointStore
from feed.log.lease import LEASE_SECONDS, read_lease
from feed.log.reader import FeedReader
from feed.log.store import FeedLog, feed_names, log_root
from feed.log.subscriptions import SubscriptionStore
from protocol import CheckpointError

__all__ = ["log_status", "print_status"]


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    ago = max(0.0, time.time() - ts)
    unit = (
        f"{ago:.0f} s"
        if ago < 120
        else f"{ago / 60:.0f} min"
        if ago < 7200
        else f"{ago / 3600:.1f} h"
    )
    stamp = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{stamp} ({unit} ago)"


def feed_status(log: str, feed: str) -> dict[str, Any]:
    fl = FeedLog(log, feed)
    reader = FeedReader(log, feed)
    cp = reader.checkpoint
    store = CheckpointStore(fl)
    committed = fl.fs.get_file_info(store.path_of(cp.seq)).mtime if cp is not None else None
    lease = read_lease(fl)
    emitter = None
    if lease is not None:
        live = time.time() - float(lease.get("renewed", 0)) <= LEASE_SECONDS
        emitter = {
            "host": lease.get("host"),
            "pid": lease.get("pid"),
            "since": lease.get("since"),
            "renewed": lease.get("renewed"),
            "live": live,
        }
    subs = []
    for sub in sorted(SubscriptionStore(fl).subs.values(), key=lambda s: s.name):
        subs.append(
            {
                "name": sub.name,
                "kind": sub.kind,
                "url": sub.url or sub.held_by or None,
                "acked": sub.acked,
                "acked_at": sub.acked_at,
                "lag_times": None if sub.acked is None else reader.frontier - sub.acked,
                "status": sub.status,
                "reason": sub.reason or sub.last_error,
            }
        )
    return {
        "feed": feed,
        "frontier": reader.frontier,
        "since": reader.since,
        "last_commit": committed.timestamp() if committed is not None else None,
        "emitter": emitter,
        "subscriptions": subs,
    }


def log_status(log: str) -> list[dict[str, Any]]:
    """Every feed of the log, as :func:`feed_status` gives it."""
    fs, root = log_root(log)
    import pyarrow.fs as pafs

    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise CheckpointError(f"no feed log at {log!r}")
    return [feed_status(log, f) for f in feed_names(log)]


def print_status(log: str, fmt: str, out: IO[str]) -> int:
    feeds = log_status(log)
    if fmt == "json":
        out.write(orjson.dumps(feeds, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    if not feeds:
        print(f"{log}: no feeds yet", file=out)
        return 0
    for f in feeds:
        e = f["emitter"]
        held = (
            f"pid {e['pid']} on {e['host']} since {e['since']}"
            + ("" if e["live"] else " (lease expired: not running)")
            if e
            else "none running"
        )
        print(
            f"feed {f['feed']}: frontier {f['frontier']}, since {f['since']}, last commit "
            f"{_when(f['last_commit'])}; emitter: {held}",
            file=out,
        )
        for s in f["subscriptions"]:
            where = f" -> {s['url']}" if s["url"] else ""
            why = f" ({s['reason'][:120]})" if s["reason"] else ""
            behind = (
                "nothing ACKed yet"
                if s["acked"] is None
                else f"acked {s['acked']} ({_when(s['acked_at'])}), {s['lag_times']} time(s) behind"
            )
            print(
                f"  {s['kind']} subscription {s['name']}{where}: {behind}, {s['status']}{why}",
                file=out,
            )
    return 0
