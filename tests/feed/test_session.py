"""Spark settings: --conf over what Spark was given (spark-defaults.conf), over tidefeed's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from feed.emit.session import parse_conf

SHOW = """
import sys
from feed.emit.session import get_spark, parse_conf
s = get_spark(conf=parse_conf(sys.argv[1:]))
print(s.conf.get("spark.sql.shuffle.partitions"), s.conf.get("spark.sql.session.timeZone"))
"""


def _started(*conf: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", SHOW, *conf],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _shown(p: subprocess.Popen[bytes]) -> str:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err.decode()[-2000:]
    return out.decode().strip()


@pytest.mark.process  # tidefeed processes, each with its own JVM
def test_conf_wins_over_spark_defaults_which_win_over_tidefeeds(tmp_path):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        "spark.sql.shuffle.partitions 9\nspark.sql.session.timeZone America/New_York\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONF_DIR"}
    with_defaults = {**env, "SPARK_CONF_DIR": str(conf_dir)}
    # (two JVMs at once: their starts overlap. The second shows both orders: the file's
    # partitions over tidefeed's 4, and the flag's time zone over the file's.)
    own = _started(env=env)
    flag = _started("spark.sql.session.timeZone=Asia/Tokyo", env=with_defaults)
    try:
        assert _shown(own) == "4 UTC"  # tidefeed's own defaults
        assert _shown(flag) == "9 Asia/Tokyo"  # spark-defaults.conf is not overridden
    finally:  # (a failed check leaves no JVM behind)
        for p in (own, flag):
            p.kill()
            p.wait()


def test_a_malformed_conf_flag_is_a_usage_error():
    assert parse_conf(["a.b=1", "c= x=y"]) == {"a.b": "1", "c": " x=y"}
    with pytest.raises(SystemExit, match=r"--conf takes KEY=VALUE, got 'spark\.sql'"):
        parse_conf(["spark.sql"])


def test_the_driver_advertises_an_address_a_clusters_executors_can_reach(monkeypatch):
    """On a cluster master, spark.driver.host is the address on the route to the master
    (never 0.0.0.0, the docker image's SPARK_LOCAL_IP); one address given in
    SPARK_LOCAL_IP is taken as it is."""
    import ipaddress

    from feed.emit.session import driver_address

    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    assert driver_address("spark://127.0.0.1:7077") == "127.0.0.1"  # the loopback route
    monkeypatch.setenv("SPARK_LOCAL_IP", "0.0.0.0")
    assert driver_address("spark://127.0.0.1:7077") == "127.0.0.1"
    elsewhere = driver_address("spark://10.255.255.1:7077")  # another network
    assert not ipaddress.ip_address(elsewhere).is_unspecified
    assert driver_address("spark://master.invalid:7077")  # a name that does not resolve
    monkeypatch.setenv("SPARK_LOCAL_IP", "10.1.2.3")
    assert driver_address("spark://127.0.0.1:7077") == "10.1.2.3"


def test_the_jvm_class_archive_is_mapped_only_when_named_and_there(tmp_path, monkeypatch):
    from feed.emit.jvm_archive import ENV, QUIET, jvm_options, with_archive, without_archive

    monkeypatch.delenv(ENV, raising=False)
    assert jvm_options() == "" and with_archive("-Da=1") == "-Da=1"
    monkeypatch.setenv(ENV, str(tmp_path / "missing.jsa"))
    assert jvm_options() == ""  # named but not made (yet): Spark starts as usual
    made = tmp_path / "a.jsa"
    made.write_bytes(b"x")
    monkeypatch.setenv(ENV, str(made))
    opts = with_archive("-Da=1")
    assert opts.startswith("-Da=1 ") and f"-XX:SharedArchiveFile={made} " in opts
    assert with_archive(opts) == opts  # added once
    assert without_archive(opts) == f"-Da=1 {QUIET}"  # (what the archive's maker keeps)
    spaced = tmp_path / "a b.jsa"
    spaced.write_bytes(b"x")
    assert jvm_options(str(spaced)) == ""  # Spark's launcher would split the option


@pytest.mark.process  # a JVM that cannot start
def test_an_archive_that_cannot_be_made_is_said_and_leaves_nothing(tmp_path):
    """The training run's JVM does not start (no Java at JAVA_HOME): the error says no
    archive was made, and neither the archive nor its temporary file is left."""
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    target = tmp_path / "archive" / "t.jsa"
    p = subprocess.run(
        [sys.executable, "-m", "feed.cli.jvm_archive", str(target)],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stderr.decode()
    assert b"no JVM class archive made (Spark starts without one): the training run failed" in (
        p.stderr
    )
    assert list((tmp_path / "archive").iterdir()) == []


@pytest.mark.process  # a JVM stopped while it trains
def test_a_ctrl_c_while_the_archive_is_made_leaves_nothing(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the
    training JVM runs: one line, exit 130, and once every process of it is gone, no
    archive, no temporary file of it and no training folder. (A JVM that exits on SIGINT
    writes the archive as it goes: its step is killed whole.)"""
    import signal
    import time

    target = tmp_path / "archive" / "t.jsa"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-m", "feed.cli.jvm_archive", str(target)],
        env={
            # (the tests' JVM options map the archive make made; tidefeed's own Spark
            # starts put the mapping in SPARK_SUBMIT_OPTS, which the maker drops)
            **{k: v for k, v in os.environ.items() if k != "PYSPARK_SUBMIT_ARGS"},
            "SPARK_SUBMIT_OPTS": f"-XX:SharedArchiveFile={tmp_path / 'old.jsa'} -Xshare:auto",
            "TMPDIR": str(tmp),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

    def training_jvms() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if f"ArchiveClassesAtExit={target}.".encode() in cmdline:
                found.append(int(pid))
        return found

    deadline = time.monotonic() + 120
    try:
        while not training_jvms():
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the training JVM never started: {p.communicate()[1].decode()}")
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.communicate()
    assert p.returncode == 130, err.decode()[-2000:]
    assert err.decode().strip().splitlines()[-1] == "interrupted: no JVM class archive made"
    while training_jvms():  # (without the group's kill, the JVM writes its archive now)
        assert time.monotonic() < deadline, "the training JVM outlived its maker"
        time.sleep(0.1)
    assert list((tmp_path / "archive").iterdir()) == []
    assert list(tmp.glob("tidefeed-jsa-*")) == []  # (the training run's folder)


@pytest.mark.spark
def test_the_session_maps_the_archive_make_named(spark):
    """make test names an archive it made (TIDEFEED_JVM_ARCHIVE): the shared session's JVM
    was started with it."""
    from feed.emit.jvm_archive import ENV

    named = os.environ.get(ENV)
    if not named or not os.path.isfile(named):
        pytest.skip(f"{ENV} names no archive (outside make test, or it could not be made)")
    bean = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    assert f"-XX:SharedArchiveFile={os.path.abspath(named)}" in str(bean.getInputArguments())


CTRL_C_AT_START = """
import os, signal
from pyspark.sql import SparkSession
got = []
signal.signal(signal.SIGINT, lambda *a: got.append("ours"))
start = SparkSession.Builder.getOrCreate
def ctrl_c_inside(self):
    made = SparkSession._instantiatedSession is None
    session = start(self)  # (PySpark's own SIGINT handler may be in place now)
    if made:
        os.kill(os.getpid(), signal.SIGINT)
    return session
SparkSession.Builder.getOrCreate = ctrl_c_inside
from feed.emit.session import get_spark
get_spark().range(3).count()
print(got, signal.getsignal(signal.SIGINT).__name__)
"""


@pytest.mark.process  # a process with its own JVM, sent SIGINT
def test_a_ctrl_c_while_spark_starts_reaches_the_commands_own_handler():
    """A command that handles SIGINT itself (emit finishes its transaction) gets a Ctrl-C
    that arrives while Spark starts, once the session is up; PySpark's handler, in place
    for that moment, would cancel jobs from inside a py4j call (tracebacks) and raise
    KeyboardInterrupt."""
    p = subprocess.run([sys.executable, "-c", CTRL_C_AT_START], capture_output=True, timeout=180)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert p.stdout.decode().split() == ["['ours']", "<lambda>"]
    assert b"Traceback" not in p.stderr and b"KeyboardInterrupt" not in p.stderr


SIZED = (
    "spark.sql.shuffle.partitions",
    "spark.sql.adaptive.enabled",
    "spark.sql.autoBroadcastJoinThreshold",
    "spark.sql.codegen.wholeStage",
    "spark.sql.codegen.factoryMode",
)


def test_a_small_transaction_runs_with_the_small_input_settings_then_restores_them(spark, tmp_path):
    from feed.emit.session import sized_for_input

    def settings() -> list[str | None]:
        return [spark.conf.get(k, None) for k in SIZED]

    def codegen_stages() -> bool:
        q = spark.range(10).selectExpr("id + 1 AS x").where("x > 3")  # (no shuffle: no AQE)
        return "*(" in q._jdf.queryExecution().executedPlan().toString()

    def broadcasts() -> bool:  # (a join of two tiny relations, by Spark's own choice)
        small_side = spark.range(3).withColumnRenamed("id", "k")
        q = spark.range(10).withColumnRenamed("id", "k").join(small_side, "k")
        return "Broadcast" in q._jdf.queryExecution().executedPlan().toString()

    before = settings()
    small, mid, large = tmp_path / "small.json", tmp_path / "mid.json", tmp_path / "large.json"
    small.write_bytes(b"{}\n")
    for f, size in ((mid, 5 << 20), (large, 17 << 20)):
        with open(f, "wb") as out:
            out.truncate(size)
    assert codegen_stages() and broadcasts()
    # one partition, no AQE, no broadcast unless asked, no generated code
    with sized_for_input(spark, {}, [str(small)]):
        assert settings() == ["1", "false", "-1", "false", "NO_CODEGEN"]
        assert not codegen_stages() and not broadcasts()
    assert settings() == before and codegen_stages() and broadcasts()
    with sized_for_input(spark, {}, [str(mid)]):  # the same, with generated code
        assert settings() == ["1", "false", "-1", *before[3:]]
        assert codegen_stages() and not broadcasts()
    with sized_for_input(spark, {}, [str(large)]):  # as the session has it
        assert settings() == before
    # a --conf naming one setting of a group leaves the group alone
    with sized_for_input(spark, {"spark.sql.codegen.wholeStage": "true"}, [str(small)]):
        assert settings() == ["1", "false", "-1", *before[3:]]
    with sized_for_input(spark, {"spark.sql.shuffle.partitions": "3"}, [str(small)]):
        assert settings() == [before[0], "false", "-1", "false", "NO_CODEGEN"]
    with sized_for_input(spark, {"spark.sql.adaptive.enabled": "true"}, [str(small)]):
        assert settings() == ["1", before[1], "-1", "false", "NO_CODEGEN"]
    with sized_for_input(spark, {"spark.sql.autoBroadcastJoinThreshold": "1m"}, [str(small)]):
        assert settings() == ["1", "false", before[2], "false", "NO_CODEGEN"]
        assert broadcasts()
    assert settings() == before


@pytest.mark.spark
def test_sql_functions_are_looked_up_in_the_jvm_once_then_only_called(spark, monkeypatch):
    """After a session is made (feed/emit/lookups.py), a function PySpark has met before
    costs one py4j round trip, the call, and no reflection; the columns are the same."""
    from pyspark.sql import functions as F

    client = spark.sparkContext._gateway._gateway_client
    sent: list[str] = []
    send = client.send_command

    def counted(command: str, *args, **kwargs):
        sent.append(command[:1])
        return send(command, *args, **kwargs)

    def make():
        return F.when(F.col("x") > F.lit(1), F.coalesce("y", F.lit("z"))).alias("w")

    first = str(make())  # (each function met once: looked up now if never before)
    monkeypatch.setattr(client, "send_command", counted)
    again = str(make())
    monkeypatch.undo()
    assert again == first == "Column<'CASE WHEN >(x, 1) THEN coalesce(y, 'z') END AS w'>"
    assert "r" not in sent, sent  # no reflection command: every member was kept
    df = spark.createDataFrame([(0, None), (2, None), (3, "q")], "x int, y string")
    assert [r["w"] for r in df.select(make()).orderBy("x").collect()] == [None, "z", "q"]


@pytest.mark.spark
def test_a_class_this_jvm_lacks_is_left_to_py4j(spark, monkeypatch):
    """A name of feed/emit/lookups.py's list that is not a class in this JVM (another
    PySpark) is not held: py4j answers for it as before, with a package."""
    from py4j.java_gateway import JavaPackage

    from feed.emit import lookups

    jvm = spark.sparkContext._jvm
    monkeypatch.setattr(lookups, "KEPT", (*lookups.KEPT, "NoSuchTidefeedClass"))
    lookups.keep_lookups(jvm)
    assert "NoSuchTidefeedClass" not in vars(jvm)
    assert all(name in vars(jvm) for name in lookups.KEPT[:-1])
    assert type(jvm.NoSuchTidefeedClass) is JavaPackage
