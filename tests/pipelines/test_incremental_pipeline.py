"""Minute runs in-process: a daily full model, then deltas minute by minute through the real steps (Spark,
great-expectations, TensorFlow, MLflow), served by the watcher exactly as the trainer predicts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from components.config import load_config
from components.delta import DELTA_KIND
from components.feature_state import categorical_rows, load_feature_state, transform_dense
from components.interval import Interval
from components.layout import Layout
from components.model_store import open_model_store, rollback
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES
from components.synthetic import generate
from pipelines.context import RunContext
from pipelines.incremental import DeltaGateError, NothingToLearn
from pipelines.runner import run_steps, select_steps
from serving.watcher import ModelWatcher

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAY = Interval.parse("2026-01-01T00:00", "2026-01-01T00:10")
OVERRIDES = {
    "generate.minutes": 16, "generate.rows_per_minute": 2000, "features.min_count": 5, "features.num_shards": 2,
    "features.growth_rows": 50, "spark.shuffle_partitions": 2, "spark.driver_memory": "2g", "train.epochs": 1,
    "train.batch_size": 256, "train.mlp_units": "32,16", "gate.min_auc": 0.55, "tracking.strict": True,
    "incremental.max_logloss_increase": 0.05, "incremental.wait_for_data_s": 0,
}


def run_minute(config, minute: str, **overrides):
    config = config.with_overrides(overrides) if overrides else config
    ctx = RunContext(config=config, interval=Interval.minute(minute), pipeline="incremental",
                     run_id=f"test-{minute}-{len(overrides)}")
    return run_steps(ctx, select_steps("incremental", None))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, spark):
    root = tmp_path_factory.mktemp("incremental")
    config = load_config(overrides={"paths.data_root": str(root), **OVERRIDES}, environ={})
    generate(config.generate, Layout(config.paths.root))
    run_steps(RunContext(config=config, interval=DAY, pipeline="daily", run_id="test-daily"),
              select_steps("daily", None))
    outputs = {minute: run_minute(config, minute) for minute in ("2026-01-01T00:10", "2026-01-01T00:11")}
    return {"config": config, "store": open_model_store(config.paths.model_store_uri), "outputs": outputs,
            "layout": Layout(config.paths.root)}


def checkpoint_predictions(layout: Layout, minute: str, columns: dict) -> np.ndarray:
    from trainer.train import load_checkpoint

    directory = layout.incremental_dir(Interval.minute(minute))
    state = load_feature_state(directory / "feature_state")
    model = load_checkpoint(directory / "checkpoint")
    dense = np.array([columns[name] for name in DENSE_FEATURES], dtype=np.float32).T
    rows = [categorical_rows(pa.array(columns[name], pa.string()), *state.lookup(name))
            for name in CATEGORICAL_FEATURES]
    inputs = {"dense": transform_dense(dense, state).astype(np.float32), "categorical": np.stack(rows, axis=1)}
    return np.asarray(model(inputs, training=False)).reshape(-1)


def raw_columns(layout: Layout, minute: str) -> dict:
    """The first 300 raw rows of a minute the chain has not trained on, as request columns."""
    from components.synthetic import RAW_FILE
    from components.validation import read_raw_slice

    frame = read_raw_slice(layout.raw_minute_dir(Interval.minute(minute).start) / RAW_FILE).head(300)
    columns = {name: [None if v is None or v != v else float(v) for v in frame[name]] for name in DENSE_FEATURES}
    columns.update({name: [v if isinstance(v, str) else "" for v in frame[name]] for name in CATEGORICAL_FEATURES})
    return columns


def test_each_minute_publishes_a_delta_on_the_previous_version(chain):
    store = chain["store"]
    assert store.versions("ctr") == ["202601010010", "202601010011", "202601010012"]
    first, second = (store.manifest("ctr", v) for v in ("202601010011", "202601010012"))
    assert (first["kind"], first["parent"], first["chain_root"]) == (DELTA_KIND, "202601010010", "202601010010")
    assert (second["parent"], second["chain_root"]) == ("202601010011", "202601010010")
    assert second["data_span"] == {"start": "2026-01-01T00:11:00+00:00", "end": "2026-01-01T00:12:00+00:00"}
    assert second["global_step"] > first["global_step"] > 0
    assert 1500 < second["num_rows"] < 2000  # the minute's 2000 rows less the ~10 % held out
    # Row-sparse training: rows the minute did not touch (here at least the unused room) are not in the delta.
    table = next(path for path in second["rows_changed"] if path.endswith("embeddings"))
    spec = next(s for s in second["weight_specs"] if s["path"] == table)
    assert 0 < second["rows_changed"][table] < spec["shape"][0] - 26 * 10
    assert chain["outputs"]["2026-01-01T00:11"]["publish"]["freshness_s"] > 0


def test_every_version_carries_its_table_report_and_the_cli_prints_it(chain, capsys):
    from mlflow.tracking import MlflowClient

    from components.tracking import RUN_KEY_TAG
    from pipelines.cli import main

    store = chain["store"]
    daily, minute = (store.manifest("ctr", v)["tables"] for v in ("202601010010", "202601010012"))
    assert (daily["kind"], daily["version"], daily["parent"]) == ("daily", "202601010010", None)
    assert (minute["kind"], minute["version"], minute["parent"]) == ("minute", "202601010012", "202601010011")
    state = load_feature_state(chain["layout"].feature_state_dir(DAY))
    assert [t["name"] for t in daily["tables"]] == list(state.vocabularies)  # in the spec's order
    for table in daily["tables"]:
        vocabulary = state.vocabularies[table["name"]]
        assert (table["rows"], table["rows_in_use"]) == (state.table_size(table["name"]), len(vocabulary))
        assert sum(table["age_days"]["rows"]) == len(vocabulary)
        # A first daily run (no parent): every admitted value was seen in its interval, and the rare row was read
        # by some training row of a table whose admission left values out.
        assert table["rows_touched"] >= len(vocabulary)
        assert table["frequency"]["p50"] >= 5  # features.min_count
    c1 = daily["tables"][0]
    assert 0 < c1["rare_share"] < 1 and c1["missing_share"] is not None
    assert daily["totals"]["waiting_for_admission"] > 0
    # A minute: its touched rows are exactly the embedding rows its delta carries.
    manifest = store.manifest("ctr", "202601010012")
    table = next(path for path in manifest["rows_changed"] if path.endswith("embedding/embeddings"))
    assert 0 < minute["totals"]["rows_touched"] == manifest["rows_changed"][table]
    assert minute["totals"]["rows_evicted"] == 0  # minute runs never evict
    # In MLflow, the report and its plot under "tables" of each run.
    client = MlflowClient(tracking_uri=chain["config"].tracking_uri)
    experiment = client.get_experiment_by_name(chain["config"].tracking.experiment).experiment_id
    for run in client.search_runs([experiment]):
        assert {a.path for a in client.list_artifacts(run.info.run_id, "tables")} == {
            "tables/tables.json", "tables/tables.png"}, run.data.tags[RUN_KEY_TAG]
        assert run.data.metrics["tables.rows_touched"] > 0
    where = ["--set", f"paths.data_root={chain['config'].paths.data_root}"]
    assert main(["tables", "202601010012", *where]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("tables of minute version 202601010012")
    assert [line.split()[0] for line in printed[3:29]] == list(state.vocabularies)
    assert main(["tables", "209901010000", *where]) == 2
    assert "no version '209901010000'" in capsys.readouterr().err


def test_minute_runs_are_tracked_under_their_daily_run(chain):
    from mlflow.tracking import MlflowClient

    from components.tracking import PARENT_RUN_TAG, RUN_KEY_TAG

    client = MlflowClient(tracking_uri=chain["config"].tracking_uri)
    experiment = client.get_experiment_by_name(chain["config"].tracking.experiment).experiment_id
    runs = {r.data.tags[RUN_KEY_TAG]: r for r in client.search_runs([experiment])}
    daily = runs["ctr_daily/test-daily"]
    assert daily.data.tags["model.registered_version"] == "1"  # logged by the run's model logger (serving.pyfunc)
    minutes = [r for key, r in runs.items() if key.startswith("ctr_incremental/")]
    assert len(minutes) == 2
    for run in minutes:
        assert run.data.tags[PARENT_RUN_TAG] == daily.info.run_id
        assert run.data.tags["ctr.daily_run"] == "ctr_daily/test-daily"
        assert {"publish.freshness_s", "delta.bytes", "gate.passed", "incremental.minutes"} <= set(run.data.metrics)


def test_serving_the_chain_answers_like_the_trainers_last_checkpoint(chain, tmp_path):
    columns = raw_columns(chain["layout"], "2026-01-01T00:15")
    watcher = ModelWatcher(chain["store"], "ctr", tmp_path / "cache", poll_seconds=60)
    assert watcher.poll_once()
    assert watcher.version == "202601010012" and watcher.current().parent == "202601010011"
    expected = checkpoint_predictions(chain["layout"], "2026-01-01T00:11", columns)
    np.testing.assert_allclose(watcher.current().predict_columns(columns), expected, rtol=0, atol=1e-6)


def test_rerunning_a_published_minute_has_nothing_to_learn(chain):
    with pytest.raises(NothingToLearn, match="already holds data up to 2026-01-01T00:12:00"):
        run_minute(chain["config"], "2026-01-01T00:11")


def test_a_failing_gate_publishes_nothing_and_the_next_minute_catches_up_in_order(chain, tmp_path):
    store = chain["store"]
    with pytest.raises(DeltaGateError, match=r"holdout logloss .* more than -1.0"):
        run_minute(chain["config"], "2026-01-01T00:12", **{"incremental.max_logloss_increase": -1.0})
    assert store.latest("ctr") == "202601010012"
    gate = json.loads((chain["layout"].incremental_dir(Interval.minute("2026-01-01T00:12")) / "gate.json").read_text())
    assert gate["passed"] is False
    outputs = run_minute(chain["config"], "2026-01-01T00:13")
    assert outputs["validate"]["minutes"] == ["2026-01-01T00:12:00+00:00", "2026-01-01T00:13:00+00:00"]
    manifest = store.manifest("ctr", "202601010014")
    assert manifest["parent"] == "202601010012"
    assert manifest["data_span"] == {"start": "2026-01-01T00:12:00+00:00", "end": "2026-01-01T00:14:00+00:00"}
    # Rollback: serving and the next minute go back to 202601010012.
    watcher = ModelWatcher(store, "ctr", tmp_path / "cache", poll_seconds=60)
    watcher.poll_once()
    assert watcher.version == "202601010014"
    assert rollback(store, "ctr", "202601010012", "test") == ["202601010014"]
    assert watcher.poll_once() and watcher.version == "202601010012"
    outputs = run_minute(chain["config"], "2026-01-01T00:14", **{"incremental.catch_up": "latest_only",
                                                                 "incremental.max_logloss_increase": 1.0})
    assert outputs["validate"]["minutes"] == ["2026-01-01T00:14:00+00:00"]
    assert store.manifest("ctr", "202601010015")["skipped_minutes"] == ["2026-01-01T00:12:00+00:00",
                                                                        "2026-01-01T00:13:00+00:00"]
    assert store.manifest("ctr", "202601010015")["parent"] == "202601010012"


def test_a_minute_without_its_completion_marker_is_never_learned(chain):
    from components.synthetic import SUCCESS_MARKER, write_minute

    config, layout, store = chain["config"], chain["layout"], chain["store"]
    unfinished = Interval.minute("2026-01-01T00:15").start
    (layout.raw_minute_dir(unfinished) / SUCCESS_MARKER).unlink()  # its writer never finished
    with pytest.raises(RuntimeError, match="no completion marker"):
        run_minute(config, "2026-01-01T00:15")
    next_minute = Interval.minute("2026-01-01T00:16").start
    write_minute(config.generate, layout, 16, next_minute)
    outputs = run_minute(config, "2026-01-01T00:16")
    assert outputs["validate"]["minutes"] == ["2026-01-01T00:16:00+00:00"]
    manifest = store.manifest("ctr", "202601010017")
    assert manifest["incomplete_minutes"] == ["2026-01-01T00:15:00+00:00"]
    assert manifest["minutes"] == ["2026-01-01T00:16:00+00:00"]


def test_a_damaged_checkpoint_is_detected_and_the_chain_goes_on_from_its_parent(chain):
    from components.synthetic import write_minute

    config, layout, store = chain["config"], chain["layout"], chain["store"]
    damaged = store.manifest("ctr", "202601010017")
    model_file = Path(damaged["training_state"]["checkpoint"]) / "model.keras"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    write_minute(config.generate, layout, 17, Interval.minute("2026-01-01T00:17").start)
    outputs = run_minute(config, "2026-01-01T00:17")
    # The damaged version is retracted (serving moves back too) and its minute learned again, once, on its parent.
    assert "202601010017" in store.retracted("ctr")
    assert outputs["validate"]["minutes"] == ["2026-01-01T00:16:00+00:00", "2026-01-01T00:17:00+00:00"]
    manifest = store.manifest("ctr", "202601010018")
    assert manifest["parent"] == "202601010015" and store.latest("ctr") == "202601010018"


def test_the_step_worker_runs_a_minute_for_airflow_tasks_and_keeps_their_outcomes(chain, caplog):
    """Airflow's tasks hand their steps to a warm step worker: outputs come back, the step's log lines are
    printed by the task, domain errors keep their type, other errors come with the worker's traceback, and with
    the worker gone (or refusing a task without its secret) the task runs the step itself."""
    import threading
    import time

    from components.synthetic import write_minute
    from pipelines import step_client, step_worker
    from pipelines.runner import run_airflow_step

    config, layout, store = chain["config"], chain["layout"], chain["store"]
    secret = "step-worker-secret-of-the-tests"
    task_environ = {"CTR_HOME": str(layout.root), "CTR_STEP_WORKER_SECRET": secret}
    stop = threading.Event()
    up = threading.Event()
    worker = threading.Thread(target=step_worker.serve, args=(config,), kwargs={"ready": lambda _: up.set(),
                                                                                "stop": stop,
                                                                                "secret": secret.encode()},
                              daemon=True)
    worker.start()
    assert up.wait(120), "the step worker did not come up"
    address = step_client.worker_address(config.paths.root)
    assert address is not None and address[0] == "127.0.0.1"

    minute = Interval.minute("2026-01-01T00:18")
    write_minute(config.generate, layout, 18, minute.start)
    request = {"pipeline": "incremental", "run_id": "worker-0018", "start": minute.start.isoformat(),
               "end": minute.end.isoformat(), "overrides": {"paths.data_root": str(layout.root), **OVERRIDES},
               "environ": {}}
    lines: list[str] = []
    outputs = {step.name: step_client.run_on_worker(layout.root, {**request, "step": step.name},
                                                    lambda level, text: lines.append(text), secret.encode())
               for step in select_steps("incremental", None) if not step.sensor}
    assert outputs["publish"]["version"] == "202601010019" and store.latest("ctr") == "202601010019"
    assert store.manifest("ctr", "202601010019")["minutes"] == ["2026-01-01T00:18:00+00:00"]
    assert outputs["samples"]["train"] + outputs["samples"]["holdout"] == 2000
    assert any("step train done in" in line for line in lines)

    # An Airflow task (run_airflow_step) for a minute the model already holds: the worker's NothingToLearn is
    # raised as itself in the task, after the step's log lines (which come back under ctr.step_worker).
    context = {"data_interval_start": minute.start, "data_interval_end": minute.end, "run_id": "worker-again",
               "params": {}}
    caplog.set_level("INFO")
    with pytest.raises(NothingToLearn, match="already holds data up to 2026-01-01T00:19:00"):
        run_airflow_step("incremental", "plan", context, environ=task_environ)
    assert any(r.name == "ctr.step_worker" and "step plan started" in r.getMessage() for r in caplog.records)

    with pytest.raises(step_client.StepWorkerError, match=r"(?s)ValueError: .*on the step worker at .*Traceback"):
        step_client.run_on_worker(layout.root, {**request, "pipeline": "daily", "step": "train"}, lambda *_: None,
                                  secret.encode())

    # Steps ahead of their tasks (pipelines/run_ahead.py): the sensor's yes starts the minute in the worker, which
    # publishes it before any task asks; each task then gets its step's lines and outcome from that run, once.
    minute = Interval.minute("2026-01-01T00:19")
    write_minute(config.generate, layout, 19, minute.start)
    ahead = {**request, "run_id": "worker-0019", "start": minute.start.isoformat(), "end": minute.end.isoformat(),
             "run_ahead": True}
    step_client.notify_done(layout.root, {**ahead, "step": "wait_for_data"}, secret.encode())
    deadline = time.monotonic() + 300
    while store.latest("ctr") != "202601010020" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.latest("ctr") == "202601010020", "the minute's steps did not run ahead of their tasks"
    lines.clear()
    taken = {step.name: step_client.run_on_worker(layout.root, {**ahead, "step": step.name},
                                                  lambda level, text: lines.append(text), secret.encode())
             for step in select_steps("incremental", None) if not step.sensor}
    assert taken["publish"]["version"] == "202601010020" and taken["publish"]["uri"]
    assert taken["samples"]["train"] + taken["samples"]["holdout"] == 2000
    assert [line.split(" of ")[0].split(": ")[-1] for line in lines if "started ahead of its task" in line] == [
        "incremental/plan", "incremental/validate", "incremental/samples", "incremental/train",
        "incremental/export_delta", "incremental/gate", "incremental/publish", "incremental/spans"]
    # A retry of a task (or one cleared after the run) runs its step again, and nothing after it runs ahead.
    lines.clear()
    assert step_client.run_on_worker(layout.root, {**ahead, "step": "gate"},
                                     lambda level, text: lines.append(text), secret.encode()) == taken["gate"]
    assert any("incremental/gate of worker-0019: started" in line for line in lines)
    assert not any("ahead" in line for line in lines)
    # An Airflow sensor task's yes is what starts a run ahead: here the minute is learned already, so the plan
    # that ran ahead ends in NothingToLearn, which the plan task raises as itself.
    context = {**context, "run_id": "worker-again-ahead"}
    caplog.clear()
    assert run_airflow_step("incremental", "wait_for_data", context, environ=task_environ) is True
    with pytest.raises(NothingToLearn):
        run_airflow_step("incremental", "plan", context, environ=task_environ)
    assert any("incremental/plan of worker-again-ahead: started ahead of its task" in r.getMessage()
               for r in caplog.records)
    # A task without the worker's secret is refused before it connects, and runs its step itself.
    caplog.clear()
    with pytest.raises(NothingToLearn):
        run_airflow_step("incremental", "plan", {**context, "run_id": "no-secret"},
                         environ={"CTR_HOME": str(layout.root)})
    assert any("CTR_STEP_WORKER_SECRET is not set in this task's environment" in r.getMessage()
               and "the step runs in this task's process" in r.getMessage() for r in caplog.records)
    assert not any(r.name == "ctr.step_worker" for r in caplog.records)

    stop.set()
    worker.join(30)
    assert not step_client.address_file(layout.root).exists()
    caplog.clear()
    with pytest.raises(NothingToLearn):
        run_airflow_step("incremental", "plan", context, environ=task_environ)
    assert any("the step runs in this task's process" in r.getMessage() for r in caplog.records)
    assert not any(r.name == "ctr.step_worker" for r in caplog.records)


def test_a_minute_trained_from_the_model_kept_in_memory_equals_one_trained_from_its_checkpoint(chain, tmp_path):
    """The chain's second minute trained the model its first minute kept in memory; trained again from the first
    minute's checkpoint on disk, it ends with the same weights and the same holdout logloss."""
    from components.feature_state import load_feature_state
    from pipelines.daily import sample_files
    from pipelines.incremental import read_plan
    from trainer import incremental
    from trainer.train import load_checkpoint

    outputs = chain["outputs"]
    assert outputs["2026-01-01T00:10"]["train"]["parent_from_memory"] is False  # its parent is the daily model
    assert outputs["2026-01-01T00:11"]["train"]["parent_from_memory"] is True
    config, layout = chain["config"], chain["layout"]
    ctx = RunContext(config=config, interval=Interval.minute("2026-01-01T00:11"), pipeline="incremental",
                     run_id="again")
    directory = layout.incremental_dir(ctx.interval)
    plan = read_plan(ctx)
    (train_files, manifest), (holdout_files, _) = (sample_files(directory / "samples" / split, ctx.spec.hash())
                                                   for split in ("train", "holdout"))
    incremental.forget_kept_model()
    again = incremental.train_increment(
        Path(plan.parent_checkpoint), train_files, holdout_files, tmp_path / "checkpoint",
        new_rows=load_feature_state(directory / "feature_state").new_rows, batch_size=config.train.batch_size,
        epochs=config.incremental.epochs, seed=config.train.seed, version=plan.version, layout=manifest["layout"],
        num_rows=manifest["row_counts"]["rows"], spec=ctx.spec)
    assert again["parent_from_memory"] is False
    first = outputs["2026-01-01T00:11"]["train"]
    # Where each run's seconds went, in the order they were spent; loading from disk costs more than memory.
    assert list(again["seconds"]) == list(first["seconds"]) == [
        "load_parent", "reset_rows", "score_parent", "fit", "score_child", "count_holdout", "save_weights",
        "save_checkpoint"]
    assert all(value >= 0 for value in again["seconds"].values()) and again["seconds"]["fit"] > 0
    assert again["seconds"]["load_parent"] > first["seconds"]["load_parent"]
    assert again["holdout_logloss"] == pytest.approx(first["holdout_logloss"], abs=1e-6)
    assert again["global_step"] == first["global_step"]
    kept = load_checkpoint(directory / "checkpoint")
    for expected, actual in zip(kept.weights, load_checkpoint(tmp_path / "checkpoint").weights, strict=True):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=0, atol=1e-5)


