"""The hot tier of one tiered embedding table: `hot_rows` slots, read by slot id."""

from __future__ import annotations

from typing import Any

import keras

from trainer.arguments import require_integer
from trainer.layers.embedding_rows import take_rows


@keras.saving.register_keras_serializable(package="ctr")
class HotTable(keras.layers.Layer):
    """Looks up slot ids in a table of `hot_rows` slots of `embedding_dim` values: ids [...] -> [..., dim].

    The slots hold whichever rows of a larger table on disk the hot tier (trainer/hot_tier.py) has loaded;
    the ids a batch reads are slot ids, remapped from row ids before the step (trainer/tiered_training.py).
    The variable is named "embeddings", so EmbeddingAdagrad gives it the embedding learning rate and
    row-sparse updates, and it is never cast under mixed precision (only the rows read are), like
    CategoricalEmbedding's table. It starts at zeros: every slot is written by a load before a batch reads it,
    and an initializer that drew random numbers would shift the draws of the layers built after it.
    """

    def __init__(self, hot_rows: int, embedding_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        require_integer("hot_rows", hot_rows)
        require_integer("embedding_dim", embedding_dim)
        self.hot_rows = int(hot_rows)
        self.embedding_dim = int(embedding_dim)

    def build(self, input_shape: tuple[int | None, ...] | None = None) -> None:
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.hot_rows, self.embedding_dim), initializer="zeros", autocast=False)

    def call(self, slot_ids: Any) -> Any:
        return take_rows(self.embeddings, slot_ids)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, self.embedding_dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"hot_rows": self.hot_rows, "embedding_dim": self.embedding_dim})
        return config
