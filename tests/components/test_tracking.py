from __future__ import annotations

import json
import logging
import re

import pytest

from components.config import load_config
from components.feature_spec import spec_for
from components.tracking import EXPERIMENT_KIND_TAG, RUN_KEY_TAG, Tracker

pytestmark = pytest.mark.integration

RUN_KEY = "ctr_daily/scheduled__2026-01-02T00:00:00+00:00"


def _config(data_root, **overrides):
    return load_config(
        overrides={"paths.data_root": str(data_root), "tracking.strict": True, **overrides}, environ={}
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    # One sqlite backend for the module: creating its schema takes seconds.
    return tmp_path_factory.mktemp("tracking")


@pytest.fixture(scope="module")
def client(data_root):
    from mlflow.tracking import MlflowClient

    config = _config(data_root)
    Tracker(config, "warm-up", "warm-up", {}).start()  # creates the database and the experiment
    return MlflowClient(tracking_uri=config.tracking_uri)


def test_the_tracking_uri_defaults_to_sqlite_under_the_data_root(data_root, client):
    config = _config(data_root)
    assert config.tracking_uri == f"sqlite:///{data_root / 'mlflow' / 'mlflow.db'}"
    assert (data_root / "mlflow" / "mlflow.db").is_file()
    experiment = client.get_experiment_by_name("ctr")
    assert experiment.artifact_location == (data_root / "mlflow" / "artifacts").as_uri()


def test_the_experiment_opens_on_model_training_not_genai(data_root, client):
    """MLflow 3's UI opens an experiment without a kind on its GenAI overview; ours is marked as model
    training, and one made before (without the tag) gets it on the next start."""
    assert client.get_experiment_by_name("ctr").tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    older = client.create_experiment("made-by-an-earlier-version")
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(older).tags
    Tracker(_config(data_root, **{"tracking.experiment": "made-by-an-earlier-version"}), "k", "k", {}).start()
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_start_twice_with_the_same_run_key_returns_the_same_run(data_root, client):
    config = _config(data_root)
    first = Tracker(config, RUN_KEY, "daily 2026-01-02", {"dag_id": "ctr_daily"})
    run_id = first.start()
    first.end()
    # Another task process of the same pipeline run.
    second = Tracker(config, RUN_KEY, "daily 2026-01-02", {"dag_id": "ctr_daily"})
    assert second.start() == run_id
    assert client.get_run(run_id).info.status == "RUNNING"  # reopened
    other = Tracker(config, RUN_KEY + "-other", "daily", {})
    assert other.start() != run_id

    run = client.get_run(run_id)
    assert run.data.tags[RUN_KEY_TAG] == RUN_KEY
    assert run.data.tags["dag_id"] == "ctr_daily"
    assert run.info.run_name == "daily 2026-01-02"
    experiment = client.get_experiment_by_name("ctr")
    keyed = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{RUN_KEY}'"
    )
    assert [r.info.run_id for r in keyed] == [run_id]


def test_params_metrics_tags_and_artifacts_land(data_root, client, tmp_path):
    config = _config(data_root)
    tracker = Tracker(config, "artifacts-run", "artifacts", {})
    run_id = tracker.start()
    tracker.log_params(config.flat())
    tracker.log_params({"train.epochs": "99", "extra": 5})  # a logged param keeps its first value
    tracker.log_metrics(
        {"auc": 0.75, "logloss": 0.5, "skipped_nan": float("nan"), "skipped_none": None}, step=3
    )
    tracker.log_metrics({"auc": 0.8}, step=4)
    tracker.set_tags({"model_version": 202601020000})
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"num_rows": 400}))
    tracker.log_artifact(report, "validation")
    folder = tmp_path / "evaluation"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    (folder / "b.txt").write_text("b")
    tracker.log_artifact(folder, "evaluation")
    tracker.log_dict({"auc": 0.8}, "metrics/summary.json")
    tracker.end()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(run.data.params) == len(config.flat()) + 1
    assert run.data.params["train.epochs"] == "20"
    assert run.data.params["train.mlp_units"] == "512,256,128"
    assert run.data.params["extra"] == "5"
    assert run.data.metrics == {"auc": 0.8, "logloss": 0.5}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "auc")] == [(3, 0.75), (4, 0.8)]
    assert run.data.tags["model_version"] == "202601020000"

    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["evaluation", "metrics", "validation"]
    assert sorted(a.path for a in client.list_artifacts(run_id, "evaluation")) == [
        "evaluation/a.txt",
        "evaluation/b.txt",
    ]
    downloaded = client.download_artifacts(run_id, "validation/report.json", str(tmp_path / "down"))
    assert json.loads(open(downloaded).read()) == {"num_rows": 400}
    summary = client.download_artifacts(run_id, "metrics/summary.json", str(tmp_path / "down"))
    assert json.loads(open(summary).read()) == {"auc": 0.8}


def test_the_run_config_logs_the_feature_spec_it_names(data_root, client, tmp_path):
    config = _config(data_root).with_overrides({"features.spec": "taobao", "features.min_count": "3"})
    tracker = Tracker(config, "spec-run", "spec", {})
    run_id = tracker.start()
    tracker.log_run_config(config)
    run = client.get_run(run_id)
    assert run.data.params["features.spec"] == "taobao"
    assert run.data.params["features.spec_name"] == "taobao"
    assert run.data.params["features.spec_hash"] == spec_for(config).hash()
    logged = json.loads(open(client.download_artifacts(run_id, "feature_spec.json", str(tmp_path))).read())
    assert logged["hash"] == spec_for(config).hash()
    assert logged["label"] == {"column": "clk"}
    assert logged["tables"]["userid"]["min_count"] == 3
    assert logged["tables"]["adgroup_id"]["features"] == ["adgroup_id", "click_sequence"]


