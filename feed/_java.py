"""Checks that a Java runtime Spark can use (17 or newer) is on this machine.

Run as ``python -m feed._java``: exit 0 with the version when fine, 1 with the exact
install step when not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

__all__ = ["MIN_JAVA", "java_binary", "java_version", "main"]

MIN_JAVA = 17
INSTALL_HINT = (
    "PySpark 4 needs Java {min} or newer. On Debian/Ubuntu install it with:\n"
    "    sudo apt-get update && sudo apt-get install -y openjdk-17-jre-headless\n"
    "or point JAVA_HOME at an existing JDK/JRE {min}+."
)


def java_binary() -> str | None:
    """The ``java`` Spark would start: ``$JAVA_HOME/bin/java``, else the one on the PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("java")


def java_version() -> int | None:
    """The major version of the Java runtime Spark would use, or ``None`` if none is found."""
    java = java_binary()
    if java is None:
        return None
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major  # "1.8" means Java 8


def main() -> int:
    version = java_version()
    if version is None:
        print(
            "tidefeed: no Java runtime found.\n" + INSTALL_HINT.format(min=MIN_JAVA),
            file=sys.stderr,
        )
        return 1
    if version < MIN_JAVA:
        print(
            f"tidefeed: Java {version} found.\n" + INSTALL_HINT.format(min=MIN_JAVA),
            file=sys.stderr,
        )
        return 1
    print(f"java {version}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
