"""components/mlflow_settings.py: the tracking URI for one block, through MLflow's public API, and what the
process had put back after it."""

import mlflow
import pytest

from components.mlflow_settings import using_tracking_uri

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("before", [None, "http://127.0.0.1:5999"], ids=["unset", "set in the environment"])
def test_the_block_sees_its_uri_and_the_process_gets_its_own_back(before, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    if before is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", before)
    mlflow.set_tracking_uri(None)
    outside = mlflow.get_tracking_uri()
    inside = f"sqlite:///{tmp_path}/block.db"
    with using_tracking_uri(inside):
        assert mlflow.get_tracking_uri() == inside
        import os

        assert os.environ["MLFLOW_TRACKING_URI"] == inside  # what a subprocess of the block inherits
    assert mlflow.get_tracking_uri() == outside
    import os

    assert os.environ.get("MLFLOW_TRACKING_URI") == before
    with pytest.raises(RuntimeError), using_tracking_uri(inside):
        raise RuntimeError("a failure inside the block")
    assert mlflow.get_tracking_uri() == outside
