"""The served model as an MLflow model: a pyfunc over the same `LoadedModel` serving answers with.

Each daily export logs its version with `log_model`: the exported directory (SavedModel and manifest) as the
artifact, a signature read from the SavedModel's own `serving_default` inputs (one column per raw feature;
lists for multi-valued and sequence features) and an input example of raw rows, so the MLflow UI shows the
model's inputs, `mlflow.pyfunc.load_model(...).predict(dataframe)` scores rows exactly as the prediction API
does, and the registry's versions point at a model MLflow can load.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

ARTIFACT = "model"  # the key of the exported directory among the pyfunc's artifacts
OUTPUT = "probability"
REQUIREMENTS = ("mlflow", "tensorflow", "keras", "numpy", "pandas")
CODE = ("serving", "components")  # the packages the loader imports, shipped with the model


class CtrModel(mlflow.pyfunc.PythonModel):
    """Scores a DataFrame of raw feature rows (missing values as None or NaN) with the exported version."""

    def load_context(self, context: Any) -> None:
        from serving.model import LoadedModel

        self._model = LoadedModel.load(context.artifacts[ARTIFACT])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
                ) -> pd.DataFrame:
        rows = [{name: _plain(value) for name, value in row.items()} for row in model_input.to_dict("records")]
        return pd.DataFrame({OUTPUT: self._model.predict(rows)})


def _plain(value: Any) -> Any:
    """NaN (pandas' missing) as None; numpy scalars and arrays as Python values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and value != value:
        return None
    return value


def signature(model: Any) -> Any:
    """An MLflow signature from the model's input specs: double for numbers, string for ids, an array of
    strings for list features, the timestamp as long (epoch formats) or string (strptime formats); every input
    optional (serving treats a missing one as
    missing); one double output."""
    import tensorflow as tf
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, Schema

    declared = {entry.get("name"): entry for entry in model.manifest.get("feature_spec", {}).get("features", [])}
    columns = []
    for name, spec in model.input_specs.items():
        if spec.dtype == tf.string and spec.shape.rank == 2:
            kind: Any = Array(DataType.string)
        elif spec.dtype == tf.string:
            kind = DataType.string
        elif spec.dtype == tf.int64:  # the timestamp, as the spec's raw format writes it
            numeric = declared.get(name, {}).get("format", "unix_seconds") in ("unix_seconds", "unix_millis")
            kind = DataType.long if numeric else DataType.string
        else:
            kind = DataType.double
        columns.append(ColSpec(kind, name, required=False))
    return ModelSignature(inputs=Schema(columns), outputs=Schema([ColSpec(DataType.double, OUTPUT)]))


def log_model(run_id: str, tracking_uri: str, directory: Path, example_rows: list[dict[str, Any]]) -> Any:
    """Logs `directory` (an exported version) to the run as the pyfunc model `model`; returns MLflow's
    ModelInfo (its `model_uri` is what the registry registers)."""
    import mlflow

    from serving.model import LoadedModel

    loaded = LoadedModel.load(directory, verify=False)
    example = pd.DataFrame([{name: row.get(name) for name in loaded.input_specs} for row in example_rows]) \
        if example_rows else None
    root = Path(__file__).resolve().parent.parent
    from components.mlflow_settings import using_tracking_uri

    with using_tracking_uri(tracking_uri), mlflow.start_run(run_id=run_id):
        return _log(root, directory, loaded, example)


def _log(root: Path, directory: Path, loaded: Any, example: pd.DataFrame | None) -> Any:
    return mlflow.pyfunc.log_model(
        name="model", python_model=CtrModel(), artifacts={ARTIFACT: str(directory)},
        signature=signature(loaded), input_example=example,
        code_paths=[str(root / package) for package in CODE],
        pip_requirements=[f"{package}=={importlib.metadata.version(package)}" for package in REQUIREMENTS],
    )
