"""The exception tree of tidefeed.

Every error raised on purpose by tidefeed derives from :class:`TidefeedError`, and
mixes in the built-in exception a caller would naturally catch::

    TidefeedError
    ├── ProtocolError (ValueError)          a message stream breaks DESIGN §2/§3
    │   ├── CountMismatch                   pending updates differ from a progress' counts
    │   ├── Conflict                        same (record, time) with another diff
    │   ├── Gap                             progress lower is above the frontier
    │   └── StaleEpoch                      a push from a fenced-out producer
    ├── CodecError (ValueError)             a body cannot be decoded or encoded
    ├── CheckpointError (OSError)           the checkpoint store cannot be read or written
    │   └── CommitConflict                  another writer committed this seq first
    ├── Compacted (LookupError)             a position below the feed's since (DESIGN §8)
    └── SourceError (ValueError)            an input row cannot be turned into changes

Errors from pyarrow, fastavro, aiohttp and py4j are wrapped at the boundary where they
occur, so callers never need to import those libraries to handle failures. Messages
name the feed, the time and what was expected whenever those are known.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CodecError",
    "CommitConflict",
    "Compacted",
    "Conflict",
    "CountMismatch",
    "Gap",
    "ProtocolError",
    "SourceError",
    "StaleEpoch",
    "TidefeedError",
]


class TidefeedError(Exception):
    """Root of every error tidefeed raises on purpose."""


class ProtocolError(TidefeedError, ValueError):
    """A message stream violates the feed semantics (DESIGN §2 and §3)."""

    code = "protocol_violation"


class CountMismatch(ProtocolError):
    """The pending updates at some time do not match the progress' stated count."""

    code = "count_mismatch"


class Conflict(ProtocolError):
    """An update repeats a pending (record, time) with a different diff."""

    code = "conflict"


class Gap(ProtocolError):
    """A progress starts above the consumer's frontier: times in between were never closed."""

    code = "gap"


class StaleEpoch(ProtocolError):
    """A push carries an epoch below the one the consumer has adopted."""

    code = "stale_epoch"


class CodecError(TidefeedError, ValueError):
    """A body cannot be decoded (or a message cannot be encoded) in the named format.

    ``position`` says where: a line number for NDJSON, a datum or batch index for Avro
    and Arrow, when known.
    """

    code = "malformed_body"

    def __init__(self, message: str, *, fmt: str = "", position: str = "") -> None:
        where = f" at {position}" if position else ""
        prefix = f"{fmt}{where}: " if fmt or where else ""
        super().__init__(prefix + message)
        self.fmt = fmt
        self.position = position


class CheckpointError(TidefeedError, OSError):
    """The checkpoint store cannot be read or written."""

    code = "checkpoint_error"


class CommitConflict(CheckpointError):
    """Another writer committed the same checkpoint sequence number first: this one is stale."""

    code = "commit_conflict"


class Compacted(TidefeedError, LookupError):
    """A consumer asked for times that compaction folded away; it must take a snapshot."""

    def __init__(self, message: str, *, since: int) -> None:
        super().__init__(message)
        self.since = since


class SourceError(TidefeedError, ValueError):
    """An input row cannot be turned into changes."""

    code = "bad_source_row"
