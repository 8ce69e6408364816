"""``tidefeed check`` and ``tidefeed convert``: the commands on feed files (any format).

Part of the command line in :mod:`feed.cli.main`, which dispatches to them.
"""

from __future__ import annotations

import argparse
import sys
from typing import IO, Any

import orjson

from protocol import CodecError

__all__ = ["cmd_check", "cmd_convert", "sniff_format"]


def sniff_format(head: bytes) -> str:
    """Guess a stream's format from its first bytes: Avro and Arrow have magic numbers."""
    if head.startswith(b"Obj\x01"):
        return "avro"
    if head.startswith(b"\xff\xff\xff\xff"):
        return "arrow"
    return "ndjson"


def _peek(stream: IO[bytes]) -> bytes:
    """The first bytes of a buffered binary stream, without consuming them."""
    peek = getattr(stream, "peek", None)
    return bytes(peek(8)[:8]) if peek is not None else b""


def _open_in(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as e:
        raise SystemExit(f"tidefeed: cannot open {path}: {e.strerror}") from e


def _load_schema(path: str | None) -> Any:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return orjson.loads(f.read())
    except OSError as e:
        raise SystemExit(f"tidefeed: cannot read schema {path}: {e.strerror}") from e
    except orjson.JSONDecodeError as e:
        raise SystemExit(f"tidefeed: schema {path} is not JSON: {e}") from e


def cmd_check(args: argparse.Namespace) -> int:
    from protocol import FeedChecker, get_codec  # (pyarrow: only the commands that read)

    src = _open_in(args.file)
    fmt = args.format or sniff_format(_peek(src))
    decoder = get_codec(fmt).decoder(src, tables=True)  # (the checker hashes Arrow tables)
    key = [c for c in args.key.split(",") if c] if args.key else None
    checker = FeedChecker(non_negative=args.non_negative, key=key)
    name = "stdin" if args.file == "-" else args.file
    try:
        for message in decoder:
            checker.check(message, position=decoder.position)
    except CodecError as e:
        for v in checker.violations:
            print(f"{name}: {v}")
        print(f"{name}: malformed {fmt}: {e}")
        return 1
    violations = checker.finish()
    for v in violations:
        print(f"{name}: {v}")
    summary = (
        f"{name}: {checker.messages} messages, {checker.updates} updates, "
        f"frontier {checker.frontier}"
    )
    if violations:
        print(f"{summary}: INVALID ({len(violations)} violation(s))", file=sys.stderr)
        return 1
    if not checker.messages:
        # nothing read is not a valid feed: a wrong file, or a producer that wrote nothing
        print(f"{name}: no messages at all: nothing to check (empty input)", file=sys.stderr)
        return 1
    print(f"{summary}: valid", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from protocol import get_codec

    src = _open_in(args.input)
    schema = _load_schema(args.schema)
    decoder = get_codec(args.from_).decoder(src, schema=schema, tables=True)
    out = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")  # noqa: SIM115
    encoder = None
    try:
        for message in decoder:
            if encoder is None:
                # Avro and Arrow inputs know their record schema once the header is read
                encoder = get_codec(args.to).encoder(out, schema=schema or decoder.record_schema)
            encoder.write(message)
        if encoder is None:
            encoder = get_codec(args.to).encoder(out, schema=schema or decoder.record_schema)
        encoder.close()
    finally:
        out.flush()
        if out is not sys.stdout.buffer:
            out.close()
    return 0
