"""The emitter runs unchanged on a real Spark standalone cluster (master + worker processes).

Executors are separate JVMs started by the worker; the feed must equal the one a local[2]
run makes from the same input.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pyspark
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank

from .helpers import free_port, tidefeed, write_parts

pytestmark = pytest.mark.slow

SPARK_HOME = Path(pyspark.__file__).parent


def wait_for_port(port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@contextlib.contextmanager
def standalone(logs: Path, hide: Path | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """A master and a worker of 2 cores on 127.0.0.1: the master URL and the environment.
    With ``hide``, the worker (and so its executors) runs in a mount namespace of its own
    where an empty tmpfs covers ``hide``: a machine that does not share that folder."""
    env = dict(
        os.environ,
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_MASTER_HOST="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        SPARK_WORKER_DIR=str(logs / "work"),
        SPARK_LOG_DIR=str(logs),
    )
    # the INFO line awaited below is Spark's own logging: not the quiet configuration a
    # SparkSession started earlier in this process put in the environment (session.py)
    env.pop("LOG4J_CONFIGURATION_FILE", None)
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    port, ui, wui = free_port(), free_port(), free_port()
    master = [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"]
    master += ["--port", str(port), "--webui-port", str(ui)]
    worker = [spark_class, "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}"]
    worker += ["--host", "127.0.0.1", "--cores", "2", "--memory", "2g", "--webui-port", str(wui)]
    if hide is not None:
        mount = f'mount -t tmpfs none "{hide}" && exec "$0" "$@"'
        worker = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, *worker]
    procs = []
    with open(logs / "master.log", "wb") as m_out, open(logs / "worker.log", "wb") as w_out:
        procs.append(subprocess.Popen(master, env=env, stdout=m_out, stderr=subprocess.STDOUT))
        try:
            wait_for_port(port)
            procs.append(subprocess.Popen(worker, env=env, stdout=w_out, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 90
            while b"Successfully registered with master" not in (logs / "worker.log").read_bytes():
                if time.monotonic() > deadline:
                    raise TimeoutError((logs / "worker.log").read_text()[-2000:])
                time.sleep(0.5)
            yield f"spark://127.0.0.1:{port}", env
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _content(ndjson: bytes) -> tuple[Counter, list]:
    """A feed's NDJSON as its updates (time, record, diff, counted) and its progress."""
    updates: Counter = Counter()
    progress = []
    for line in ndjson.splitlines():
        m = orjson.loads(line)
        if "updates" in m:
            for u in m["updates"]:
                data = orjson.dumps(u["data"], option=orjson.OPT_SORT_KEYS)
                updates[(u["time"], data, u["diff"])] += 1
        else:
            progress.append(m)
    return updates, progress


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with standalone(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_emit_on_a_standalone_cluster_equals_local(cluster, tmp_path):
    master, env = cluster
    bank = generate_bank(transactions=40, seed=21)
    src = tmp_path / "in"
    write_parts(src, bank.events, 2)
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    outputs = []
    # the reference: the same feed made in this process's engine of small transactions
    # (tests/feed/test_driver_txn.py holds it to what local Spark makes), where a second
    # Spark process would take ~15 s
    for name, m in (("cluster", master), ("local", None)):
        log = tmp_path / name
        where = ["--master", m, "--driver-txn-bytes", "0"] if m else []
        run = tidefeed(
            *("emit", "--source", f"debezium:{src}", "--feed", "bank", "--log", str(log)),
            *("--key", "id", "--clock", "logical", "--granularity", "transaction"),
            *("--schema", str(schema)),
            # (on the cluster through Spark's executors: input this small is otherwise
            # computed on the driver, and Spark never starts)
            *where,
            env={"PYSPARK_PYTHON": sys.executable},
        )
        assert run.returncode == 0, run.stderr.decode()[-3000:]
        # on the cluster the driver advertised the address on its route to the master
        if m:
            assert b"spark.driver.host=127.0.0.1" in run.stderr, run.stderr.decode()[-3000:]
        inspected = tidefeed("inspect", "--log", str(log), "--feed", "bank", "--format", "ndjson")
        assert inspected.returncode == 0
        outputs.append(inspected.stdout)
    assert _content(outputs[0]) == _content(outputs[1])  # (order within a time is free)
    assert tidefeed("check", "--key", "id", "-", stdin=outputs[0]).returncode == 0
    # executors really were separate processes started by the worker
    work = Path(env["SPARK_WORKER_DIR"])
    assert any(work.rglob("stderr")), "no executor ran on the worker"


def test_spark_submit_runs_the_emitter(tmp_path):
    """The operations guide's spark-submit route, with the packaged entry file."""
    import feed.submit

    bank = generate_bank(transactions=15, seed=22)
    src = tmp_path / "in"
    write_parts(src, bank.events, 1)
    env = dict(
        os.environ,
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    out = subprocess.run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--master",
            "local[2]",
            "--conf",
            "spark.driver.memory=1g",
            feed.submit.__file__,
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "bank",
            "--log",
            str(tmp_path / "log"),
            "--key",
            "id",
        ],
        capture_output=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    inspected = tidefeed(
        "inspect", "--log", str(tmp_path / "log"), "--feed", "bank", "--format", "ndjson"
    )
    assert tidefeed("check", "--key", "id", "-", stdin=inspected.stdout).returncode == 0
    import orjson

    from protocol import record_key

    got = {}
    for line in inspected.stdout.splitlines():
        m = orjson.loads(line)
        for u in m.get("updates", []):
            got[record_key(u["data"])] = got.get(record_key(u["data"]), 0) + u["diff"]
    assert {k for k, v in got.items() if v} == {record_key(r) for r in bank.final.values()}


def test_a_keyed_feed_with_its_log_on_s3_runs_on_the_cluster_without_hadoop_aws(cluster, tmp_path):
    """The input and the log in an S3 bucket (moto's server on 127.0.0.1), every
    transaction in the cluster's executors: they read the input, write the packs and the
    keyed state and read the state back through pyarrow, with the credentials
    docs/operations.md says to pass them (``spark.executorEnv.AWS_*``). The pyspark wheel
    alone: no hadoop-aws anywhere."""
    import pyarrow.fs as pafs
    from moto import server as moto_server

    from feed.log.reader import FeedReader

    from ..feed.model import as_multiset, collection_of

    master, _ = cluster
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        aws = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}
        query = f"endpoint_override={host}:{port}&scheme=http"
        fs, _ = pafs.FileSystem.from_uri(f"s3://k:s@logs?{query}&allow_bucket_creation=true")
        fs.create_dir("logs")
        log = f"s3://logs/feeds?{query}"
        bank = generate_bank(transactions=30, seed=24)
        # (two files, two transactions: the second reads the first one's state back)
        for part in write_parts(tmp_path / "in", bank.events, 2):
            with fs.open_output_stream(f"logs/in/{part.name}") as out:
                out.write(part.read_bytes())
        src = f"s3://logs/in?{query}"
        schema = tmp_path / "accounts.avsc"
        schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
        executors = [x for k, v in aws.items() for x in ("--conf", f"spark.executorEnv.{k}={v}")]
        run = tidefeed(
            *("emit", "--source", f"debezium:{src}", "--feed", "bank", "--log", log),
            *("--key", "id", "--clock", "logical", "--schema", str(schema)),
            *("--master", master, "--max-files-per-txn", "1", "--driver-txn-bytes", "0"),
            *("--layout", "packs", *executors),
            env={"PYSPARK_PYTHON": sys.executable, **aws},
        )
        assert run.returncode == 0, run.stderr.decode()[-3000:]
        commits = re.findall(rb": txn \d+: times .*", run.stderr)
        assert len(commits) == 2, run.stderr.decode()[-3000:]  # two transactions
        assert all(b" driver=" not in c for c in commits)  # each one in the executors
        with pytest.MonkeyPatch.context() as mp:
            for k, v in aws.items():
                mp.setenv(k, v)
            reader = FeedReader(log, "bank")
            assert collection_of(reader) == as_multiset(bank.final.values())
            found = fs.get_file_info(pafs.FileSelector("logs/feeds/bank", recursive=True))
            files = {i.path.split("logs/feeds/bank/", 1)[1] for i in found if i.is_file}
            assert {f for f in files if f.startswith("packs/")} == reader.packs()
            assert not [f for f in files if f.startswith("times/")]
    finally:
        server.stop()


