"""Names and shapes of the model inputs, shared by the input pipeline, the models and the export."""

from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL

DENSE_INPUT = "dense"  # float32 [batch, DENSE_INPUT_DIM]: standardized dense values, then missing indicators
CATEGORICAL_INPUT = "categorical"  # int64 [batch, NUM_CATEGORICAL]: per-feature embedding row ids

INPUT_SHAPES: dict[str, tuple[int | None, ...]] = {
    DENSE_INPUT: (None, DENSE_INPUT_DIM),
    CATEGORICAL_INPUT: (None, NUM_CATEGORICAL),
}
