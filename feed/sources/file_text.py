"""The text of an input file as the driver reads it: its lines, decompressed by the
file's name as Spark's reader does, within bounds a small compressed file cannot pass."""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Generator, Sequence
from typing import Any

import pyarrow as pa

from feed.sources.stores import filesystem
from protocol import SourceError

__all__ = [
    "HADOOP_ONLY",
    "MAX_LINE",
    "Lines",
    "check_compressed",
    "codec_of",
    "input_lines",
    "is_ascii",
    "mapped",
    "search_text",
    "tail",
]


def input_lines(path: str, *, limit: int | None = None) -> Generator[bytes, None, None]:
    """The lines of an input file, read in blocks of 1 MiB (local or in a store), a file
    compressed with gzip, bzip2 or zstd decompressed by its name as Spark's reader does
    (one compressed by a Hadoop codec pyarrow does not read is refused, by name). A line
    past :data:`MAX_LINE` bytes, or text past ``limit`` bytes, is a :class:`SourceError`:
    a small compressed file may hold far more."""
    fs, inner = filesystem(path)
    codec = codec_of(path)
    try:
        with fs.open_input_stream(inner, compression=codec) as f:
            rest, read = b"", 0
            while block := f.read(1 << 20):
                read += len(block)
                if limit is not None and read > limit:
                    raise SourceError(f"input file {path}: more than {limit} bytes of text")
                lines = (rest + block).split(b"\n")
                rest = lines.pop()
                if len(rest) > MAX_LINE:
                    raise SourceError(f"input file {path}: a line longer than {MAX_LINE} bytes")
                yield from lines
            if rest:
                yield rest
    except (OSError, pa.ArrowInvalid) as e:
        if codec is None:
            raise
        raise SourceError(f"input file {path} could not be decompressed ({codec}): {e}") from e


def search_text(
    files: Sequence[str], pattern: re.Pattern[bytes], size: int, *, whole: int, head: int = 0
) -> tuple[str, bytes] | None:
    """The first file of local, uncompressed ``files`` (``size`` bytes in all) whose
    text holds ``pattern``, and what matched: each file read whole when ``size`` is
    ``whole`` bytes at most, else the first ``head`` bytes of each (none: nothing read)."""
    if size > whole and head <= 0:
        return None
    for path in files:
        with open(path, "rb") as f:
            found = pattern.search(f.read() if size <= whole else f.read(head))
        if found is not None:
            return path, found.group()
    return None


def codec_of(path: str) -> str | None:
    """pyarrow's name of the codec Spark's reader takes from ``path``'s name, if any."""
    if path.endswith(HADOOP_ONLY):
        raise SourceError(f"input file {path}: a Hadoop codec only Spark reads (give --schema)")
    return next((c for e, c in _PYARROW_CODECS.items() if path.endswith(e)), None)


def tail(path: str, size: int) -> bytes:
    """The last ``size`` bytes of an input file."""
    fs, inner = filesystem(path)
    with fs.open_input_file(inner) as f:
        f.seek(max(0, f.size() - size))
        return bytes(f.read())


#: the name endings of Hadoop codecs Spark reads and pyarrow does not
HADOOP_ONLY = (".deflate", ".lz4", ".snappy")
_PYARROW_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
#: the longest line read on the driver (a Debezium event is far shorter)
MAX_LINE = 256 << 20

#: the name endings Spark's readers take a codec from, with the bytes such data starts with
_MAGIC = {
    ".gz": ("gzip", b"\x1f\x8b"),
    ".bz2": ("bzip2", b"BZh"),
    ".zst": ("zstd", b"\x28\xb5\x2f\xfd"),
}


def check_compressed(files: Sequence[str]) -> None:
    """Refuse an input file named as compressed whose first bytes are not that codec's:
    Spark's codec would fail the whole transaction with an error naming no file."""
    for path in files:
        for ending, (codec, magic) in _MAGIC.items():
            if not path.endswith(ending):
                continue
            fs, inner = filesystem(path)
            with fs.open_input_stream(inner, compression=None) as f:
                head = bytes(f.read(len(magic)))
            if head and head != magic:
                raise SourceError(
                    f"input file {path} is named {ending} but does not hold {codec} data (it "
                    f"starts with {head!r}): compress it, or name it without {ending}"
                )


#: the first bytes of a line that may be blank or ``null`` (:meth:`Lines.objects`)
_ODD_FIRST = (ord("\n"), ord(" "), ord("n"))
#: the bytes :class:`Lines` looks through at a time
_STEP = 1 << 20


