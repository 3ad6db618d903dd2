"""Keras 3 layers of the CTR models, one per module; `call` uses only `keras.ops`."""

from trainer.layers.attentional_update_gru import AttentionalUpdateGRU
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.dot_interaction import DotInteraction
from trainer.layers.factorization_machine import FactorizationMachine
from trainer.layers.feature_cross import FeatureCross
from trainer.layers.linear_logit import LinearLogit
from trainer.layers.multi_hash_embedding import MultiHashEmbedding
from trainer.layers.simple_recurrent_unit import SimpleRecurrentUnit
from trainer.layers.target_attention import TargetAttention

__all__ = [
    "AttentionalUpdateGRU",
    "CategoricalEmbedding",
    "DotInteraction",
    "FactorizationMachine",
    "FeatureCross",
    "LinearLogit",
    "MultiHashEmbedding",
    "SimpleRecurrentUnit",
    "TargetAttention",
]
