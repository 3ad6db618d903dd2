"""Keras 3 layers of the CTR models, one per module; `call` uses only `keras.ops`."""

from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.feature_cross import FeatureCross

__all__ = ["CategoricalEmbedding", "FeatureCross"]
