"""`tidefeed check` and `tidefeed convert` as a user runs them: real processes, real files."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import fastavro
import orjson
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA
from protocol import Progress, Update, Updates, announcement, cdcv2_schema, get_codec

TIDEFEED = [sys.executable, "-m", "feed.cli.main"]


def run(*args, stdin=None, env=None):
    return subprocess.run(
        [*TIDEFEED, *args], input=stdin, capture_output=True, env=env, timeout=120
    )


ROW = {"id": 1, "owner": "ada", "balance": 10, "active": None, "note": "é"}
FEED = [
    announcement(0),
    Updates.of([Update(ROW, 5, 1)]),
    Progress(0, 6, ((5, 1),)),
    Updates.of([Update(ROW, 7, -1), Update(dict(ROW, balance=20), 7, 1)]),
    Progress(6, 8, ((7, 2),)),
]


@pytest.fixture
def feed_files(tmp_path) -> dict[str, Path]:
    files = {}
    for fmt in ("ndjson", "avro", "arrow"):
        path = tmp_path / f"feed.{fmt}"
        path.write_bytes(get_codec(fmt).encode(FEED, schema=ACCOUNTS_SCHEMA))
        files[fmt] = path
    return files


@pytest.mark.parametrize("fmt", ["ndjson", "avro", "arrow"])
def test_check_accepts_a_valid_feed_in_each_format(feed_files, fmt):
    out = run("check", str(feed_files[fmt]))  # format detected from the bytes
    assert out.returncode == 0, out.stdout + out.stderr
    assert b"5 messages, 3 updates, frontier 8: valid" in out.stderr


def test_check_reports_each_violation_on_its_own_line(tmp_path):
    bad = [
        announcement(0),
        Updates.of([Update(ROW, 5, 1), Update(ROW, 5, 1)]),
        Progress(0, 6, ((5, 2),)),
        Progress(9, 10, ()),
    ]
    path = tmp_path / "bad.ndjson"
    path.write_bytes(get_codec("ndjson").encode(bad))
    out = run("check", "--format", "ndjson", str(path))
    assert out.returncode == 1
    lines = out.stdout.decode().splitlines()
    assert len(lines) == 3, lines
    assert "line 2 (message 1): consolidated at time 5" in lines[0]
    assert "line 3 (message 2): exact-counts" in lines[1]
    assert "line 4 (message 3): chained at time 9" in lines[2]
    assert b"INVALID (3 violation(s))" in out.stderr


def test_check_reads_stdin_and_reports_malformed_input():
    out = run(
        "check", "-", stdin=b'{"progress": {"lower": [0], "upper": [0], "counts": []}}\n{oops\n'
    )
    assert out.returncode == 1
    assert b"stdin: malformed ndjson: ndjson at line 2: invalid JSON" in out.stdout


def test_check_non_negative_and_key_flags(tmp_path):
    feed = [
        announcement(0),
        Updates.of([Update(ROW, 1, 1), Update(dict(ROW, note="x"), 1, 1)]),
        Progress(0, 2, ((1, 2),)),
    ]
    path = tmp_path / "two.ndjson"
    path.write_bytes(get_codec("ndjson").encode(feed))
    assert run("check", str(path)).returncode == 0
    out = run("check", "--key", "id", str(path))
    assert out.returncode == 1 and b"one-row-per-key" in out.stdout
    env = dict(os.environ, TIDEFEED_KEY="id")
    assert run("check", str(path), env=env).returncode == 1


def test_convert_ndjson_to_avro_is_plain_cdcv2(feed_files, tmp_path):
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    out = run(
        "convert",
        "--from",
        "ndjson",
        "--to",
        "avro",
        "--schema",
        str(schema),
        str(feed_files["ndjson"]),
        "-",
    )
    assert out.returncode == 0, out.stderr
    datums = list(
        fastavro.reader(io.BytesIO(out.stdout), reader_schema=cdcv2_schema(ACCOUNTS_SCHEMA))
    )
    assert datums[1] == [{"data": ROW, "time": 5, "diff": 1}]
    assert datums[4] == {"lower": [6], "upper": [8], "counts": [{"time": 7, "count": 2}]}


def test_convert_chain_returns_to_the_same_feed(feed_files, tmp_path):
    arrow = tmp_path / "x.arrow"
    assert (
        run(
            "convert", "--from", "avro", "--to", "arrow", str(feed_files["avro"]), str(arrow)
        ).returncode
        == 0
    )
    back = run("convert", "--from", "arrow", "--to", "ndjson", str(arrow))
    assert back.returncode == 0, back.stderr
    assert back.stdout == feed_files["ndjson"].read_bytes()


def test_convert_bad_input_fails_clearly(tmp_path):
    path = tmp_path / "x.avro"
    path.write_bytes(b"not avro at all")
    out = run("convert", "--from", "avro", "--to", "ndjson", str(path))
    assert out.returncode == 1
    assert b"tidefeed convert: avro at header: not an Avro object container" in out.stderr


def test_unknown_option_value_is_a_usage_error():
    out = run("check", "--format", "csv")
    assert out.returncode == 2 and b"invalid choice" in out.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), b"COMMAND"),  # no command: the commands, and exit 2
        (("emit", "--sourc", "debezium:x", "--feed", "f", "--log", "l"), b"did you mean --source?"),
        (("emit", "--souce", "debezium:x", "--feed", "f", "--log", "l"), b"unknown option --souce"),
        (("inspect", "--log", "l", "--feed", "f", "--fromat", "x"), b"did you mean --format?"),
        (("inspect", "--log", "l", "--feed", "f", "--at", "soon"), b"or latest"),
        (("emit", "--source", "nope:x", "--feed", "f", "--log", "l"), b"unknown source kind"),
        (("emit", "--source", "x", "--feed", "f", "--log", "l"), b"KIND:PATH"),
        (("emit", "--source", "debezium:.", "--feed", "f", "--log", "l", "--eager"), b"--push"),
        (("emit", "--source", "debezium:.", "--feed", "a,b", "--log", "l"), b"--table lists"),
        # an option of another kind would be ignored: refused, naming whose it is
        (
            ("emit", "--source", "debezium:.", "--feed", "f", "--log", "l", "--order", "v"),
            b"--order is an option of upsert sources; --source debezium: does not take it",
        ),
        (
            ("emit", "--source", "upsert:.", "--feed", "f", "--log", "l", "--tx-metadata", "m"),
            b"--tx-metadata is an option of debezium sources",
        ),
        # what a kind cannot go without is said before Spark starts, not after
        (
            ("emit", "--source", "upsert:.", "--feed", "f", "--log", "l"),
            b"tidefeed emit: --source upsert: needs --key (the column(s) a row is upserted by)",
        ),
        (
            ("emit", "--source", "upsert:.", "--feed", "f", "--log", "l", "--key", "id"),
            b"--source upsert: needs --order (what orders the upserts)",
        ),
        (
            ("capture", "postgres", "--dsn", "d", "--table", "t", "--out", "o", "--debezium", "x"),
            b"KEY=VALUE",
        ),
    ],
)
def test_usage_mistakes_are_one_clear_line_and_exit_2(args, says):
    out = run(*args)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr
    assert b"Traceback" not in out.stderr


def test_serve_on_a_log_that_is_not_there_says_so(tmp_path):
    out = run("serve", "--log", str(tmp_path / "typo"), "--port", "1")
    assert out.returncode == 1 and b"no feed log at" in out.stderr


def _emit_from(tmp_path, *extra):
    """``tidefeed emit`` of feed ``f`` from Debezium files in ``tmp_path/in`` into
    ``tmp_path/log``, with ``extra`` options."""
    return run(
        "emit",
        *("--source", f"debezium:{tmp_path / 'in'}", "--feed", "f"),
        *("--log", str(tmp_path / "log"), *extra),
    )


def test_a_batch_emit_needs_its_tx_metadata_folder(tmp_path):
    (tmp_path / "in").mkdir()
    out = _emit_from(tmp_path, "--tx-metadata", str(tmp_path / "tx"))
    assert out.returncode == 1 and b"--tx-metadata path" in out.stderr


def _nested(depth: int) -> bytes:
    """A record type ``depth`` records deep, as JSON (deeper than orjson writes)."""
    t = b'"long"'
    for i in range(depth):
        t = b'{"type":"record","name":"n%d","fields":[{"name":"x","type":%s}]}' % (i, t)
    return t


@pytest.mark.parametrize(
    ("column", "says"),
    [
        ({"type": "long", "logicalType": "time-micros"}, b"column 't' is a time of day"),
        (
            {
                "type": "record",
                "name": "w",
                "fields": [{"name": "at", "type": {"type": "int", "logicalType": "time-millis"}}],
            },
            b"column 't.at' is a time of day",
        ),
        (["int", "string"], b"not a record schema tidefeed holds"),
        (_nested(100), b"records nested 101 deep; tidefeed holds at most 64 levels"),
    ],
)
def test_a_schema_spark_cannot_hold_is_refused_before_spark_starts(tmp_path, column, says):
    """A time-of-day column would fail only once Spark had started and read the input;
    it is refused first, naming the column, with nothing written."""
    (tmp_path / "in").mkdir()
    line = {"before": None, "after": {"id": 1, "t": 5}, "op": "c", "source": {"lsn": 1}}
    (tmp_path / "in" / "part-0000.json").write_bytes(orjson.dumps(line))
    text = column if isinstance(column, bytes) else orjson.dumps(column)
    fields = b'[{"name":"id","type":"long"},{"name":"t","type":%s}]' % text
    (tmp_path / "r.avsc").write_bytes(b'{"type":"record","name":"r","fields":%s}' % fields)
    out = _emit_from(tmp_path, "--schema", str(tmp_path / "r.avsc"))
    assert out.returncode == 1, out.stderr
    assert says in out.stderr and b"Traceback" not in out.stderr
    assert b"spark 4" not in out.stderr  # (Spark's start-up line: it never started)
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("how", ["--master", "--conf"])
def test_a_master_that_does_not_answer_is_refused_before_spark_starts(tmp_path, how):
    """Spark's client retries an unreachable standalone master for about a minute before
    it gives up; the emitter tries the master's port first and says so at once, naming
    the URL and why, with nothing written. (As --master or as --conf spark.master.)"""
    from tests.e2e.helpers import free_port

    (tmp_path / "in").mkdir()
    line = {"before": None, "after": {"id": 1}, "op": "c", "source": {"lsn": 1}}
    (tmp_path / "in" / "part-0000.json").write_bytes(orjson.dumps(line))
    master = f"spark://127.0.0.1:{free_port()}"
    given = [how, master if how == "--master" else f"spark.master={master}"]
    out = _emit_from(tmp_path, "--driver-txn-bytes", "0", *given)
    assert out.returncode == 1, out.stderr
    port = master.rsplit(":", 1)[1]
    says = f"no Spark master answers at {master} (127.0.0.1:{port}: Connection refused)"
    assert says.encode() in out.stderr and b"Traceback" not in out.stderr
    assert b"spark 4" not in out.stderr  # (Spark's start-up line: it never started)
    assert not (tmp_path / "log").exists()


def test_a_key_missing_from_a_connect_schema_is_refused_before_spark_starts(tmp_path):
    """Wrapped Debezium events carry the table's Connect schema: a new feed's record
    schema is read from it without Spark, so a wrong --key fails at once."""
    (tmp_path / "in").mkdir()
    columns = [{"type": "int64", "optional": False, "field": "id"}]
    schema = {"type": "struct", "fields": [{"type": "struct", "fields": columns, "field": "after"}]}
    payload = {"before": None, "after": {"id": 1}, "op": "c", "source": {"lsn": 1}}
    line = orjson.dumps({"schema": schema, "payload": payload})
    (tmp_path / "in" / "part-0000.json").write_bytes(line + b"\n")
    out = _emit_from(tmp_path, "--key", "nope")
    assert out.returncode == 1, out.stderr
    assert b"key column(s) ['nope'] are not in the record schema (columns: ['id'])" in out.stderr
    assert b"spark 4" not in out.stderr  # (Spark's start-up line: it never started)
    assert not (tmp_path / "log" / "f" / "feed.json").exists()


def test_check_of_empty_input_is_not_valid():
    out = run("check", "-", stdin=b"")
    assert out.returncode == 1 and b"no messages" in out.stderr


def test_version_and_help_with_defaults_and_variables():
    from feed.cli.options import version

    out = run("--version")
    assert out.returncode == 0 and out.stdout.decode().strip() == f"tidefeed {version()}"
    assert version() != "unknown"
    expected = {
        "emit": [
            "(default: 5.0)",
            "(default: 1000)",
            "(default: 300.0)",
            "(default: ndjson)",
            "a new feed: wallclock",
            "a new feed: batch",
            "TIDEFEED_EMIT_TRIGGER",
            "TIDEFEED_SOURCE",
        ],
        "serve": ["(default: 8080)", "(default: 127.0.0.1)", "TIDEFEED_SERVE_PORT"],
        "receive": ["(default: 9090)", "TIDEFEED_RECEIVE_PORT", "TIDEFEED_TOKEN"],
    }
    for command, needles in expected.items():
        text = " ".join(run(command, "--help").stdout.decode().split())
        for needle in needles:
            assert needle in text, (command, needle)
        assert "§" not in text and "DESIGN" not in text


HEAVY = ("pyarrow", "aiohttp", "numpy", "pyspark", "prometheus_client", "fastavro")


def test_the_command_line_parses_and_refuses_without_loading_the_heavy_libraries():
    """Help, the version and a usage error come from the parser alone: a process that
    only parses its options loads none of the libraries the commands need."""
    probe = (
        "import sys\n"
        "from feed.cli import main\n"
        "try:\n"
        "    main.main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
        f"print('loaded', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    for args, code in ((["--version"], 0), (["emit", "--help"], 0), (["emit", "--sourc", "x"], 2)):
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True)
        lines = out.stdout.decode().splitlines()
        assert f"exit {code}" in lines, (args, out.stdout, out.stderr)
        assert lines[-1] == "loaded []", (args, lines[-1])
    # and the constants the parser reads are those of the modules that use them
    from feed.emit import defaults as emit_defaults
    from feed.emit import settings
    from feed.serve import limits, state
    from protocol import CODECS, _http, defaults, destinations

    assert tuple(CODECS) == defaults.FORMATS
    assert _http.IDLE_TIMEOUT is defaults.IDLE_TIMEOUT
    assert destinations.DEFAULT_PUSH_ALLOW is defaults.DEFAULT_PUSH_ALLOW
    assert settings.DEFAULT_DRIVER_TXN_BYTES is emit_defaults.DEFAULT_DRIVER_TXN_BYTES
    assert state.STALL_SECONDS is limits.STALL_SECONDS


def test_environment_variables_are_scoped_and_checked(feed_files):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEFEED_")}
    # TIDEFEED_FORMAT is another command's business: check still detects Avro
    out = run("check", str(feed_files["avro"]), env={**env, "TIDEFEED_FORMAT": "arrow"})
    assert out.returncode == 0, out.stdout + out.stderr
    # the scoped variable is read, and checked like the flag
    out = run("check", str(feed_files["avro"]), env={**env, "TIDEFEED_CHECK_FORMAT": "arrow"})
    assert out.returncode == 1 and b"malformed arrow" in out.stdout
    out = run("check", str(feed_files["avro"]), env={**env, "TIDEFEED_CHECK_FORMAT": "csv"})
    assert out.returncode == 2
    assert b"invalid choice: 'csv'" in out.stderr and b"$TIDEFEED_CHECK_FORMAT" in out.stderr
    # a flag on the command line wins over the variable
    out = run(
        "check",
        "--format",
        "avro",
        str(feed_files["avro"]),
        env={**env, "TIDEFEED_CHECK_FORMAT": "arrow"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # a bad port is one usage line naming the variable, not a traceback
    out = run("serve", "--log", "x", env={**env, "TIDEFEED_SERVE_PORT": "abc"})
    assert out.returncode == 2 and b"Traceback" not in out.stderr
    assert b"'abc' is not a TCP port (1-65535) (from $TIDEFEED_SERVE_PORT)" in out.stderr
    # an option of another source kind, set in the environment, is refused naming it
    emit = ["emit", "--source", f"debezium:{feed_files['avro'].parent}", "--feed", "f"]
    out = run(*emit, "--log", "x", env={**env, "TIDEFEED_EMIT_ORDER": "lsn"})
    assert out.returncode == 2, out.stderr
    assert b"--order (from $TIDEFEED_EMIT_ORDER) is an option of upsert sources" in out.stderr


def test_demo_runs_the_emitter_and_verifies(tmp_path, spark):
    """The demo in this process, on the shared Spark session (its Spark transactions are
    the point; a JVM of its own would only add its start), then its feed through the
    commands as a user runs them."""
    import logging

    from feed.demo.main import run_demo

    (tmp_path / "run-001").mkdir()  # an earlier run's folder is kept
    (tmp_path / "run-001" / "mine").write_text("kept")
    said = io.StringIO()
    quieted = [logging.getLogger(n) for n in ("tidefeed.emit", "tidefeed.receive")]
    levels = [lg.level for lg in quieted]
    assert run_demo(workdir=str(tmp_path), out=said) == 0, said.getvalue()
    assert [lg.level for lg in quieted] == levels  # (the demo quiets them while it runs)
    assert (tmp_path / "run-001" / "mine").read_text() == "kept"
    assert (tmp_path / "latest").resolve() == (tmp_path / "run-002").resolve()
    tmp_path = tmp_path / "latest"
    assert "OK: the receiver's collection equals the bank's final table" in said.getvalue()
    assert "-- commit 2 (epoch 1): progress lower=[0]" in said.getvalue()
    inspected = run(
        "inspect", "--log", str(tmp_path / "log"), "--feed", "accounts", "--format", "ndjson"
    )
    assert inspected.returncode == 0
    assert run("check", "--key", "id", "-", stdin=inspected.stdout).returncode == 0
    # --at latest: the newest complete time, the same as --at with its number
    latest = run("inspect", "--log", str(tmp_path / "log"), "--feed", "accounts", "--at", "latest")
    assert latest.returncode == 0, latest.stderr
    frontier = orjson.loads([x for x in inspected.stdout.splitlines() if b'"progress"' in x][-1])[
        "progress"
    ]["upper"][0]
    numbered = run(
        "inspect", "--log", str(tmp_path / "log"), "--feed", "accounts", "--at", str(frontier - 1)
    )
    assert latest.stdout == numbered.stdout and b"record(s)" in latest.stdout
    status = run("status", "--log", str(tmp_path / "log"))
    assert status.returncode == 0, status.stderr
    assert f"feed accounts: frontier {frontier}".encode() in status.stdout
    assert b"emitter: none running" in status.stdout
    as_json = orjson.loads(run("status", "--log", str(tmp_path / "log"), "--format", "json").stdout)
    assert [(f["feed"], f["frontier"]) for f in as_json] == [("accounts", frontier)]
    avro = (tmp_path / "accounts.cdcv2.avro").read_bytes()
    assert run("check", "--key", "id", "-", stdin=avro).returncode == 0


def test_the_demo_command_runs_the_demo_in_the_folder_given(tmp_path, monkeypatch):
    """`tidefeed demo --workdir W` is the demo above in W (run in this process: the demo
    itself is the test above)."""
    import logging

    import feed.demo.main
    from feed.cli.main import main

    calls = []
    monkeypatch.setattr(feed.demo.main, "run_demo", lambda **kw: calls.append(kw) or 0)
    level = logging.getLogger("tidefeed").level
    try:
        assert main(["demo", "--workdir", str(tmp_path)]) == 0
    finally:
        logging.getLogger("tidefeed").setLevel(level)
    assert calls == [{"workdir": str(tmp_path)}]


def test_log_lines_as_json_at_the_chosen_level():
    code = (
        "import logging, sys; from feed.cli.options import configure_logging; "
        "configure_logging(sys.argv[1], 'json'); "
        "logging.getLogger('tidefeed.emit').info('feed x: txn 2 committed'); "
        "logging.getLogger('tidefeed.emit').debug('hidden at info'); "
        "logging.getLogger('py4j.clientserver').info('Closing down clientserver connection')"
    )
    out = subprocess.run([sys.executable, "-c", code, "info"], capture_output=True, timeout=60)
    lines = [orjson.loads(x) for x in out.stderr.splitlines()]
    assert [(x["level"], x["logger"], x["message"]) for x in lines] == [
        ("info", "tidefeed.emit", "feed x: txn 2 committed")
    ]
    out = subprocess.run([sys.executable, "-c", code, "debug"], capture_output=True, timeout=60)
    assert len(out.stderr.splitlines()) == 2


@pytest.mark.process
def test_a_small_debezium_emit_computes_its_feed_without_starting_spark(tmp_path):
    """The shipped samples are what a connector writes: the driver engine parses and
    computes them, and the process never starts a JVM. There is none to start: JAVA_HOME
    names nothing, so starting Spark would fail the emit. The collection is the samples'
    final table."""
    import os

    from feed.log.reader import FeedReader

    from .model import as_multiset, collection_of, debezium_truth
    from .test_debezium import copy_samples

    lines = copy_samples(tmp_path / "in")
    no_java = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    out = run(
        "emit",
        *("--source", f"debezium:{tmp_path / 'in'}", "--feed", "f", "--key", "id"),
        *("--log", str(tmp_path / "log"), "--clock", "logical"),
        env=no_java,
    )
    assert out.returncode == 0, out.stderr
    assert b"spark 4" not in out.stderr and b"driver=" in out.stderr
    final, _ = debezium_truth(lines)
    reader = FeedReader(str(tmp_path / "log"), "f")
    assert collection_of(reader, at=reader.frontier - 1) == as_multiset(final.values())
    # (through Spark the same emit fails: the JVM is not there)
    forced = run(
        "emit",
        *("--source", f"debezium:{tmp_path / 'in'}", "--feed", "g", "--key", "id"),
        *("--log", str(tmp_path / "log"), "--clock", "logical", "--driver-txn-bytes", "0"),
        env=no_java,
    )
    assert forced.returncode == 1 and b"Spark failed" in forced.stderr, forced.stderr


@pytest.mark.process
def test_a_spark_setting_spark_refuses_is_named_in_the_one_line_error(tmp_path):
    """A --conf value Spark refuses fails when the session is made. The emitter's one
    line carries Spark's innermost reason (the setting and what it must be), not the
    wrapper's "Error while instantiating '…SessionStateBuilder':", and no time is
    written."""
    (tmp_path / "in").mkdir()
    line = {"before": None, "after": {"id": 1}, "op": "c", "source": {"lsn": 1}}
    (tmp_path / "in" / "part-0000.json").write_bytes(orjson.dumps(line))
    bad = ("--conf", "spark.sql.shuffle.partitions=abc")
    out = _emit_from(tmp_path, "--driver-txn-bytes", "0", *bad)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(b"tidefeed emit: Spark failed: "), out.stderr
    assert b"spark.sql.shuffle.partitions" in last and b"SessionStateBuilder" not in last, last
    assert not list((tmp_path / "log").rglob("*.parquet"))


class _JavaError:
    """The few methods of a JVM exception that the one-line error reads, as py4j offers
    them."""

    def __init__(self, name: str, message: str | None, cause: _JavaError | None = None):
        self.name, self.message, self.cause = name, message, cause

    def getMessage(self):
        return self.message

    def getClass(self):
        return type("Class", (), {"getSimpleName": lambda _: self.name})()

    def getCause(self):
        return self.cause


def test_a_python_workers_error_is_named_from_the_line_after_sparks_heading():
    """Spark's error from a Python worker that could not start (its daemon module missing
    on the executors, say) begins with an empty line and a heading; the one line names the
    error itself, from the innermost exception that says anything."""
    from feed.cli.main import _spark_reason

    worker = (
        "\nError from python worker:\n  /usr/bin/python3: No module named feed.emit.task_daemon\n"
        "PYTHONPATH was:\n  /opt/spark/python/lib/pyspark.zip\n"
    )
    error = Exception("An error occurred while calling o87.collectToPython.")
    error.java_exception = _JavaError(  # type: ignore[attr-defined]
        "SparkException", "Job aborted", _JavaError("SparkException", worker)
    )
    assert _spark_reason(error) == (
        "SparkException: Error from python worker: /usr/bin/python3: No module named "
        "feed.emit.task_daemon"
    )
    error.java_exception = _JavaError("SparkException", "Job aborted", _JavaError("EOF", ""))
    assert _spark_reason(error) == "SparkException: Job aborted"  # (the cause said nothing)


def test_a_second_signal_during_a_servers_shutdown_is_one_line_and_exit_0(capsys):
    """aiohttp raises GracefulExit (a SystemExit of code 1) for each SIGINT/SIGTERM; the
    second one, raised while the first one's shutdown runs, used to end serve and receive
    with code 1 and not a word (two quick Ctrl-C, or `timeout -s INT`, which signals the
    process and its group)."""
    from aiohttp.web_runner import GracefulExit

    from feed.cli.main import _listening

    def interrupted() -> None:
        raise GracefulExit()

    assert _listening("serve", "127.0.0.1", 8080, interrupted) == 0
    assert capsys.readouterr().err == (
        "tidefeed serve: stopped by a second signal before shutting down\n"
    )
