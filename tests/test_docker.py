"""docker/ checked statically (no Docker engine runs here): the files parse, every service
command is a real tidefeed command line, every path they copy or mount exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyspark
import pytest
import yaml

from feed.cli.main import build_parser

ROOT = Path(__file__).parents[1]
DOCKER = ROOT / "docker"
INSTRUCTIONS = {
    "FROM",
    "RUN",
    "ENV",
    "WORKDIR",
    "COPY",
    "EXPOSE",
    "ENTRYPOINT",
    "CMD",
    "ARG",
    "LABEL",
    "USER",
}


def dockerfile_instructions() -> list[tuple[str, str]]:
    out, pending = [], ""
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word, rest))
            pending = ""
    return out


def test_dockerfile_parses_and_copies_what_exists():
    instructions = dockerfile_instructions()
    assert instructions[0][0] == "FROM"
    assert {w for w, _ in instructions} <= INSTRUCTIONS
    copies = [rest.split()[:-1] for w, rest in instructions if w == "COPY"]
    assert copies
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), src  # the build context is the repository root
    assert any("openjdk-17" in rest for w, rest in instructions if w == "RUN")
    assert ("ENTRYPOINT", '["tidefeed"]') in instructions


COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def test_compose_has_the_cluster_the_servers_and_a_store():
    assert {
        "spark-master",
        "spark-worker-1",
        "spark-worker-2",
        "emitter",
        "server",
        "receiver",
        "minio",
    } <= set(SERVICES)


@pytest.mark.parametrize(
    "name", sorted(n for n, s in SERVICES.items() if "build" in s and "entrypoint" not in s)
)
def test_service_commands_are_real_tidefeed_command_lines(name):
    argv = SERVICES[name]["command"]
    build_parser().parse_args(argv)  # exits (fails the test) on a bad command line
    out = subprocess.run(
        [sys.executable, "-m", "feed.cli.main", argv[0], "--help"], capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_spark_services_use_the_packaged_launcher():
    for name in ("spark-master", "spark-worker-1", "spark-worker-2"):
        entry = SERVICES[name]["entrypoint"][0]
        assert entry.endswith("pyspark/bin/spark-class")
        assert (Path(pyspark.__file__).parent / "bin" / "spark-class").exists()
        assert SERVICES[name]["command"][0].startswith("org.apache.spark.deploy.")


def test_mounted_folders_exist():
    for svc in SERVICES.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), src


def test_an_s3_log_comes_with_the_s3a_jars_and_a_bucket():
    emitter = SERVICES["emitter"]
    log = emitter["command"][emitter["command"].index("--log") + 1]
    assert log.startswith("s3://")
    assert "hadoop-aws" in emitter["environment"]["PYSPARK_SUBMIT_ARGS"]
    bucket = log.split("://", 1)[1].split("?", 1)[0]
    assert f"mb -p log/{bucket}" in " ".join(SERVICES["make-bucket"]["command"])
    assert (
        "make-bucket" in emitter["depends_on"] and "make-bucket" in SERVICES["server"]["depends_on"]
    )


def test_hadoop_aws_matches_the_hadoop_of_the_pyspark_wheel():
    """hadoop-aws only works beside the very Hadoop version Spark carries."""
    import re

    jars = Path(pyspark.__file__).parent / "jars"
    (api,) = jars.glob("hadoop-client-api-*.jar")
    wheel = api.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    args = SERVICES["emitter"]["environment"]["PYSPARK_SUBMIT_ARGS"]
    (pinned,) = re.findall(r"org\.apache\.hadoop:hadoop-aws:([0-9.]+)", args)
    assert pinned == wheel


def test_the_workers_see_the_input_where_the_emitter_names_it():
    """Executors on the workers read the input files: the folder is mounted there too."""
    emitter = SERVICES["emitter"]
    source = emitter["command"][emitter["command"].index("--source") + 1]
    folder = source.split(":", 1)[1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in emitter["volumes"]}
    assert folder in mounts
    for name in ("spark-worker-1", "spark-worker-2"):
        theirs = {v.split(":")[1]: v.split(":")[0] for v in SERVICES[name].get("volumes", [])}
        assert theirs.get(folder) == mounts[folder], name
