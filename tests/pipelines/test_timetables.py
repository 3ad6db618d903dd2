"""The minute DAG's timetable: runs created before their interval ends, with the intervals, logical dates and run
ids of Airflow's CronDataIntervalTimetable; and its registration through the project's plugin, which is what
lets Airflow's scheduler read it back."""

from __future__ import annotations

import json
import subprocess
import sys

import pendulum
import pytest
from airflow.timetables.base import DataInterval, TimeRestriction
from airflow.timetables.interval import CronDataIntervalTimetable
from airflow.utils.types import DagRunType

from components.config import load_config
from pipelines.airflow_env import DAGS_FOLDER, airflow_environment
from pipelines.timetables import LeadingCronTimetable

UTC = pendulum.UTC
RESTRICTION = TimeRestriction(earliest=pendulum.datetime(2026, 1, 1, tz=UTC), latest=None, catchup=True)


def test_a_run_is_created_lead_seconds_before_its_minute_closes_with_the_same_interval_and_run_id():
    plain = CronDataIntervalTimetable("* * * * *", UTC)
    leading = LeadingCronTimetable("* * * * *", UTC, lead_s=5)
    last = DataInterval(pendulum.datetime(2026, 3, 2, 10, 6, tz=UTC), pendulum.datetime(2026, 3, 2, 10, 7, tz=UTC))
    expected = plain.next_dagrun_info(last_automated_data_interval=last, restriction=RESTRICTION)
    info = leading.next_dagrun_info(last_automated_data_interval=last, restriction=RESTRICTION)

    assert info.data_interval == expected.data_interval == DataInterval(
        pendulum.datetime(2026, 3, 2, 10, 7, tz=UTC), pendulum.datetime(2026, 3, 2, 10, 8, tz=UTC))
    assert info.logical_date == expected.logical_date
    assert info.run_after == pendulum.datetime(2026, 3, 2, 10, 7, 55, tz=UTC)
    assert expected.run_after == pendulum.datetime(2026, 3, 2, 10, 8, tz=UTC)
    # The run id is the plain timetable's (its run_after is the interval's end), not one of the earlier time.
    assert leading.generate_run_id(run_type=DagRunType.SCHEDULED, run_after=info.run_after,
                                   data_interval=info.data_interval) == plain.generate_run_id(
        run_type=DagRunType.SCHEDULED, run_after=expected.run_after, data_interval=expected.data_interval
    ) == "scheduled__2026-03-02T10:08:00+00:00"
    # A manual run is named by when it was asked for, as before.
    asked = pendulum.datetime(2026, 3, 2, 10, 8, 21, tz=UTC)
    assert leading.generate_run_id(run_type=DagRunType.MANUAL, run_after=asked, data_interval=info.data_interval
                                   ) == "manual__2026-03-02T10:08:21+00:00"


def test_without_a_lead_it_schedules_exactly_as_airflows_cron_timetable():
    last = DataInterval(pendulum.datetime(2026, 3, 2, 10, 6, tz=UTC), pendulum.datetime(2026, 3, 2, 10, 7, tz=UTC))
    assert LeadingCronTimetable("* * * * *", UTC).next_dagrun_info(
        last_automated_data_interval=last, restriction=RESTRICTION
    ) == CronDataIntervalTimetable("* * * * *", UTC).next_dagrun_info(
        last_automated_data_interval=last, restriction=RESTRICTION)


def test_the_run_is_never_created_before_its_interval_starts():
    daily = LeadingCronTimetable("0 0 * * *", UTC, lead_s=30)
    last = DataInterval(pendulum.datetime(2026, 3, 1, tz=UTC), pendulum.datetime(2026, 3, 2, tz=UTC))
    info = daily.next_dagrun_info(last_automated_data_interval=last, restriction=RESTRICTION)
    assert info.run_after == pendulum.datetime(2026, 3, 2, 23, 59, 30, tz=UTC)
    every_minute = LeadingCronTimetable("* * * * *", UTC, lead_s=30)
    minute = every_minute.next_dagrun_info(last_automated_data_interval=last, restriction=RESTRICTION)
    assert minute.run_after == minute.data_interval.end.subtract(seconds=30) >= minute.data_interval.start