def _can_hide() -> bool:
    """Whether this process may give a child a mount namespace with a tmpfs of its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    tried = ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs"]
    done = subprocess.run([*tried, "none", "/mnt"], capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(
    not _can_hide(),
    reason="a worker that does not see the driver's folders needs root, unshare(1) and "
    "the right to mount in a new mount namespace",
)
def test_a_log_and_input_the_executors_cannot_see_are_refused_before_any_work(tmp_path):
    """The worker runs where the driver's folder is not mounted, as on another machine:
    the emitter says which path its executors cannot see, and on which host, before the
    transaction writes anything."""
    shared = tmp_path / "not-shared"
    src = shared / "in"
    write_parts(src, generate_bank(transactions=10, seed=25).events, 1)
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    (tmp_path / "spark").mkdir()
    with standalone(tmp_path / "spark", hide=shared) as (master, _):
        log = shared / "log"
        run = tidefeed(
            *("emit", "--source", f"debezium:{src}", "--feed", "bank", "--log", str(log)),
            *("--key", "id", "--schema", str(schema), "--master", master),
            *("--driver-txn-bytes", "0"),
            env={"PYSPARK_PYTHON": sys.executable},
        )
    err = run.stderr.decode()
    assert run.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tidefeed emit: the log {log}/bank is not visible to Spark's"), last
    assert f"executors on {socket.gethostname()} (master {master})" in last
    assert "object store URI" in last and "Traceback" not in err
    # the epoch's claim is all the feed holds, and the probe is gone
    assert [p.name for p in (log / "bank" / "_commits").iterdir()] == [f"{1:020d}.json"]
    assert not list((log / "bank").glob(".executor-probe-*"))
    assert not (log / "bank" / "times").exists() or not any((log / "bank" / "times").iterdir())
