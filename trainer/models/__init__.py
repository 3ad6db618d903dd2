"""CTR models: each a CTRModel (the shared embedding, bags and config) plus a few named blocks, picked by name
through `build_model`."""

from trainer.models.base import CTRModel
from trainer.models.dcnv2 import DCNv2
from trainer.models.deepfm import DeepFM
from trainer.models.dien import DIEN
from trainer.models.din import DIN
from trainer.models.dlrm import DLRM
from trainer.models.registry import MODEL_BUILDERS, build_model
from trainer.models.wide_deep import WideDeep

__all__ = ["CTRModel", "DCNv2", "DIEN", "DIN", "DLRM", "DeepFM", "MODEL_BUILDERS", "WideDeep", "build_model"]
