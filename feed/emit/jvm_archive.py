"""An archive of the classes the JVM loads to start Spark (Java's application class-data
sharing), so that each process that starts Spark starts it sooner.

Starting Spark loads some twenty thousand classes from Spark's jars, parsing and verifying
each one. A JVM given an archive of them (``-XX:SharedArchiveFile``) maps them instead:
on this project's 2-core machine a session started in ~4.5 s instead of ~6.8 s and its
first job took ~1.2 s instead of ~2.5 s (docs/operations.md, "Start-up"). The archive is
optional: ``TIDEFEED_JVM_ARCHIVE=PATH`` names it, and every Spark tidefeed starts then
maps it when the file is there. ``python -m feed.cli.jvm_archive PATH`` makes one (the
Makefile does, for its tests).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "QUIET", "jvm_options", "with_archive", "without_archive"]

#: the environment variable that names the archive
ENV = "TIDEFEED_JVM_ARCHIVE"
#: the JVM's own report of the archive (a line per class it could not keep) stays quiet
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
#: how the options of :func:`jvm_options` that map the archive begin
_MAPPING = ("-XX:SharedArchiveFile=", "-Xshare:")


def jvm_options(path: str | None = None) -> str:
    """The JVM options that map the archive ``path`` (default: ``$TIDEFEED_JVM_ARCHIVE``),
    or "" when none is named, the file is not there, or its name holds a space (Spark's
    launcher splits its options at spaces)."""
    path = os.environ.get(ENV) if path is None else path
    if not path or not os.path.isfile(path) or any(c.isspace() for c in path):
        return ""
    return f"-XX:SharedArchiveFile={os.path.abspath(path)} -Xshare:auto {QUIET}"


def with_archive(opts: str) -> str:
    """``SPARK_SUBMIT_OPTS`` (``opts``) with the archive's options added, once."""
    extra = jvm_options()
    if not extra or "-XX:SharedArchiveFile" in opts:
        return opts
    return f"{opts} {extra}".strip()


def without_archive(opts: str) -> str:
    """``SPARK_SUBMIT_OPTS`` (``opts``) without the options that map an archive: a JVM
    that maps one cannot write one (:mod:`feed.cli.jvm_archive` makes them)."""
    return " ".join(o for o in opts.split() if not o.startswith(_MAPPING))
