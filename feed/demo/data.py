"""A realistic change stream for demos and tests: a small bank as Debezium events.

Accounts open (``c``), take deposits and transfers (``u``, two rows in one database
transaction), close (``d``), reopen under the same id (in the closing transaction or a
later one, with extreme balances), get no-op updates and changes undone within the same
transaction. Events carry ``source.lsn`` (growing), ``source.txId`` (one per database
transaction) and ``ts_ms`` like the Debezium PostgreSQL connector's, with and without the
``{"schema", "payload"}`` wrapper. The generator also returns the table's final state, the
ground truth a feed must accumulate to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["ACCOUNTS_SCHEMA", "BankStream", "generate_bank"]

#: Avro record schema of the accounts table.
ACCOUNTS_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "accounts",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "owner", "type": "string"},
        {"name": "balance", "type": "long"},
        {"name": "active", "type": ["null", "boolean"], "default": None},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}

_CONNECT_FIELDS = [
    {"type": "int64", "optional": False, "field": "id"},
    {"type": "string", "optional": False, "field": "owner"},
    {"type": "int64", "optional": False, "field": "balance"},
    {"type": "boolean", "optional": True, "field": "active"},
    {"type": "string", "optional": True, "field": "note"},
]
_CONNECT_SCHEMA = {
    "type": "struct",
    "name": "pg.public.accounts.Envelope",
    "optional": False,
    "fields": [
        {
            "type": "struct",
            "optional": True,
            "fields": _CONNECT_FIELDS,
            "field": "before",
            "name": "pg.public.accounts.Value",
        },
        {
            "type": "struct",
            "optional": True,
            "fields": _CONNECT_FIELDS,
            "field": "after",
            "name": "pg.public.accounts.Value",
        },
        {"type": "struct", "field": "source", "optional": False, "fields": []},
        {"type": "string", "field": "op", "optional": False},
        {"type": "int64", "field": "ts_ms", "optional": True},
    ],
}
_OWNERS = ["ada", "björn", "chen", "dolores", "émile", "fatima", "grace", "hiro", "ines", "jo"]


def _clamp(v: int) -> int:
    """Keep a balance inside a 64-bit long, as the database column would."""
    return max(-(2**63), min(2**63 - 1, v))


@dataclass
class BankStream:
    """Events (one JSON line each), grouped into database transactions, and the final table."""

    events: list[bytes] = field(default_factory=list)
    final: dict[int, dict[str, Any]] = field(default_factory=dict)
    transactions: int = 0

    def lines(self) -> bytes:
        return b"".join(e + b"\n" for e in self.events)


def generate_bank(
    *,
    transactions: int = 50,
    seed: int = 7,
    start_ms: int = 1_700_000_000_000,
    wrapped_every: int = 3,
) -> BankStream:
    """Generate ``transactions`` database transactions of bank activity, deterministically."""
    rng = random.Random(seed)
    out = BankStream()
    bank = _Bank(rng)
    lsn = 1000
    ts = start_ms
    for tx in range(transactions):
        ts += rng.randint(1, 50)
        for op, old, new in bank.transaction():
            lsn += rng.randint(1, 9)
            payload = _payload(op, old, new, tx_id=5000 + tx, lsn=lsn, ts=ts)
            event = (
                {"schema": _CONNECT_SCHEMA, "payload": payload}
                if wrapped_every and len(out.events) % wrapped_every == 0
                else payload
            )
            out.events.append(orjson.dumps(event))
        out.transactions += 1
    out.final = bank.table
    return out


#: one change of a bank transaction: op, before image, after image
_Change = tuple[str, dict[str, Any] | None, dict[str, Any] | None]


class _Bank:
    """The accounts table as :func:`generate_bank` changes it, one random transaction at
    a time."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.table: dict[int, dict[str, Any]] = {}
        self.ids: list[int] = []  # the live ids, for O(1) random picks
        self.where: dict[int, int] = {}  # id -> its index in ids
        self.reopen_later: list[dict[str, Any]] = []
        self.next_id = 1

    def add(self, acct: int) -> None:
        self.where[acct] = len(self.ids)
        self.ids.append(acct)

    def remove(self, acct: int) -> None:
        i = self.where.pop(acct)
        last = self.ids.pop()
        if last != acct:
            self.ids[i] = last
            self.where[last] = i

    def transaction(self) -> list[_Change]:
        """The changes of one random transaction, applied to the table."""
        rng, table = self.rng, self.table
        changes: list[_Change] = []
        kind = rng.random()
        if self.reopen_later and kind < 0.1:
            back = self.reopen_later.pop()
            changes.append(("c", None, back))
            table[back["id"]] = back
            self.add(back["id"])
            kind = 2.0  # nothing else in this transaction
        if kind < 0.25 or len(table) < 3:
            changes += self.open_accounts()
        elif kind < 0.55:
            a, b = rng.sample(self.ids, 2)
            amount = rng.randint(1, 500)
            for acct, delta in ((a, -amount), (b, amount)):
                before = table[acct]
                after = dict(before, balance=_clamp(before["balance"] + delta))
                changes.append(("u", before, after))
                table[acct] = after
        elif kind < 0.7:
            before = table[rng.choice(self.ids)]
            changes.append(("u", before, dict(before)))  # a no-op update
        elif kind < 0.8:
            # changed and changed back in one transaction: the updates cancel
            before = table[rng.choice(self.ids)]
            mid = dict(before, note="pending")
            changes += [("u", before, mid), ("u", mid, before)]
        elif kind < 0.86:
            acct = rng.choice(self.ids)
            changes.append(("d", table.pop(acct), None))
            self.remove(acct)
        elif kind < 0.9:
            changes += self.close_and_reopen()
        elif kind < 1.0:
            acct = rng.choice(self.ids)
            before = table[acct]
            after = dict(
                before,
                balance=_clamp(before["balance"] + rng.randint(-100, 1000)),
                active=rng.choice([True, False, None]),
            )
            changes.append(("u", before, after))
            table[acct] = after
        return changes

    def open_accounts(self) -> list[_Change]:
        rng = self.rng
        changes: list[_Change] = []
        for _ in range(rng.randint(1, 3)):
            row: dict[str, Any] = {
                "id": self.next_id,
                "owner": rng.choice(_OWNERS),
                "balance": rng.randint(0, 10_000),
                "active": True,
                "note": rng.choice([None, "", "vip", "línea\nnueva"]),
            }
            self.next_id += 1
            changes.append(("c", None, row))
            self.table[row["id"]] = row
            self.add(row["id"])
        return changes

    def close_and_reopen(self) -> list[_Change]:
        """An account closed and reopened under the same id, in one transaction or
        across two."""
        rng = self.rng
        acct = rng.choice(self.ids)
        gone = self.table.pop(acct)
        changes: list[_Change] = [("d", gone, None)]
        reopened = dict(
            gone,
            balance=rng.choice([0, 2**62, -(2**62), 2**63 - 1]),
            note=rng.choice(["reopened", "ré-ouvert ✓", None]),
        )
        if rng.random() < 0.5:
            changes.append(("c", None, reopened))
            self.table[acct] = reopened
        else:
            self.remove(acct)
            self.reopen_later.append(reopened)
        return changes


def _payload(op: str, old: Any, new: Any, *, tx_id: int, lsn: int, ts: int) -> dict[str, Any]:
    """A Debezium PostgreSQL change event's payload for the accounts table."""
    return {
        "before": old,
        "after": new,
        "source": {
            "version": "2.7.0.Final",
            "connector": "postgresql",
            "name": "pg",
            "ts_ms": ts,
            "snapshot": "false",
            "db": "bank",
            "schema": "public",
            "table": "accounts",
            "txId": tx_id,
            "lsn": lsn,
            "xmin": None,
        },
        "op": op,
        "ts_ms": ts + 3,
        "transaction": None,
    }
