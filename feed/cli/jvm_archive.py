"""``python -m feed.cli.jvm_archive PATH``: make the class archive of Spark's JVM that
:mod:`feed.emit.jvm_archive` maps (``TIDEFEED_JVM_ARCHIVE``).

The JVM checks an archive against itself and its class path and ignores one made for
another Java or another Spark; a *truncated* archive, though, stops it starting. So an
archive is made under a temporary name by a training run (a small ``tidefeed emit``
through Spark, whose JVM writes the classes it loaded as it exits and is waited for),
then tried by a second JVM that starts Spark with it, and only then renamed into place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from feed.emit.jvm_archive import ENV, QUIET, without_archive

__all__ = ["main", "make_archive"]

#: the JIT of the maker's two JVMs: C1 alone. They live a minute at most, and the archive
#: holds classes, not compiled code (the same ~11 700 classes either way); C2's
#: compilations cost them about a third of the making's CPU (85 -> 58 core-seconds here)
BRIEF = "-XX:TieredStopAtLevel=1"


def _step(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """Run a step in a process group of its own, which is killed whole if this process is
    interrupted (Ctrl-C) or the step times out: the step's JVM is its child, and a JVM
    told to stop writes the archive's temporary file on its way out, after this process
    has removed what it made."""
    cmd = [sys.executable, "-m", "feed.cli.jvm_archive", *args]
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    ) as p:
        try:
            out, err = p.communicate(timeout=600)
        except BaseException:
            _kill_group(p)
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``p``'s process group and wait until none of it is left (a JVM killed so
    writes nothing)."""
    import signal
    import time

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    p.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _train(folder: str) -> int:
    """The training run, in this process: a keyed ``tidefeed emit`` of ``folder``'s input
    through Spark (not the driver engine: the training is to load what Spark's path
    loads); then the JVM is told to exit and waited for, as it writes the archive on its
    way out. Its exit status, or the emit's when that failed."""
    from pyspark import SparkContext

    from feed.cli.main import main as cli

    args = ["emit", "--source", f"debezium:{folder}/in", "--feed", "t", "--log", f"{folder}/log"]
    rc = cli([*args, "--key", "id", "--clock", "logical", "--driver-txn-bytes", "0"])
    gateway = SparkContext._gateway
    if gateway is None:
        return rc or 1
    proc = gateway.proc
    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()
    proc.stdin.close()  # (Spark's gateway exits when its stdin ends)
    return rc or proc.wait(timeout=600)


def _try() -> int:
    """Start Spark with the archive ``$TIDEFEED_JVM_ARCHIVE`` names and run a job."""
    from feed.emit.session import get_spark

    return 0 if get_spark().range(3).count() == 3 else 1


def _training_input(folder: str) -> None:
    """A snapshot and a transaction of a small table, as Debezium writes them."""
    import orjson

    os.makedirs(f"{folder}/in")
    lines = []
    for i, (op, lsn, txid) in enumerate([("r", 10, 1), ("r", 10, 1), ("c", 20, 2), ("u", 30, 3)]):
        row = {"id": i % 3, "name": f"n{i}", "amount": i * 1.5}
        source = {"lsn": lsn, "txId": txid, "schema": "public", "table": "t"}
        source["snapshot"] = "true" if op == "r" else "false"
        before = row if op == "u" else None
        lines.append({"before": before, "after": row, "op": op, "source": source})
    with open(f"{folder}/in/part-0000.json", "wb") as f:
        f.write(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")


def make_archive(path: str) -> int:
    """Make the archive at ``path`` (see the module docstring); its size in bytes."""
    path = os.path.abspath(path)
    if any(c.isspace() for c in path):
        raise ValueError(f"{path!r}: the archive's path must not hold a space")
    tmp = f"{path}.{os.getpid()}.tmp"
    base = {k: v for k, v in os.environ.items() if k != ENV}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # the given options without an archive's mapping (tidefeed's own Spark starts put one
    # there: see with_archive): a JVM that maps one cannot write one, and the try must map
    # the new archive, which with_archive would not add beside another
    given = f"{without_archive(base.get('SPARK_SUBMIT_OPTS', ''))} {BRIEF}"
    try:
        with tempfile.TemporaryDirectory(prefix="tidefeed-jsa-") as folder:
            _training_input(folder)
            opts = f"{given} -XX:ArchiveClassesAtExit={tmp} {QUIET}"
            done = _step(["--train", folder], {**base, "SPARK_SUBMIT_OPTS": opts.strip()})
            if done.returncode != 0 or not os.path.isfile(tmp):
                raise RuntimeError(f"the training run failed: {_tail(done.stderr)}")
        tried = _step(["--try"], {**base, ENV: tmp, "SPARK_SUBMIT_OPTS": given.strip()})
        if tried.returncode != 0:
            raise RuntimeError(f"Spark did not start with the archive: {_tail(tried.stderr)}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return os.path.getsize(path)


def _tail(err: bytes) -> str:
    lines = err.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--train":
        return _train(args[1])
    if args == ["--try"]:
        return _try()
    if len(args) != 1:
        print("usage: python -m feed.cli.jvm_archive PATH", file=sys.stderr)
        return 2
    try:
        size = make_archive(args[0])
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        print(f"no JVM class archive made (Spark starts without one): {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no JVM class archive made", file=sys.stderr)
        return 130
    print(f"JVM class archive: {args[0]} ({size / 2**20:.0f} MB); {ENV}={args[0]} uses it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
