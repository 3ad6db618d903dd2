"""LoadedModel: loading a version directory, and turning JSON values into the signature's input tensors."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from components.manifest import write_manifest
from serving.model import InvalidInput, LoadedModel, ModelLoadError
from tests.serving.fixture_model import OLD_VERSION, corrupt

pytestmark = pytest.mark.unit

# Hand-computed with the old version's weights: sigmoid(0.1 * dense sum + 0.5 * (C1 == "abc")).
INSTANCES = [
    {"I1": 2, "I2": 3.5, "I3": None, "C1": "abc", "C2": "x"},  # sigmoid(1.05)
    {},  # everything missing: sigmoid(0)
    {"I13": -10, "C1": "abd", "C26": None},  # sigmoid(-1.0)
    {"I5": 4.0, "I6": math.nan},  # NaN is missing too: sigmoid(0.4)
]
EXPECTED = [0.7407749, 0.5, 0.2689414, 0.5986877]


def test_predict_instances_with_missing_values(old_model: LoadedModel) -> None:
    predictions = old_model.predict(INSTANCES)

    assert predictions.dtype == np.float32
    np.testing.assert_allclose(predictions, EXPECTED, rtol=1e-6)


def test_predict_columns_with_missing_values_and_absent_features(old_model: LoadedModel) -> None:
    predictions = old_model.predict_columns({"I1": [2, None, 1], "C1": ["abc", "", None]})

    # sigmoid(0.2 + 0.5), sigmoid(0), sigmoid(0.1)
    np.testing.assert_allclose(predictions, [0.6681878, 0.5, 0.5249792], rtol=1e-6)


def test_reads_inputs_version_and_manifest_from_the_directory(exported: dict[str, Path]) -> None:
    model = LoadedModel.load(exported[OLD_VERSION])

    assert model.version == OLD_VERSION
    assert model.manifest["kind"] == "full_model"
    assert model.input_names == [f"C{i}" for i in range(1, 27)] + [f"I{i}" for i in range(1, 14)]
    assert model.input_specs["I7"].dtype == tf.float32
    assert model.input_specs["C7"].dtype == tf.string


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([{"I1": "3"}], r"instance 0: feature 'I1' must be a number or null \(missing\), got '3'"),
        ([{}, {"I2": True}], r"instance 1: feature 'I2' must be a number or null \(missing\), got True"),
        ([{"I3": [1]}], r"instance 0: feature 'I3' must be a number or null \(missing\), got \[1\]"),
        ([{"C1": 7}], r"instance 0: feature 'C1' must be a string or null \(missing\), got 7"),
        ([{"I1": 1e39}], r"instance 0: feature 'I1' is 1e\+39, outside the range of float32"),
        (
            [{"I1": 1, "bogus": 2, "I14": 0}],
            r"instance 0 has unknown features \['I14', 'bogus'\]; "
            r"the model takes \['C1', 'C2', .*'I12', 'I13'\]$",
        ),
        ([[1, 2]], r"instance 0 must be a JSON object of feature values, got \[1, 2\]"),
    ],
)
def test_rejects_bad_instances_naming_index_feature_and_value(
    old_model: LoadedModel, instances: list, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        old_model.predict(instances)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"I1": 3}, r"inputs\['I1'\] must be a list of one value per instance, got 3"),
        (
            {"I1": [1, 2], "C1": ["a"]},
            r"inputs must all hold the same number of values, got lengths \{'I1': 2, 'C1': 1\}",
        ),
        ({"C2": ["a", 5]}, r"inputs\['C2'\]\[1\] must be a string or null \(missing\), got 5"),
        ({"nope": [1]}, r"inputs has unknown features \['nope'\]; the model takes \['C1'"),
    ],
)
def test_rejects_bad_columns(old_model: LoadedModel, inputs: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        old_model.predict_columns(inputs)


def test_refuses_a_version_whose_files_do_not_match_the_manifest(
    exported: dict[str, Path], tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(exported[OLD_VERSION], tmp_path / "copy"))
    corrupt(copy)

    with pytest.raises(
        ModelLoadError, match=r"file 'saved_model/variables/variables.data-.*' does not match"
    ):
        LoadedModel.load(copy)


def test_refuses_a_directory_that_is_not_a_full_model(exported: dict[str, Path], tmp_path: Path) -> None:
    copy = Path(shutil.copytree(exported[OLD_VERSION], tmp_path / "copy"))
    files = [str(p.relative_to(copy)) for p in (copy / "saved_model").rglob("*") if p.is_file()]
    write_manifest(copy, kind="delta", version=OLD_VERSION, files=files)

    with pytest.raises(ModelLoadError, match="describes a 'delta', expected a 'full_model'"):
        LoadedModel.load(copy)


class _MatrixModel(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"probability": tf.reduce_sum(x, axis=1)}


@pytest.mark.parametrize(
    ("signature_name", "message"),
    [
        ("serving_default", r"input 'x' of 'serving_default' .* serving expects 1-D float, string or int64 inputs"),
        ("other", r"has no 'serving_default' signature; it has \['other'\]"),
    ],
)
def test_refuses_a_signature_serving_cannot_feed(tmp_path: Path, signature_name: str, message: str) -> None:
    module = _MatrixModel()
    tf.saved_model.save(
        module,
        str(tmp_path / "saved_model"),
        signatures={signature_name: module.serve.get_concrete_function()},
    )
    files = [str(p.relative_to(tmp_path)) for p in (tmp_path / "saved_model").rglob("*") if p.is_file()]
    write_manifest(tmp_path, kind="full_model", version="1", files=files)

    with pytest.raises(ModelLoadError, match=message):
        LoadedModel.load(tmp_path)