def _unwritable_sqlite(tmp_path) -> str:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the database's directory should be")
    return f"sqlite:///{blocker / 'mlflow.db'}"


BROKEN_URIS = {
    "unwritable-sqlite": (_unwritable_sqlite, OSError, "not-a-directory"),
    "unknown-scheme": (lambda tmp_path: "bogus://nowhere", Exception, "unsupported URI 'bogus://nowhere'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_URIS))
def test_a_tracking_outage_is_logged_not_fatal_when_not_strict(tmp_path, caplog, case):
    make_uri, _, message = BROKEN_URIS[case]
    config = _config(tmp_path, **{"tracking.strict": False, "tracking.tracking_uri": make_uri(tmp_path)})
    tracker = Tracker(config, RUN_KEY, "daily", {})
    with caplog.at_level(logging.WARNING, logger="components.tracking"):
        assert tracker.start() is None
    assert tracker.run_id is None
    assert "MLflow start failed (tracking is a side channel, the pipeline goes on)" in caplog.text
    assert message in caplog.text
    # Every later call is a no-op rather than an error.
    tracker.log_params({"a": 1})
    tracker.log_metrics({"auc": 0.7})
    tracker.set_tags({"a": "b"})
    tracker.log_artifact(tmp_path)
    tracker.end()


@pytest.mark.parametrize("case", sorted(BROKEN_URIS))
def test_a_tracking_outage_raises_when_strict(tmp_path, case):
    make_uri, error, message = BROKEN_URIS[case]
    config = _config(tmp_path, **{"tracking.tracking_uri": make_uri(tmp_path)})
    with pytest.raises(error, match=re.escape(message)):
        Tracker(config, RUN_KEY, "daily", {}).start()


def test_a_written_dataset_is_a_run_input_with_its_manifests_digest_and_span(data_root, client, tmp_path):
    import hashlib

    tracker = Tracker(_config(data_root), "dataset-run", "dataset", {})
    run_id = tracker.start()
    manifest = tmp_path / "samples" / "train" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"kind": "samples", "files": {"part-0.tfrecord": {"sha256": "ab"}}}')
    tracker.log_dataset("samples_train", manifest, "training",
                        {"start": "2026-01-01T00:00:00+00:00", "end": "2026-01-01T00:20:00+00:00", "minutes": 20},
                        {"rows": 40000, "shards": 2})
    (logged,) = client.get_run(run_id).inputs.dataset_inputs
    sha256 = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert (logged.dataset.name, logged.dataset.digest) == ("samples_train", sha256[:36])
    assert json.loads(logged.dataset.source) == {"uri": manifest.parent.as_uri(), "minutes": 20,
                                                 "start": "2026-01-01T00:00:00+00:00",
                                                 "end": "2026-01-01T00:20:00+00:00"}
    assert json.loads(logged.dataset.profile) == {"rows": 40000, "shards": 2, "manifest_sha256": sha256}
    assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", "training")]


def test_experiments_made_through_a_tracking_server_keep_the_servers_artifact_location(tmp_path):
    local = Tracker(_config(tmp_path), "k", "n", {})
    remote = Tracker(_config(tmp_path, **{"tracking.tracking_uri": "http://127.0.0.1:5000"}), "k", "n", {})
    assert local._artifact_root == (tmp_path / "mlflow" / "artifacts").as_uri()
    assert remote._artifact_root is None  # the server's own (the stack's proxies artifacts to S3)


def test_a_model_is_logged_by_the_trackers_model_logger_and_registered(data_root, client, tmp_path):
    """components never imports serving: the served model's pyfunc comes in as the tracker's model logger."""
    from types import SimpleNamespace

    from components.registry import STORE_VERSION_TAG

    exported = tmp_path / "202601020000"
    exported.mkdir()
    (exported / "manifest.json").write_text("{}")
    calls = []

    def model_logger(run_id, tracking_uri, directory, example_rows):
        calls.append((run_id, tracking_uri, directory, example_rows))
        client.log_artifacts(run_id, str(directory), "model")
        return SimpleNamespace(model_uri=f"runs:/{run_id}/model", model_id=None)

    config = _config(data_root)
    tracker = Tracker(config, "model-run", "model", {}, model_logger=model_logger)
    run_id = tracker.start()
    tracker.log_model(exported, "202601020000", "file:///store/ctr/202601020000", [{"I1": 1}])
    assert calls == [(run_id, config.tracking_uri, exported, [{"I1": 1}])]
    registered = client.get_run(run_id).data.tags["model.registered_version"]
    assert client.get_model_version("ctr", registered).tags[STORE_VERSION_TAG] == "202601020000"

    without = Tracker(config, "model-run", "model", {})
    without.start()
    with pytest.raises(ValueError, match="this tracker was made without a model logger, so it cannot log "):
        without.log_model(exported, "202601020000", "file:///store/ctr/202601020000", [])