def test_a_minute_on_the_jax_backend_publishes_a_delta_served_as_its_checkpoint_predicts(chain, tmp_path):
    """train.backend=jax for ctr_incremental: the minute trains its TensorFlow-trained parent in a child process
    without TensorFlow; the export step's delta, applied by serving, answers as the child's checkpoint does."""
    from datetime import datetime

    from components.synthetic import SUCCESS_MARKER, write_minute

    config, layout, store = chain["config"], chain["layout"], chain["store"]
    parent = store.latest("ctr")
    start = datetime.strptime(parent, "%Y%m%d%H%M")
    minute = start.strftime("%Y-%m-%dT%H:%M")
    if not (layout.raw_minute_dir(Interval.minute(minute).start) / SUCCESS_MARKER).exists():
        write_minute(config.generate, layout, start.hour * 60 + start.minute, Interval.minute(minute).start)
    outputs = run_minute(config, minute, **{"train.backend": "jax"})
    train = outputs["train"]
    assert train["parent_from_memory"] is False and train["seconds"]["process"] >= 0 and train["train_rows"] > 1000
    version = store.latest("ctr")
    manifest = store.manifest("ctr", version)
    assert (manifest["kind"], manifest["parent"]) == (DELTA_KIND, parent)
    table = next(path for path in manifest["rows_changed"] if path.endswith("embeddings"))
    rows = next(s for s in manifest["weight_specs"] if s["path"] == table)["shape"][0]
    assert 0 < manifest["rows_changed"][table] < rows - 26 * 10  # a minute's rows, not the table
    columns = raw_columns(layout, "2026-01-01T00:14")
    watcher = ModelWatcher(store, "ctr", tmp_path / "cache", poll_seconds=60)
    assert watcher.poll_once() and watcher.version == version
    expected = checkpoint_predictions(layout, minute, columns)
    np.testing.assert_allclose(watcher.current().predict_columns(columns), expected, rtol=0, atol=1e-6)
