"""The stage packages of ``feed/`` import only downstream of themselves (docs/map.md):
source -> log -> transaction -> emitter -> server -> demo -> command line, and no module
imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

FEED = Path(__file__).resolve().parents[1] / "feed"

#: a package may import the packages of its rank and below
RANK = {"sources": 1, "log": 2, "txn": 3, "emit": 4, "serve": 5, "demo": 6, "cli": 7}
#: top-level modules every package may import; they import nothing of feed
BASE = {"_faults", "_java", "errors"}
#: entry points (``import feed``, ``spark-submit``, PySpark's data source lookup)
ENTRY = {"__init__", "submit", "spark_source"}


def module_name(path: Path) -> str:
    parts = path.relative_to(FEED).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(("feed", *parts))


def imports(path: Path) -> list[tuple[int, str]]:
    """Every ``feed.…`` module ``path`` imports, at any depth (lazy imports too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{path}: a relative import; feed imports absolutely")
            if node.module.startswith("feed."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.startswith("feed."))
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): {m for _, m in imports(p)} for p in sorted(FEED.rglob("*.py"))}


def test_stages_import_only_downstream() -> None:
    wrong = []
    for path in sorted(FEED.rglob("*.py")):
        here = path.relative_to(FEED).parts
        top = here[0].removesuffix(".py")
        for line, target in imports(path):
            there = target.split(".")[1]
            if there in BASE:
                if top in BASE:
                    wrong.append(f"{path}:{line}: a base module imports {target}")
                continue
            if there in ENTRY and top != "__init__":
                wrong.append(f"{path}:{line}: {target} is an entry point, not a library")
            elif top in RANK and (there not in RANK or RANK[there] > RANK[top]):
                wrong.append(f"{path}:{line}: stage {top!r} imports {target}, upstream of it")
    assert wrong == []


def test_no_import_cycles() -> None:
    g = graph()
    # a package's __init__ is reached by importing any of its modules: not an edge
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            cycles.append([*path[path.index(m) :], m])
            return
        if m in done:
            return
        for n in sorted(g.get(m, ())):
            visit(n, [*path, m])
        done.add(m)

    for m in sorted(g):
        visit(m, [])
    assert cycles == []


def test_feed_holds_few_files_directly() -> None:
    assert len(list(FEED.glob("*.py"))) <= 12
    assert {p.name for p in FEED.iterdir() if p.is_dir() and p.name != "__pycache__"} >= set(RANK)


def test_modules_and_functions_stay_readable_in_size() -> None:
    """Issue 31's measure of a module one can read: about 400 lines (420 allowed), no
    function over 80."""
    too_big = []
    for path in sorted(FEED.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 420:
            too_big.append(f"{path.relative_to(FEED)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > 80:
                    too_big.append(f"{path.relative_to(FEED)}:{node.lineno} {node.name}: {size}")
    assert too_big == []


def test_only_the_sources_package_tells_source_kinds_apart_by_name() -> None:
    """Outside ``feed/sources`` a kind is asked what it does (feed/sources/registry.py),
    never compared with a kind's name."""
    from feed.sources.registry import KINDS

    found = []
    for path in sorted(FEED.rglob("*.py")):
        if path.relative_to(FEED).parts[0] == "sources":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            values = [e for s in sides for e in (s.elts if isinstance(s, ast.Tuple) else [s])]
            if any(isinstance(v, ast.Constant) and v.value in KINDS for v in values):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
