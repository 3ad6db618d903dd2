"""`ctr promote` and `ctr rollback` on a local model store: what they print, their exit codes, the labels."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.manifest import write_manifest
from components.model_store import LocalModelStore
from pipelines.cli import main

pytestmark = pytest.mark.unit


def publish(store: LocalModelStore, tmp_path: Path, version: str) -> None:
    source = tmp_path / "exported" / version
    source.mkdir(parents=True)
    (source / "weights").write_bytes(version.encode())
    write_manifest(source, kind="full_model", version=version, files=["weights"])
    store.publish("ctr", version, source)


def test_promote_labels_a_version_stable_and_refuses_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = LocalModelStore(tmp_path / "store")
    for version in ("100", "101"):
        publish(store, tmp_path, version)
    where = ["--set", f"paths.model_store={store.root}", "--set", f"paths.data_root={tmp_path}"]

    promoted = main(["promote", "100", *where])
    printed = capsys.readouterr().out
    missing = main(["promote", "7", *where])
    refused = capsys.readouterr().err
    rolled = main(["rollback", "100", *where])
    newest = main(["promote", *where])

    assert (promoted, missing, rolled, newest) == (0, 1, 0, 0)
    assert printed.startswith("promoted version 100; labels now {'stable': '100', 'canary': '101'}")
    assert refused.startswith("ctr-pipeline: model store: cannot promote version 7 of 'ctr': it is not in ")
    assert store.labels("ctr") == {"stable": "100"}


def test_the_mlflow_champion_alias_follows_promote_and_rollback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    from components.config import PipelineConfig
    from components.registry import CHALLENGER, CHAMPION, REGISTERED_MODEL, register

    store = LocalModelStore(tmp_path / "store")
    where = ["--set", f"paths.model_store={store.root}", "--set", f"paths.data_root={tmp_path}",
             "--set", "tracking.strict=true"]
    config = PipelineConfig().with_overrides({"paths.data_root": str(tmp_path), "tracking.strict": True})
    client = MlflowClient(tracking_uri=config.tracking_uri)
    (tmp_path / "mlflow").mkdir(exist_ok=True)
    experiment = client.create_experiment("ctr", artifact_location=(tmp_path / "artifacts").as_uri())
    registered = {}
    for version in ("100", "101"):  # two daily models, each registered from its run's model artifact
        publish(store, tmp_path, version)
        run = client.create_run(experiment).info.run_id
        client.log_artifacts(run, str(tmp_path / "exported" / version), "model")
        registered[version] = register(config, run, version, f"{store.uri}/ctr/{version}")
    publish(store, tmp_path, "102")  # a minute delta: published, not registered

    def champion() -> str | None:
        aliases = client.get_registered_model(REGISTERED_MODEL).aliases
        return None if aliases.get(CHAMPION) is None else str(aliases[CHAMPION])

    challenger = str(client.get_registered_model(REGISTERED_MODEL).aliases[CHALLENGER])
    before = champion()
    main(["promote", "100", *where])
    first = (champion(), capsys.readouterr().out)
    main(["promote", "101", *where])
    second = champion()
    main(["promote", "102", *where])
    unregistered = (champion(), capsys.readouterr().out)
    main(["rollback", "100", *where])
    rolled = champion()

    assert registered == {"100": "1", "101": "2"}
    assert (challenger, before) == ("2", None)
    assert first[0] == "1"
    assert "MLflow: ctr version 1 (store version 100) is now 'champion'" in first[1]
    assert second == "2"
    assert unregistered[0] == "2"
    assert "store version 102 is not registered in MLflow (minute deltas are not)" in unregistered[1]
    # 101 and 102 are retracted: the stable label falls back to 100, and champion with it
    assert (store.stable("ctr"), rolled) == ("100", "1")
    source = client.get_model_version(REGISTERED_MODEL, "1")
    assert source.tags == {"ctr.store_version": "100", "ctr.store_uri": f"{store.uri}/ctr/100"}
