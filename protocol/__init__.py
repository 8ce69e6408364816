"""What both ends of a tidefeed speak: messages, semantics, codecs (no Spark needed).

Its names load on first use (PEP 562): ``from protocol import TidefeedError`` reads
protocol/errors.py alone, not the codecs, the client and the pyarrow and aiohttp they need.
So a command that only parses its options (``tidefeed --help``, a usage error) needs
neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._consolidate import consolidate
    from .checker import FeedChecker, Violation, check_messages
    from .client import ClientError, CompleteTime, FeedClient
    from .codecs import CODECS, Codec, Decoder, Encoder, codec_for_content_type, get_codec
    from .errors import (
        CheckpointError,
        CodecError,
        CommitConflict,
        Compacted,
        Conflict,
        CountMismatch,
        Gap,
        ProtocolError,
        SourceError,
        StaleEpoch,
        TidefeedError,
    )
    from .messages import Message, Progress, Update, Updates, announcement, progress, record_key
    from .schema import arrow_to_avro, avro_to_arrow, cdcv2_schema, fingerprint
    from .state import ApplyResult, Consumer
    from .stores import MemoryStore, Store, StoreState

__all__ = [
    "CODECS",
    "ApplyResult",
    "CheckpointError",
    "ClientError",
    "Codec",
    "CodecError",
    "CommitConflict",
    "Compacted",
    "CompleteTime",
    "Conflict",
    "Consumer",
    "CountMismatch",
    "Decoder",
    "Encoder",
    "FeedChecker",
    "FeedClient",
    "Gap",
    "MemoryStore",
    "Message",
    "Progress",
    "ProtocolError",
    "SourceError",
    "StaleEpoch",
    "Store",
    "StoreState",
    "TidefeedError",
    "Update",
    "Updates",
    "Violation",
    "announcement",
    "arrow_to_avro",
    "avro_to_arrow",
    "cdcv2_schema",
    "check_messages",
    "codec_for_content_type",
    "consolidate",
    "fingerprint",
    "get_codec",
    "progress",
    "record_key",
]

#: the submodule that defines each public name
_WHERE = {
    "FeedChecker": "checker",
    "Violation": "checker",
    "check_messages": "checker",
    "ClientError": "client",
    "CompleteTime": "client",
    "FeedClient": "client",
    "CODECS": "codecs",
    "Codec": "codecs",
    "Decoder": "codecs",
    "Encoder": "codecs",
    "codec_for_content_type": "codecs",
    "get_codec": "codecs",
    "consolidate": "_consolidate",
    "CheckpointError": "errors",
    "CodecError": "errors",
    "CommitConflict": "errors",
    "Compacted": "errors",
    "Conflict": "errors",
    "CountMismatch": "errors",
    "Gap": "errors",
    "ProtocolError": "errors",
    "SourceError": "errors",
    "StaleEpoch": "errors",
    "TidefeedError": "errors",
    "Message": "messages",
    "Progress": "messages",
    "Update": "messages",
    "Updates": "messages",
    "announcement": "messages",
    "progress": "messages",
    "record_key": "messages",
    "arrow_to_avro": "schema",
    "avro_to_arrow": "schema",
    "cdcv2_schema": "schema",
    "fingerprint": "schema",
    "ApplyResult": "state",
    "Consumer": "state",
    "MemoryStore": "stores",
    "Store": "stores",
    "StoreState": "stores",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'protocol' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
