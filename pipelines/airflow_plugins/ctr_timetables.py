"""Registers the project's timetables with Airflow, which deserializes a DAG's custom timetable only when a plugin
names it (pipelines/timetables.py). This folder is the plugins folder of the project's Airflow processes
(pipelines/airflow_env.py, docker-compose.yml)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from pipelines.timetables import LeadingCronTimetable


class CtrTimetablesPlugin(AirflowPlugin):
    name = "ctr_timetables"
    timetables = [LeadingCronTimetable]
