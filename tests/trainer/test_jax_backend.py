"""The model code runs on the JAX backend too (GPU hosts whose images carry JAX but not TensorFlow).

Skipped only where JAX is not installed: requirements.lock pins it, so `make test` runs them."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed"),
]


# A DCNv2 on the criteo columns and 256 rows whose categorical values read rows 2 and 3 only; `body` trains it
# and prints what the test reads.
SETUP = """
import keras
import numpy as np

from components.config import TrainConfig
from components.schema import CATEGORICAL_FEATURES
from trainer.models import build_model
from trainer.train import compile_model

assert keras.backend.backend() == "jax"
config = TrainConfig(mlp_units=(16, 8), jit_compile=True, {settings})
model = build_model(config, {{name: 10 for name in CATEGORICAL_FEATURES}})
compile_model(model, config)
rng = np.random.default_rng(0)
features = {{
    "dense": rng.standard_normal((256, 26)).astype("float32"),
    "categorical": rng.integers(2, 4, (256, 26)).astype("int32"),  # rows 2 and 3 only
}}
"""


def run_on_jax(settings: str, body: str) -> list[str]:
    """What the script prints, run in a child process with KERAS_BACKEND=jax."""
    script = SETUP.format(settings=settings) + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_dcnv2_trains_with_row_sparse_effect_on_jax():
    printed = run_on_jax("micro_batches=2", """
        before = keras.ops.convert_to_numpy(model.embedding.embeddings)
        history = model.fit(features, rng.integers(0, 2, 256).astype("float32"), batch_size=64, verbose=0)
        after = keras.ops.convert_to_numpy(model.embedding.embeddings)
        print(int((after != before).any(axis=1).sum()), int(history.history["num_examples"][0]))
        """)
    assert printed == ["52", "256"]  # 2 rows x 26 features moved; all 256 examples seen


def test_rare_row_rate_trains_the_rare_rows_under_jit_on_jax():
    """The draws come from a Keras SeedGenerator, whose state JAX's jitted train step carries as a variable."""
    printed = run_on_jax("rare_row_rate=0.2", """
        rare = model.embedding.offsets
        before = keras.ops.convert_to_numpy(model.embedding.embeddings)[rare]
        model.fit(features, rng.integers(0, 2, 256).astype("float32"), batch_size=64, verbose=0)
        after = keras.ops.convert_to_numpy(model.embedding.embeddings)[rare]
        print(int((after != before).any(axis=1).sum()))
        """)
    assert printed == ["26"]  # the rare row of every table moved


def test_din_history_aux_loss_on_jax():
    """The co-occurrence loss computes the same value on JAX, and DIN's jitted train step adds it to the loss."""
    script = textwrap.dedent("""
        import keras
        import numpy as np

        from components.config import TrainConfig
        from components.schema import CATEGORICAL_FEATURES
        from trainer.models import build_model
        from trainer.models.din import co_occurrence_loss
        from trainer.train import compile_model

        assert keras.backend.backend() == "jax"
        rng = np.random.default_rng(3)
        behaviours = rng.normal(size=(5, 4, 3)).astype(np.float32)
        valid = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=bool)
        print(float(co_occurrence_loss(behaviours, valid)))
        rows = rng.integers(2, 12, (256, 26)).astype("int32")
        features = {"dense": rng.standard_normal((256, 26)).astype("float32"), "categorical": rows,
                    "history": rng.integers(2, 12, (256, 5)).astype("int32")}
        labels = rng.integers(0, 2, 256).astype("float32")
        for weight in (0.0, 1.0):
            config = TrainConfig(model="din", mlp_units=(16, 8), attention_units=(8,), sequence_length=5,
                                 jit_compile=True, history_aux_weight=weight)
            keras.utils.set_random_seed(0)
            model = build_model(config, {name: 12 for name in CATEGORICAL_FEATURES})
            compile_model(model, config)
            print(model.fit(features, labels, batch_size=256, epochs=1, verbose=0).history["loss"][0])
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "jax"})
    assert done.returncode == 0, done.stderr[-3000:]
    on_jax, without, with_aux = (float(value) for value in done.stdout.split()[-3:])
    from tests.trainer.test_model_zoo import reference_co_occurrence_loss

    rng = np.random.default_rng(3)
    behaviours = rng.normal(size=(5, 4, 3)).astype(np.float32)
    valid = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=bool)
    assert on_jax == pytest.approx(reference_co_occurrence_loss(behaviours, valid), rel=1e-5)
    # One step from the same weights: the logloss alike, plus about log 4 (two logistic terms at zero
    # logits: the vectors start small) with the auxiliary loss.
    assert with_aux - without == pytest.approx(2 * np.log(2), abs=0.1)
