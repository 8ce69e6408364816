"""The protocol's defaults that a command line shows before it runs anything: the format
names, how long a server waits for a request, where pushes may go. A module of constants
alone, so that ``tidefeed --help`` and its usage errors need neither pyarrow nor aiohttp
(the codecs, protocol/_http.py and protocol/destinations.py take them from here)."""

from __future__ import annotations

__all__ = ["DEFAULT_PUSH_ALLOW", "FORMATS", "IDLE_TIMEOUT"]

#: the wire formats, in the order ``--format`` lists them (protocol/codecs.py's CODECS)
FORMATS = ("ndjson", "avro", "arrow")

#: both servers close a connection that sends no whole request for this many seconds: a
#: client that never finishes its headers, or stays connected doing nothing between
#: requests (aiohttp's keep-alive timeout, which runs from the connection's start)
IDLE_TIMEOUT = 30.0

#: where pushes may go unless ``--push-allow`` says otherwise: this machine only
DEFAULT_PUSH_ALLOW = "127.0.0.0/8,::1,localhost"
