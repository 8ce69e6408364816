"""`protocol` works without pyspark: a downstream engine installs it alone."""

import subprocess
import sys

BLOCK_SPARK = """
import importlib.abc, sys
class NoSpark(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pyspark" or name.startswith("pyspark.") or name == "py4j":
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, NoSpark())
import pkgutil, importlib, protocol
for info in pkgutil.iter_modules(protocol.__path__):
    importlib.import_module("protocol." + info.name)
from protocol import Update, Updates, get_codec, check_messages, announcement, progress
msgs = [announcement(0), Updates.of([Update({"a": 1}, 0, 1)]), progress(0, 1)]
body = get_codec("avro").encode(msgs)
assert check_messages(get_codec("avro").decode(body)) == []
assert not any(m.startswith("pyspark") for m in sys.modules)
print("ok")
"""


def test_protocol_imports_and_works_without_pyspark():
    out = subprocess.run([sys.executable, "-c", BLOCK_SPARK], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
