"""Live traffic: the synthetic click log written minute by minute as the wall clock passes.

Each minute partition is written right after the minute closes, as a log shipper would deliver it, so a
per-minute pipeline sees data arrive in real time. A minute's rows are drawn from (seed, the minute's
timestamp), not from its position in the run: re-running a minute, or starting the writer later, writes the
same bytes for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from components.config import GenerateConfig
from components.layout import Layout
from components.synthetic import RawShape, write_minute

MINUTE_S = 60


def live_minute_index(minute: datetime) -> int:
    """The draw index of a wall-clock minute: whole minutes since the Unix epoch."""
    if minute.tzinfo is None:
        raise ValueError(f"minute must be timezone-aware (UTC), got naive {minute.isoformat()}")
    seconds = int(minute.timestamp())
    if seconds % MINUTE_S or minute.microsecond:
        raise ValueError(f"minute must start on a whole minute, got {minute.isoformat()}")
    if seconds < 0:
        raise ValueError(f"minute must be at or after 1970-01-01T00:00Z, got {minute.isoformat()}")
    return seconds // MINUTE_S


def write_live_minute(config: GenerateConfig, layout: Layout, minute: datetime, shape: RawShape | None = None) -> None:
    """Writes one wall-clock minute's partition (and its planted probabilities) in `shape`'s columns (the
    generator's default if unset); idempotent."""
    write_minute(config, layout, live_minute_index(minute), minute, shape)


def write_live_minutes(
    config: GenerateConfig,
    layout: Layout,
    *,
    num_minutes: int,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    on_minute: Callable[[datetime, float], None] | None = None,
    shape: RawShape | None = None,
) -> list[datetime]:
    """Writes `num_minutes` consecutive minutes, starting with the one open now, each once it has closed.

    `clock` gives epoch seconds; `sleep` waits. After each write, `on_minute(minute, seconds_after_close)` is
    called. `shape`: the columns written (components.synthetic.RawShape; the generator's default if unset). A
    writer that falls behind (a write or a sleep that overruns) still writes every minute, in order,
    and the lag shows in `seconds_after_close`. Returns the minutes written (UTC).
    """
    if num_minutes < 1:
        raise ValueError(f"num_minutes must be at least 1, got {num_minutes}")
    first_start_s = int(clock() // MINUTE_S) * MINUTE_S
    written: list[datetime] = []
    for offset in range(num_minutes):
        start_s = first_start_s + offset * MINUTE_S
        close_s = start_s + MINUTE_S
        while (now := clock()) < close_s:
            sleep(close_s - now)
        minute = datetime.fromtimestamp(start_s, UTC)
        write_live_minute(config, layout, minute, shape)
        written.append(minute)
        if on_minute is not None:
            on_minute(minute, clock() - close_s)
    return written
