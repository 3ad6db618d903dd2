"""The Airflow local settings that warm task processes: which processes preload, and what preloading does."""

from __future__ import annotations

import os
import subprocess
import sys
import types

from pipelines.airflow_env import SETTINGS_FOLDER

sys.path.insert(0, str(SETTINGS_FOLDER))
import airflow_local_settings as settings  # noqa: E402


def test_only_processes_that_fork_tasks_preload():
    assert settings.forks_tasks(["/venv/bin/airflow", "scheduler"])
    assert settings.forks_tasks(["/venv/lib/python3.11/site-packages/airflow/__main__.py", "scheduler", "-n", "5"])
    assert settings.forks_tasks(["airflow", "celery", "worker", "--concurrency", "4"])
    assert not settings.forks_tasks(["airflow", "api-server", "--port", "8080"])
    assert not settings.forks_tasks(["airflow", "dag-processor"])
    assert not settings.forks_tasks(["airflow", "celery", "flower"])
    assert not settings.forks_tasks(["airflow", "tasks", "test", "scheduler"])
    assert not settings.forks_tasks(["pytest"])


def test_preload_imports_what_exists_and_skips_what_does_not(monkeypatch):
    # The module's clock reads 10.0 and 10.25 around json's import, then 20.0 before the one that is missing.
    clock = iter([10.0, 10.25, 20.0])
    monkeypatch.setattr(settings, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    assert settings.preload(("json", "no_such_module_ctr")) == {"json": 0.25}
    assert next(clock, None) is None  # the missing module's import was timed from its start only


def test_airflow_started_as_the_scheduler_preloads_through_the_projects_environment(tmp_path):
    """The environment the project gives its Airflow processes puts the settings on the path: `import airflow`
    in a scheduler loads them (and so the libraries), in an api-server it loads them without preloading."""
    from components.config import load_config
    from pipelines.airflow_env import airflow_environment

    env = airflow_environment(load_config(overrides={"paths.data_root": str(tmp_path)}, environ={}), base={
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    code = ("import sys; sys.argv = ['airflow', sys.argv[1]]; import airflow, airflow.settings as s; "
            "print(s.__dict__.get('PRELOAD') is None, 'tensorflow' in sys.modules, "
            "'great_expectations' in sys.modules, 'mlflow' in sys.modules)")
    scheduler = subprocess.run([sys.executable, "-c", code, "scheduler"], env=env, capture_output=True,
                               text=True, timeout=300)
    assert scheduler.returncode == 0, scheduler.stderr[-2000:]
    assert scheduler.stdout.split() == ["True", "True", "True", "True"]  # preloaded; airflow.settings untouched
    assert "[ctr] preloaded" in scheduler.stderr
    api = subprocess.run([sys.executable, "-c", code, "api-server"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert api.returncode == 0, api.stderr[-2000:]
    assert api.stdout.split()[:2] == ["True", "False"] and "[ctr] preloaded" not in api.stderr
