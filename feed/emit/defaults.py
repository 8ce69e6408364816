"""The emitter's defaults, which ``tidefeed emit --help`` shows: constants alone, so the
command line reads them without loading the emitter's settings (feed/emit/settings.py,
which takes them from here) and the pyarrow they need."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from feed.log.info import Clock, Granularity, Layout

__all__ = [
    "DEFAULT_CLOCK",
    "DEFAULT_DRIVER_TXN_BYTES",
    "DEFAULT_GRANULARITY",
    "DEFAULT_LAYOUT",
    "DEFAULT_MAX_FILES",
    "DEFAULT_TRIGGER",
]

DEFAULT_TRIGGER = 5.0
DEFAULT_MAX_FILES = 1000
#: keyed Debezium input of at most this many bytes is computed on the driver
#: (feed/txn/driver.py; ``--driver-txn-bytes``)
DEFAULT_DRIVER_TXN_BYTES = 4 << 20
DEFAULT_CLOCK: Clock = "wallclock"  # a new feed's, when --clock is left out
DEFAULT_GRANULARITY: Granularity = "batch"  # a new feed's, when --granularity is left out
DEFAULT_LAYOUT: Layout = "times"  # a new feed's, when --layout is left out
