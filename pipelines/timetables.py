"""A cron schedule of data intervals whose runs are created a little before their interval ends.

Airflow creates a run of `CronDataIntervalTimetable` when its interval ends. For a minute run that costs the
whole start-up of the run after the minute closes: the scheduler's next loop, the run's creation, the sensor
task's process (1.2 s after the close on 2 shared cores, docs/freshness.md). `LeadingCronTimetable` creates the
run `lead_s` seconds before the interval ends instead, so the sensor task is already waiting when the minute's
completion marker lands (pipelines.runner holds a sensor's poke open for that, SENSOR_HOLD_S).

Only when the run is created changes:
- the data interval, the logical date and the run id (`scheduled__<interval end>`) are those of
  CronDataIntervalTimetable, so every step sees the same run as before;
- nothing reads the minute before its sensor says it is complete, and the sensor's lateness is counted from
  the interval's end (incremental.wait_for_data_s).

Airflow loads a custom timetable only from a plugin: pipelines/airflow_plugins/ctr_timetables.py registers this
one, and the project's Airflow processes have that folder as their plugins folder (pipelines/airflow_env.py,
docker-compose.yml). A process that parses the DAG without it fails to serialize the DAG and says so.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction
from airflow.timetables.interval import CronDataIntervalTimetable
from airflow.utils.types import DagRunType

MAX_LEAD_S = 30.0


class LeadingCronTimetable(CronDataIntervalTimetable):
    """CronDataIntervalTimetable whose runs are created `lead_s` seconds before their data interval ends (never
    before it starts)."""

    def __init__(self, cron: str, timezone: Any, lead_s: float = 0.0) -> None:
        if not 0.0 <= float(lead_s) <= MAX_LEAD_S:
            raise ValueError(f"a run can be created 0 to {MAX_LEAD_S:.0f} s before its interval ends, not "
                             f"{lead_s!r} s: set incremental.run_lead_s in that range (0 creates it at the end)")
        super().__init__(cron, timezone)
        # Kept here too: the parent class holds them under private names.
        self.cron, self.cron_timezone = cron, timezone
        self.lead_s = float(lead_s)
        if self.lead_s:
            self.description = f"{self.description}; each run is created {self.lead_s:g} s before its interval ends"

    @property
    def summary(self) -> str:
        return f"{self.cron}, created {self.lead_s:g} s before the interval ends" if self.lead_s else self.cron

    def serialize(self) -> dict[str, Any]:
        return {**super().serialize(), "lead_s": self.lead_s}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> LeadingCronTimetable:
        return cls(data["expression"], decode_timezone(data["timezone"]), float(data.get("lead_s", 0.0)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LeadingCronTimetable):
            return NotImplemented
        return (self.cron, self.cron_timezone, self.lead_s) == (other.cron, other.cron_timezone, other.lead_s)

    def __hash__(self) -> int:
        return hash((self.cron, self.cron_timezone, self.lead_s))

    def next_dagrun_info(self, *, last_automated_data_interval: DataInterval | None,
                         restriction: TimeRestriction) -> DagRunInfo | None:
        info = super().next_dagrun_info(last_automated_data_interval=last_automated_data_interval,
                                        restriction=restriction)
        return info if info is None else lead(info, self.lead_s)

    def generate_run_id(self, *, run_type: DagRunType, run_after: Any, data_interval: DataInterval | None,
                        **extra: Any) -> str:
        # Scheduled runs keep the id CronDataIntervalTimetable gives them (its run_after is the interval's end).
        if run_type == DagRunType.SCHEDULED and data_interval is not None:
            run_after = data_interval.end
        return super().generate_run_id(run_type=run_type, run_after=run_after, data_interval=data_interval,
                                       **extra)


def decode_timezone(encoded: str | int) -> Any:
    """What airflow.serialization.encoders.encode_timezone wrote: a zone's name, or a fixed offset in seconds."""
    return pendulum.FixedTimezone(encoded) if isinstance(encoded, int) else pendulum.timezone(encoded)


def lead(info: DagRunInfo, lead_s: float) -> DagRunInfo:
    """`info` with its run_after `lead_s` seconds before its data interval ends, not before it starts."""
    interval = info.data_interval
    if interval is None or not lead_s:
        return info
    return info._replace(run_after=max(interval.start, interval.end.subtract(microseconds=int(lead_s * 1e6))))
