"""Data intervals: the half-open span of event time a task is responsible for."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta


@dataclass(frozen=True)
class Interval:
    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if value.tzinfo is None:
                raise ValueError(f"Interval.{name} must be timezone-aware, got {value!r}")
        if self.end <= self.start:
            raise ValueError(f"Interval end {self.end.isoformat()} must be after its start {self.start.isoformat()}")

    @classmethod
    def day(cls, date: str) -> Interval:
        """The UTC day `date` (YYYY-MM-DD)."""
        try:
            start = datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=UTC)
        except ValueError as err:
            raise ValueError(f"date {date!r} is not of the form YYYY-MM-DD") from err
        return cls(start, start + timedelta(days=1))

    @classmethod
    def minute(cls, minute: str) -> Interval:
        """The minute starting at `minute` (ISO time, UTC unless it says otherwise)."""
        start = parse_time(minute)
        if start.second or start.microsecond:
            raise ValueError(f"minute {minute!r} must start on a whole minute, e.g. 2026-01-02T00:05")
        return cls(start, start + timedelta(minutes=1))

    @classmethod
    def parse(cls, start: str, end: str) -> Interval:
        return cls(parse_time(start), parse_time(end))

    def minutes(self) -> Iterator[datetime]:
        t = self.start.replace(second=0, microsecond=0)
        while t < self.end:
            yield t
            t += timedelta(minutes=1)

    @property
    def tag(self) -> str:
        """A path-safe name, e.g. 20260101T0000-20260102T0000."""
        return f"{self.start:%Y%m%dT%H%M}-{self.end:%Y%m%dT%H%M}"

    def as_dict(self) -> dict[str, str]:
        return {"start": self.start.isoformat(), "end": self.end.isoformat()}


def day_number(moment: datetime) -> int:
    """Days since 1970-01-01 UTC: how feature states record when a value was last seen."""
    return (moment.astimezone(UTC).date() - datetime(1970, 1, 1).date()).days


def parse_time(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
