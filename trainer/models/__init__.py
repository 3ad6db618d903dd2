"""CTR models: each a few named blocks, picked by name through `build_model`."""

from trainer.models.dcnv2 import DCNv2
from trainer.models.registry import MODEL_BUILDERS, build_model

__all__ = ["DCNv2", "MODEL_BUILDERS", "build_model"]
