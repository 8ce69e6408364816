"""Where input files are: a local path or a store URI, and the pyarrow filesystem that
opens it (each store opened once per set of options)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs

from protocol import SourceError

__all__ = ["filesystem", "is_remote", "local_path", "reopenable"]

#: the filesystem of each store (``scheme://bucket``) a URI named, with the URI's options
#: (the part after ``?``): listing a source on every poll and opening the files it lists
#: (URIs without options) use it again instead of opening the store anew
_STORES: dict[str, tuple[str, pafs.FileSystem]] = {}


def is_remote(path: str) -> bool:
    """Whether ``path`` is a store URI (``s3://…``), not a local path."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return os.path.abspath(path.removeprefix("file://"))


def filesystem(path: str, what: str = "input") -> tuple[pafs.FileSystem, str]:
    """The filesystem of a local path or a store URI, and the path in it. A store is
    opened again only for a URI that gives other options."""
    if not is_remote(path):
        return pafs.LocalFileSystem(), local_path(path)
    scheme, rest = path.split("://", 1)
    inner, _, options = rest.partition("?")
    store = f"{scheme}://{inner.split('/', 1)[0]}"
    cached = _STORES.get(store)
    if cached is not None and (not options or options == cached[0]):
        return cached[1], inner
    try:
        fs, opened = pafs.FileSystem.from_uri(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise SourceError(f"cannot open {what} {path!r}: {e}") from e
    _STORES[store] = (options, fs)
    return fs, opened


def reopenable(path: str) -> str:
    """A store file's URI with the options its store was opened with (the listing's
    ``?endpoint_override=…``), so that another process (a Spark task) opens the store the
    same way; a local path as it is."""
    if not is_remote(path) or "?" in path:
        return path
    scheme, rest = path.split("://", 1)
    cached = _STORES.get(f"{scheme}://{rest.split('/', 1)[0]}")
    return f"{path}?{cached[0]}" if cached is not None and cached[0] else path
