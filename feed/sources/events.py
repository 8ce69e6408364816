"""Telling a change event from the other lines of a JSON-lines source, with nothing but
the line: what file listing (feed/sources/inputs.py) and the Debezium reader share."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["debezium_event"]


def debezium_event(line: bytes) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(wrapper, payload) of one JSON line if it is a Debezium change event, with or
    without the ``{"schema","payload"}`` wrapper; None for anything else (tombstones,
    heartbeats, transaction metadata, malformed lines)."""
    try:
        e = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(e, dict):
        return None
    payload = e.get("payload", e)
    if isinstance(payload, dict) and payload.get("op") is not None:
        return e, payload
    return None
