"""The Spark session the emitter runs in: local by default, any master by flag."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from feed.emit.jvm_archive import with_archive

__all__ = [
    "DEFAULT_MASTER",
    "driver_address",
    "get_spark",
    "master_addresses",
    "parse_conf",
    "sized_for_input",
]

log = logging.getLogger("tidefeed.spark")
#: settings the start-up log line shows
SHOWN = (
    "spark.driver.host",
    "spark.sql.shuffle.partitions",
    "spark.driver.memory",
    "spark.sql.session.timeZone",
)
DEFAULT_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "4g"


def get_spark(
    master: str | None = None, *, app: str = "tidefeed", conf: dict[str, Any] | None = None
) -> Any:
    """Get (or create) the SparkSession; an existing active session is reused as it is.

    Precedence, highest first: ``conf`` (``tidefeed emit --conf KEY=VALUE``) and ``master``
    (``--master``); then what Spark itself was given (``spark-submit --conf``,
    ``PYSPARK_SUBMIT_ARGS``, ``spark-defaults.conf`` in ``$SPARK_CONF_DIR``); then tidefeed's
    defaults: ``local[*]``, the driver bound to 127.0.0.1 unless ``SPARK_LOCAL_IP`` says
    otherwise (on a cluster master, at :func:`driver_address`, which its executors can
    reach), no UI, few shuffle partitions (tidefeed's transactions are many and small).
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    from feed.emit.lookups import keep_lookups

    active = SparkSession.getActiveSession()
    if active is not None:
        keep_lookups(active.sparkContext._jvm)
        return active
    conf = dict(conf or {})
    if master:
        conf["spark.master"] = master
    host, bind = _launch_environment(conf)
    # start the JVM first: its system properties are what spark-submit and
    # spark-defaults.conf set, and those win over tidefeed's own defaults
    SparkContext._ensure_initialized()
    given = SparkConf()
    defaults = {
        "spark.master": DEFAULT_MASTER,
        "spark.app.name": app,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.driver.host": host,
        "spark.driver.bindAddress": bind,
        "spark.sql.files.maxPartitionBytes": str(1 << 30),
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        # PySpark otherwise records the Python call site of every column expression it
        # builds (a few JVM round trips each): ~5 000 calls, about a second, per emitter
        # transaction. Spark's error messages then name no Python line; tidefeed's own do.
        "spark.python.sql.dataFrameDebugging.enabled": "false",
        # the Python workers of the tasks forked with pyarrow and tidefeed's task modules
        # imported, instead of each worker importing them (feed/emit/task_daemon.py)
        "spark.python.daemon.module": "feed.emit.task_daemon",
    }
    builder = SparkSession.builder
    for k, v in defaults.items():
        if k not in conf and not given.contains(k):
            builder = builder.config(k, v)
    if "spark.ui.showConsoleProgress" not in conf:
        # PySpark's launcher turns Spark's console progress bar on for every driver; it
        # would draw over tidefeed's log lines (--conf turns it back on)
        builder = builder.config("spark.ui.showConsoleProgress", "false")
    for k, v in conf.items():
        if k != "spark.driver.memory":  # settled when the JVM started
            builder = builder.config(k, str(v))
    # PySpark replaces the SIGINT handler with one that raises KeyboardInterrupt in the
    # middle of whatever py4j call is under way; a command that handles signals itself
    # (``tidefeed emit`` finishes its transaction) keeps its own handler
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main_thread else None
    if main_thread and callable(handler) and handler is not signal.default_int_handler:
        # PySpark installs its handler when the context is made on the main thread, so it
        # is made on another (a Ctrl-C meanwhile reaches the command's handler: PySpark's
        # would cancel jobs from inside a py4j call, with tracebacks, and raise
        # KeyboardInterrupt), then taken up here, where it becomes this thread's session
        _made_aside(builder)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # (a plan's functions cost one py4j round trip each, not three: feed/emit/lookups.py)
    keep_lookups(spark.sparkContext._jvm)
    _say_started(spark, conf)
    return spark


def _say_started(spark: Any, conf: dict[str, Any]) -> None:
    """The start-up line: the master and the settings the session really runs with."""
    shown = {k: spark.conf.get(k, None) for k in SHOWN}
    jvm: Any = spark._jvm
    heap = jvm.java.lang.Runtime.getRuntime().maxMemory()
    shown["heap"] = f"{heap / 2**30:.1f}g"  # what the JVM really has
    # (what the JVM was started with: under spark-submit it was, before tidefeed ran)
    args = str(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    archive = re.search(r"-XX:SharedArchiveFile=([^,\]\s'\"]+)", args)
    if archive:
        shown["class archive"] = archive.group(1)
    log.info(
        "spark %s: master %s, %s%s",
        spark.version,
        spark.sparkContext.master,
        ", ".join(f"{k}={v}" for k, v in shown.items()),
        f" (--conf: {', '.join(sorted(conf))})" if conf else "",
    )


def _made_aside(builder: Any) -> None:
    """Make ``builder``'s session on a thread of its own, raising what it raised."""
    import threading

    failed: list[BaseException] = []

    def make() -> None:
        try:
            builder.getOrCreate()
        except BaseException as e:  # (raised again on the caller's thread)
            failed.append(e)

    maker = threading.Thread(target=make, name="tidefeed-spark-start", daemon=True)
    maker.start()
    maker.join()
    if failed:
        raise failed[0]


def _launch_environment(conf: dict[str, Any]) -> tuple[str, str]:
    """Settle what the JVM launch reads from the environment (the driver's address and
    heap, Spark's logging, the Python of the workers); the driver's advertised and bound
    addresses."""
    if str(conf.get("spark.master", DEFAULT_MASTER)).startswith("local"):
        host = bind = os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # (the launcher's)
    else:
        # executors on other machines connect back to the driver: it must advertise an
        # address they can reach (127.0.0.1 or 0.0.0.0 would send them to themselves)
        host = driver_address(str(conf["spark.master"]))
        bind = os.environ.get("SPARK_LOCAL_IP") or host  # (0.0.0.0 in docker/: every interface)
        os.environ.setdefault("SPARK_LOCAL_IP", host)
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if not (conf_dir and os.path.exists(os.path.join(conf_dir, "log4j2.properties"))):
        # Spark's start-up chatter (WARN lines, "default log4j profile") stays out of
        # tidefeed's output; errors still show
        os.environ.setdefault(
            "LOG4J_CONFIGURATION_FILE",
            os.path.join(os.path.dirname(os.path.dirname(__file__)), "log4j2.properties"),
        )
    # the classes Spark's start loads, mapped from an archive when one is named
    # (feed/emit/jvm_archive.py): the launcher passes SPARK_SUBMIT_OPTS to the JVM
    opts = with_archive(os.environ.get("SPARK_SUBMIT_OPTS", ""))
    if opts:
        os.environ["SPARK_SUBMIT_OPTS"] = opts
    # Python workers (eager pushes) must run this interpreter, which has tidefeed installed,
    # not whatever "python3" is first on the PATH
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # The heap is fixed when the JVM starts, so the driver's memory is settled here, not in
    # the builder (which would only show the value). The launcher ranks SPARK_DRIVER_MEMORY
    # below spark-submit's flags and spark-defaults.conf: the right place for a default.
    # A --conf given to tidefeed ranks above them all, as a spark-submit flag.
    if "spark.driver.memory" in conf:
        submit = os.environ.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")
        os.environ["PYSPARK_SUBMIT_ARGS"] = (
            f"--driver-memory {conf['spark.driver.memory']} {submit}"
        )
    elif str(conf.get("spark.master", DEFAULT_MASTER)).startswith("local"):
        # in local mode the driver does all the work: the JVM's 1 GiB default is too small
        os.environ.setdefault(
            "SPARK_DRIVER_MEMORY",
            os.environ.get("TIDEFEED_DRIVER_MEMORY", DEFAULT_DRIVER_MEMORY),
        )
    return host, bind


def driver_address(master: str) -> str:
    """The address a cluster's executors reach this driver at (``spark.driver.host``):
    ``SPARK_LOCAL_IP`` when it names one address; else, for ``spark://HOST:PORT``, this
    machine's address on the route to the master (asked of the kernel: nothing is sent);
    else the address of this machine's name. ``--conf spark.driver.host=…`` overrides it."""
    given = os.environ.get("SPARK_LOCAL_IP", "")
    if given and given not in ("0.0.0.0", "::"):
        return given
    first = next(iter(master_addresses(master)), None)
    if first is not None:
        target = (first[0], first[1] or 7077)
        try:
            family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)  # (a UDP connect only picks the route)
                address: str = s.getsockname()[0]
                return address
        except OSError:
            pass  # no route, or a name that does not resolve: the machine's name below
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


#: one master of a ``spark://`` URL: a host (an IPv6 one in brackets), then a port or none
_MASTER = re.compile(r"(\[[^\]]+\]|[^,:/\[\]]+)(?::(\d+))?/?")


def master_addresses(master: str) -> list[tuple[str, int | None] | None]:
    """Each master of a ``spark://HOST:PORT[,HOST:PORT…]`` URL as (host, port): an IPv6
    host without its brackets, the port None where the URL names none, and None for an
    entry that is not HOST[:PORT]. Empty for any other kind of master."""
    if not master.startswith("spark://"):
        return []
    out: list[tuple[str, int | None] | None] = []
    for entry in master.removeprefix("spark://").split(","):
        m = _MASTER.fullmatch(entry)
        out.append(None if m is None else (m[1].strip("[]"), int(m[2]) if m[2] else None))
    return out


def parse_conf(pairs: list[str] | None, *, command: str = "emit") -> dict[str, str]:
    """``--conf KEY=VALUE`` flags as a dict; a malformed one is a clear usage error."""
    from feed.errors import UsageError

    out: dict[str, str] = {}
    for kv in pairs or []:
        k, sep, v = kv.partition("=")
        if not sep or not k.strip():
            raise UsageError(f"tidefeed {command}: --conf takes KEY=VALUE, got {kv!r}")
        out[k.strip()] = v
    return out


#: a transaction reading less than this runs its shuffles as one partition
SMALL_INPUT_BYTES = 16 << 20
#: a transaction reading less than this evaluates its plans without generated code
#: (a keyed Debezium feed's transactions in a warm session, 2026-11-29: 20-25 % less
#: time without it at 0.7 and 3.2 MB of input, 25 % more at 10 MB)
INTERPRETED_INPUT_BYTES = 4 << 20
#: the settings of a transaction of small input (see :func:`sized_for_input`)
#: (a ``--conf`` naming any setting of a group leaves the whole group as it is)
SMALL_INPUT = (
    (SMALL_INPUT_BYTES, {"spark.sql.shuffle.partitions": "1"}),
    # (adaptive execution runs each shuffle stage of a plan as a job of its own: a small
    # transaction's figures took 11 jobs instead of 2, its bad-row count with TOAST
    # placeholders 41 instead of 11; on one partition it has nothing to coalesce)
    (SMALL_INPUT_BYTES, {"spark.sql.adaptive.enabled": "false"}),
    # (a broadcast join runs a job of its own to gather and send its small side, again in
    # each action whose plan holds it: the keyed state against the changes, the touched
    # keys against the state. On one partition a sort-merge join stays inside the
    # action's job: test_driver_txn's keyed histories in a warm session, 2026-12-06, ran
    # a quarter fewer jobs (4.7-8.2 a transaction instead of 6.3-10.8) on 3-17 % less CPU)
    (SMALL_INPUT_BYTES, {"spark.sql.autoBroadcastJoinThreshold": "-1"}),
    (
        INTERPRETED_INPUT_BYTES,
        # (factoryMode is Spark's internal switch to its interpreted evaluation, the path
        # it falls back to whenever generated code fails to compile)
        {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"},
    ),
)


def _input_bytes(files: Sequence[str]) -> int:
    """The size of the input files (one that cannot be asked counts as large)."""
    from feed.sources.inputs import input_bytes
    from protocol import SourceError

    try:
        return input_bytes(files)
    except (OSError, SourceError):
        return SMALL_INPUT_BYTES + 1


@contextlib.contextmanager
def spark_when_asked(
    start: Callable[[], Any],
    conf: Iterable[tuple[str, str]] | Mapping[str, str],
    files: Sequence[str],
) -> Iterator[Callable[[], Any]]:
    """A transaction's SparkSession as a callable: ``start()`` gives it (starting Spark if
    it has not started) when the transaction first asks, and from then to the end of the
    ``with`` its settings are sized for ``files`` (:func:`sized_for_input`). A transaction
    the driver engine computes from its own parse never asks, and Spark never starts."""
    with contextlib.ExitStack() as stack:
        held: list[Any] = []

        def session() -> Any:
            if not held:
                spark = start()
                stack.enter_context(sized_for_input(spark, conf, files))
                held.append(spark)
            return held[0]

        yield session


@contextlib.contextmanager
def sized_for_input(
    spark: Any, conf: Iterable[tuple[str, str]] | Mapping[str, str], files: Sequence[str]
) -> Iterator[None]:
    """Run a transaction of small input with the settings that suit it (:data:`SMALL_INPUT`),
    each restored after it; ``--conf`` naming a setting always wins.

    - Under 16 MiB, one shuffle partition: its shuffles then take one task each instead of
      a wave per partition (a second or so of a small transaction's time); no adaptive
      execution, and no joins broadcast unless the plan asks for it (each would be a
      Spark job of its own).
    - Under 4 MiB, no generated code: a small transaction runs some 30 short Spark jobs,
      and compiling each plan's generated Java (again whenever a literal in it changes,
      such as a position) costs more than it saves on a few thousand rows.
    """
    given = dict(conf)
    size = _input_bytes(files)
    changed = {
        k: v
        for limit, group in SMALL_INPUT
        if size <= limit and not given.keys() & group.keys()
        for k, v in group.items()
    }
    before = {k: spark.conf.get(k, None) for k in changed}
    for k, v in changed.items():
        spark.conf.set(k, v)
    if changed:
        log.debug("a transaction of %d input bytes runs with %s", size, changed)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)
