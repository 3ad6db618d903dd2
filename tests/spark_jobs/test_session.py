"""Python workers import the project from the checkout the driver runs (spark_jobs.session.with_project_path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import spark_jobs
from spark_jobs.session import PROJECT_ROOT, with_project_path

pytestmark = pytest.mark.unit


def test_the_checkout_goes_first_on_the_workers_path_and_the_rest_stays():
    assert PROJECT_ROOT == Path(spark_jobs.__file__).resolve().parents[1]
    root = str(PROJECT_ROOT)
    assert with_project_path({})["PYTHONPATH"] == root
    given = {"PYTHONPATH": os.pathsep.join(["/opt/a", "/opt/b"]), "OTHER": "1"}
    assert with_project_path(given) == {"PYTHONPATH": os.pathsep.join([root, "/opt/a", "/opt/b"]), "OTHER": "1"}
    already = {"PYTHONPATH": os.pathsep.join(["/opt/a", root])}
    assert with_project_path(already) == already
