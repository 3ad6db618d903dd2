"""Names and shapes of the model inputs, shared by the input pipeline, the models and the export."""

from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL

DENSE_INPUT = "dense"  # float32 [batch, DENSE_INPUT_DIM]: standardized dense values, then missing indicators
CATEGORICAL_INPUT = "categorical"  # int64 [batch, NUM_CATEGORICAL]: per-feature embedding row ids
# int64 [batch, sequence_length]: the user's last behaviours as row ids of the item feature's table
# (TrainConfig.sequence_feature), most recent last, front-padded with HISTORY_PADDING when there are fewer
# (the models mask any negative id wherever it sits). Only the sequence models (DIN, DIEN) read it.
# Padding cannot be row 0 or 1: those are the rare and missing rows.
HISTORY_INPUT = "history"
HISTORY_PADDING = -1

INPUT_SHAPES: dict[str, tuple[int | None, ...]] = {
    DENSE_INPUT: (None, DENSE_INPUT_DIM),
    CATEGORICAL_INPUT: (None, NUM_CATEGORICAL),
}


def sequence_input_shapes(sequence_length: int) -> dict[str, tuple[int | None, ...]]:
    """INPUT_SHAPES plus the behaviour sequence."""
    return {**INPUT_SHAPES, HISTORY_INPUT: (None, sequence_length)}
