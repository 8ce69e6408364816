"""What both ends of a tidefeed speak: messages, semantics, codecs (no Spark needed)."""

from .checker import FeedChecker, Violation, check_messages
from .client import ClientError, CompleteTime, FeedClient
from .codecs import CODECS, Codec, Decoder, Encoder, codec_for_content_type, get_codec
from .consolidate import consolidate
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
