"""The exported model as an MLflow pyfunc: logged with a signature and an input example, loaded back by MLflow
and scoring a DataFrame exactly as serving scores the same rows."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from serving.model import LoadedModel
from tests.serving.fixture_model import OLD_VERSION, WEIGHTS

pytestmark = pytest.mark.integration


def test_logged_model_has_signature_and_example_and_scores_like_serving(exported, tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    from serving.pyfunc import log_model

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("ctr", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    rows = [{"I1": 2.0, "I2": None, "C1": "abc"}, {"I1": None, "C1": None}, {"I3": 1.5, "C1": "zzz"}]
    info = log_model(run_id, uri, exported[OLD_VERSION], rows)

    assert info.model_uri.startswith("models:/")
    inputs = {spec["name"]: spec for spec in info.signature.inputs.to_dict()}
    assert len(inputs) == 39 and inputs["I1"]["type"] == "double" and inputs["C1"]["type"] == "string"
    assert all(spec["required"] is False for spec in inputs.values())
    assert info.signature.outputs.to_dict() == [{"type": "double", "name": "probability", "required": True}]
    import os

    assert "MLFLOW_TRACKING_URI" not in os.environ  # the caller's environment is left as it was
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    example = pd.DataFrame(mlflow.models.Model.load(info.model_uri).load_input_example(
        mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path / "model"))))
    assert list(example["C1"]) == ["abc", None, "zzz"]

    loaded = mlflow.pyfunc.load_model(info.model_uri)
    scored = loaded.predict(pd.DataFrame(rows))
    expected = LoadedModel.load(exported[OLD_VERSION]).predict(rows)
    assert list(scored.columns) == ["probability"]
    assert scored["probability"].tolist() == pytest.approx(expected.tolist())
    dense_weight, c1_weight = WEIGHTS[OLD_VERSION]
    assert scored["probability"][0] == pytest.approx(1 / (1 + math.exp(-(dense_weight * 2.0 + c1_weight))))
