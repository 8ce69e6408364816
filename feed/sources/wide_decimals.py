"""Decimals wider than Spark's 38 digits, kept as their exact text by a vectorized UDF.

A module of its own because the UDF's type hints need pandas, and importing pandas costs
a Python worker of Spark's tasks about half a second: the modules every columnar parse
and grouped write imports (:mod:`feed.sources.connect` among them) stay free of it, and
only a transaction with such a decimal pays for it."""

from __future__ import annotations

from typing import Any

import pandas as pd
from pyspark.sql import Column
from pyspark.sql import types as T

__all__ = ["wide_decimal_text"]


def _wide_text(unscaled: pd.Series, scale: pd.Series) -> pd.Series:
    """Exact decimal text of big-endian two's-complement integers at a scale: Spark's
    decimals stop at 38 digits, Python's integers do not."""

    def one(b: bytes | None, s: int) -> str | None:
        if b is None:
            return None
        u = int.from_bytes(b, "big", signed=True)
        digits = str(abs(u)).rjust(s + 1, "0")
        text = f"{digits[:-s]}.{digits[-s:]}" if s > 0 else digits
        return "-" + text if u < 0 else text

    return pd.Series([one(b, int(s)) for b, s in zip(unscaled, scale, strict=True)])


def wide_decimal_text(raw: Column, scale: Column) -> Column:
    """:func:`_wide_text` as a column (only decimals wider than 38 digits, which no Spark
    expression can hold, take this path)."""
    from pyspark.sql.pandas.functions import pandas_udf

    udf: Any = pandas_udf(_wide_text, T.StringType())  # type: ignore[call-overload]
    out: Column = udf(raw, scale)
    return out
