"""The JVM classes PySpark builds plans with, looked up once per JVM, not once per call.

Each ``F.col``, ``F.lit``, ``F.when``… of classic PySpark (not Connect) first asks the
JVM what ``org.apache.spark.sql.functions`` is, then whether it has that member, by two
py4j reflection round trips, and only then calls it; so does every list of columns turned
into a Scala ``Seq`` (``PythonUtils.toSeq``). The answers never change while the JVM
lives. A small Spark-path transaction makes some 1 600 such lookups, 0.2-0.4 ms each
(docs/map.md, 2026-12-02).

:func:`keep_lookups` puts those classes on the session's JVM view (py4j's ``JVMView``,
whose attribute lookup asks the JVM only for names it does not hold), each as a class
that keeps the methods it has found. A function PySpark has used once is then one round
trip: the call. Only methods are kept, never a field's value, so nothing read through
them can go stale; a name that is not a class in this JVM is left to py4j as before.
"""

from __future__ import annotations

from typing import Any

from py4j.java_gateway import JavaClass, JavaMember

__all__ = ["KEPT", "keep_lookups"]

#: the names PySpark looks up on the JVM view for nearly every expression and plan, in
#: the order of how often a transaction asks for them (counted, docs/map.md)
KEPT = (
    "org.apache.spark.sql.functions",
    "functions",
    "PythonUtils",
    "PythonSQLUtils",
    "org.apache.spark.sql.classic.SparkSession",
)


class _KeptMethods(JavaClass):  # type: ignore[misc]
    """A py4j class that asks the JVM about each of its methods once."""

    def __getattr__(self, name: str) -> Any:
        member = super().__getattr__(name)
        if isinstance(member, JavaMember):  # (a field's value is asked for every time)
            self.__dict__[name] = member
        return member


def keep_lookups(jvm: Any) -> None:
    """Hold the classes of :data:`KEPT` on ``jvm`` (a py4j ``JVMView``; done once)."""
    held = vars(jvm)
    for name in KEPT:
        if name in held:
            continue
        found = getattr(jvm, name)  # (what the view resolves the name to, as it would)
        if type(found) is JavaClass:
            held[name] = _KeptMethods(found._fqn, found._gateway_client)