def mapped(path: str) -> bytes | mmap.mmap:
    """A local file's bytes to parse, mapped rather than read (an empty file: ``b""``).

    A read copies the file into fresh memory, and the kernel zeroes every page of it as it
    is first touched: for a task that parses file after file, a fifth of its time went to
    those pages. A mapping shares the page cache's pages, copies nothing, and is unmapped
    when the last view of it goes. (A file cut short while it is read: the parse finds
    the cut line and declines, and the Spark path reads the file as it then is; a page
    past the new end, if touched, kills the task's worker with SIGBUS, and the task fails
    as any task whose worker dies does.)"""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class Lines(Sequence[bytes]):
    """The lines of ``data`` as ``data.split(b"\\n")`` gives them (no empty line after
    the last break), found by numpy: no bytes object per line unless one is asked for."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        import numpy as np

        self.data = data
        # (in steps: a mask of the whole file is as large as the file, and a task's fresh
        # memory of that size costs more to touch than the search itself)
        view = np.frombuffer(data, np.uint8)
        found = [
            np.flatnonzero(view[at : at + _STEP] == 10) + at for at in range(0, len(view), _STEP)
        ]
        breaks = np.concatenate(found) if found else np.zeros(0, np.int64)
        ends = breaks if not len(view) or view[-1] == 10 else np.append(breaks, len(data))
        self.starts = np.concatenate([[0], breaks + 1])[: len(ends)]
        self.ends = ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, n: int) -> bytes:  # type: ignore[override]
        return self.data[self.starts[n] : self.ends[n]]

    def texts(self, numbers: Any, at: Any, n: int) -> pa.Array:
        """The lines numbered ``numbers`` (ascending, numpy) as ``n`` strings, each at its
        row in ``at`` (ascending, as many), null at the others: one copy of their text,
        no bytes object per line. The text must be UTF-8 (the caller checked)."""
        import numpy as np

        numbers = np.asarray(numbers, np.int64)
        # (each line and the gap up to the next one's start as values of their own: the
        # offsets rise, so the array is made over the text as it is, then every other
        # value taken)
        bounds = np.empty(2 * len(numbers) + 1, np.int64)
        bounds[0:-1:2], bounds[1::2] = self.starts[numbers], self.ends[numbers]
        bounds[-1] = bounds[-2] if len(numbers) else 0
        offsets = pa.py_buffer(bounds)
        both = pa.Array.from_buffers(
            pa.large_string(), 2 * len(numbers), [None, offsets, pa.py_buffer(self.data)]
        )
        texts = both.take(np.arange(0, 2 * len(numbers), 2)).cast(pa.string())
        return _spread(texts, np.asarray(at, np.int64), n)

    def longer(self, size: int) -> list[int]:
        """The numbers of the lines of ``size`` bytes or more."""
        import numpy as np

        return np.flatnonzero(self.ends - self.starts >= size).tolist()

    def objects(self) -> tuple[list[int] | range, list[int]]:
        """The numbers of the lines holding a JSON value other than ``null``, and those
        of the tombstones (``null``); blank lines are neither, as in Spark. (A line of
        ``null`` must never reach pyarrow's reader, which crashes on it.)"""
        import numpy as np

        data = self.data
        # (a blank line, one led by a space, or one that may be ``null`` starts with one
        # of these bytes: looked up at the lines' starts, not searched for in the text)
        view = np.frombuffer(data, np.uint8)
        first = view[self.starts[self.starts < len(view)]]
        if not np.isin(first, _ODD_FIRST).any() and len(first) == len(self):
            return range(len(self)), []  # (no blank line, none that may be null)
        objs, tombs = [], []
        for n, line in enumerate(self):
            s = line.strip(b" ")
            if s == b"null":
                tombs.append(n)
            elif s:
                objs.append(n)
        return objs, tombs


def _spread(texts: pa.Array, at: Any, n: int) -> pa.Array:
    """``texts`` (a string array) at the rows ``at`` (ascending) of ``n``, null elsewhere:
    the same text buffer under new offsets, no copy of the text."""
    import numpy as np

    offsets = np.frombuffer(texts.buffers()[1], np.int32)[
        texts.offset : texts.offset + len(texts) + 1
    ]
    sizes = np.zeros(n, np.int32)
    sizes[at] = np.diff(offsets)
    spread = np.empty(n + 1, np.int32)
    spread[0] = offsets[0]
    np.cumsum(sizes, out=spread[1:])
    spread[1:] += offsets[0]
    valid = np.zeros(n, np.bool_)
    valid[at] = True
    bitmap = pa.array(valid).buffers()[1]
    return pa.Array.from_buffers(pa.string(), n, [bitmap, pa.py_buffer(spread), texts.buffers()[2]])


def is_ascii(data: bytes | mmap.mmap) -> bool:
    """Whether every byte of ``data`` is ASCII (a mapping: looked at 1 MiB at a time)."""
    import numpy as np

    if isinstance(data, bytes):
        return data.isascii()
    view = np.frombuffer(data, np.uint8)
    return all(view[at : at + _STEP].max() < 128 for at in range(0, len(view), _STEP))
