"""The feed server's limits that ``tidefeed serve --help`` shows: constants alone, so the
command line reads them without loading the server (feed/serve/state.py takes them from
here) and the aiohttp it needs."""

from __future__ import annotations

__all__ = ["COMPACT_SECONDS", "MAX_STREAMS", "MAX_STREAMS_PER_CLIENT", "STALL_SECONDS"]

#: pull streams open at a time in all and from one client address, and how long a
#: stream's consumer may take nothing of a write before the stream is closed
MAX_STREAMS = 64
MAX_STREAMS_PER_CLIENT = 16
STALL_SECONDS = 60.0
#: how often the server compacts (``serve --compact-every``)
COMPACT_SECONDS = 60.0
