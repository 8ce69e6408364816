"""Input lines in an object store, read by Spark's tasks through pyarrow.

Spark's text reader would read ``s3://`` input as ``s3a://``, which needs the hadoop-aws
jars the pyspark wheel does not carry. For input in a store, :func:`read_store_text` gives
the same columns as Spark's reader does in :func:`feed.sources.rows.read_text` (``_raw``,
``_file`` as Spark's ``_metadata.file_path`` shows it, ``ord_file``, ``ord_row``), read by
the tasks with pyarrow: a file per task at a time, never split, in blocks of 16 MiB.

Lines break as Spark's do (``\\n``, ``\\r\\n`` or a lone ``\\r``); a byte that is not
UTF-8 becomes U+FFFD (Spark keeps such bytes as they are). A file compressed with gzip,
bzip2 or zstd is decompressed by its name, as Spark's codecs do; the Hadoop codecs pyarrow
does not read (``.deflate``, ``.lz4``, ``.snappy``) are refused before the job, by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from feed.sources import file_text
from feed.sources.file_text import HADOOP_ONLY
from feed.sources.inputs import spark_file_path
from feed.sources.stores import filesystem, reopenable
from protocol import SourceError

__all__ = ["LINE_COLUMNS", "read_store_text", "split_lines"]

#: the columns of the lines, as :func:`feed.sources.rows.read_text` gives them
LINE_COLUMNS = "_raw string, _file string, ord_file long, ord_row long"
_BATCH = 65_536  # lines per Arrow batch handed to Spark


def read_store_text(spark: Any, files: Sequence[str]) -> Any:
    """The lines of ``files`` (some or all in a store) as a DataFrame of
    :data:`LINE_COLUMNS`, read by Spark's tasks (see the module docstring)."""
    for path in files:
        if path.endswith(HADOOP_ONLY):
            raise SourceError(
                f"input file {path} is compressed with a Hadoop codec that input in an "
                "object store cannot be read with (gzip, bzip2 and zstd can): decompress it"
            )
    rows = [(reopenable(p), spark_file_path(p), i) for i, p in enumerate(files)]
    listing = spark.createDataFrame(rows, "uri string, name string, i long")
    return listing.mapInArrow(_lines_task(), LINE_COLUMNS)


def _lines_task() -> Callable[[Iterator[Any]], Iterator[Any]]:
    def run(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            files = zip(*(batch.column(c).to_pylist() for c in range(3)), strict=True)
            for uri, name, i in files:
                yield from _file_lines(uri, name, i)

    return run


def _file_lines(uri: str, name: str, index: int) -> Iterator[Any]:
    """Runs on executors: one file's lines as Arrow batches of :data:`LINE_COLUMNS`."""
    import pyarrow as pa

    fs, inner = filesystem(uri)
    with fs.open_input_stream(inner) as f:  # (compression detected from the name)
        blocks = iter(lambda: f.read(1 << 24), b"")
        lines = _named(name, split_lines(blocks))
        row = 0
        while chunk := list(itertools.islice(lines, _BATCH)):
            n = len(chunk)
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array(chunk, pa.string()),
                    pa.array([name] * n, pa.string()),
                    pa.array([index] * n, pa.int64()),
                    pa.array(range(row, row + n), pa.int64()),
                ],
                names=["_raw", "_file", "ord_file", "ord_row"],
            )
            row += n


def _named(name: str, lines: Iterator[str]) -> Iterator[str]:
    try:
        yield from lines
    except SourceError as e:
        raise SourceError(f"input file {name}: {e}") from None


def split_lines(blocks: Iterable[bytes]) -> Iterator[str]:
    """The lines of a file read in ``blocks``, broken where Spark's reader breaks them
    (``\n``, ``\r\n``, a lone ``\r``; no empty line after the last break), decoded
    with U+FFFD for a byte that is not UTF-8; a line past ``MAX_LINE`` bytes is an error."""
    rest = b""
    for block in blocks:
        data = rest + block
        # up to the last break (a final \r may be the first half of a \r\n)
        cut = max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1))
        complete, rest = data[: cut + 1], data[cut + 1 :]
        if len(rest) > file_text.MAX_LINE:  # (a small compressed file may hold one huge line)
            raise SourceError(f"a line longer than {file_text.MAX_LINE} bytes")
        for line in _breaks(complete)[:-1]:
            yield line.decode("utf-8", errors="replace")
    last = _breaks(rest)
    for line in last[:-1] if last[-1] == b"" else last:
        yield line.decode("utf-8", errors="replace")


def _breaks(data: bytes) -> list[bytes]:
    """``data`` split at Spark's line breaks (the last item: what follows the last one)."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