def test_catch_up_off_schedules_the_minute_that_closed_last_and_then_the_one_running_now():
    now = pendulum.now(UTC)
    leading = LeadingCronTimetable("* * * * *", UTC, lead_s=5)
    off = TimeRestriction(earliest=pendulum.datetime(2026, 1, 1, tz=UTC), latest=None, catchup=False)
    first = leading.next_dagrun_info(last_automated_data_interval=None, restriction=off)
    assert first.data_interval.end <= now < first.data_interval.end.add(minutes=1, seconds=1)
    assert first.run_after <= now  # created at once
    second = leading.next_dagrun_info(last_automated_data_interval=first.data_interval, restriction=off)
    assert second.data_interval.start == first.data_interval.end
    assert second.run_after == second.data_interval.end.subtract(seconds=5)


def test_the_lead_survives_serialization_and_a_lead_out_of_range_says_which_setting():
    leading = LeadingCronTimetable("* * * * *", UTC, lead_s=2.5)
    data = leading.serialize()
    assert data["lead_s"] == 2.5 and data["expression"] == "* * * * *"
    assert LeadingCronTimetable.deserialize(json.loads(json.dumps(data))) == leading
    assert LeadingCronTimetable.deserialize(data) != LeadingCronTimetable("* * * * *", UTC, lead_s=3)
    assert leading.summary == "* * * * *, created 2.5 s before the interval ends"
    assert "2.5 s before its interval ends" in leading.description
    for bad in (-1, 31):
        with pytest.raises(ValueError, match="incremental.run_lead_s"):
            LeadingCronTimetable("* * * * *", UTC, lead_s=bad)


@pytest.mark.parametrize("zone", [pendulum.timezone("Europe/Berlin"), pendulum.FixedTimezone(-5 * 3600)],
                         ids=["named", "fixed offset"])
def test_a_timetable_in_another_zone_comes_back_in_that_zone(zone):
    leading = LeadingCronTimetable("0 * * * *", zone, lead_s=1)
    data = json.loads(json.dumps(leading.serialize()))
    restored = LeadingCronTimetable.deserialize(data)
    assert restored == leading and restored.cron_timezone.utcoffset(pendulum.datetime(2026, 7, 1)) == \
        zone.utcoffset(pendulum.datetime(2026, 7, 1))
    # The same runs as Airflow's own timetable read back from the same data.
    plain = CronDataIntervalTimetable.deserialize({k: v for k, v in data.items() if k != "lead_s"})
    last = DataInterval(pendulum.datetime(2026, 7, 1, 8, tz=zone), pendulum.datetime(2026, 7, 1, 9, tz=zone))
    assert restored.next_dagrun_info(last_automated_data_interval=last, restriction=RESTRICTION).data_interval == \
        plain.next_dagrun_info(last_automated_data_interval=last, restriction=RESTRICTION).data_interval


PROBE = r"""
import json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
bag = DagBag(dag_folder=sys.argv[1])
dag = bag.dags["ctr_incremental"]
data = json.loads(json.dumps(DagSerialization.to_dict(dag)))
restored = DagSerialization.from_dict(data)
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()},
                  "type": type(restored.timetable).__module__ + "." + type(restored.timetable).__name__,
                  "lead_s": restored.timetable.lead_s, "summary": restored.timetable.summary}))
"""


@pytest.mark.integration
def test_airflow_serializes_the_minute_dags_timetable_through_the_projects_plugin(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    env = airflow_environment(config, base={"PATH": "/usr/bin:/bin"})
    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{tmp_path}/missing-dir/none.db"
    result = subprocess.run([sys.executable, "-c", PROBE, str(DAGS_FOLDER)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"errors": {}, "type": "pipelines.timetables.LeadingCronTimetable", "lead_s": 5.0,
                   "summary": "* * * * *, created 5 s before the interval ends"}
    # Without the plugin Airflow cannot serialize the DAG, and says which timetable it is missing.
    env["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(tmp_path / "no-plugins")
    result = subprocess.run([sys.executable, "-c", PROBE, str(DAGS_FOLDER)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0 and "LeadingCronTimetable" in result.stderr
