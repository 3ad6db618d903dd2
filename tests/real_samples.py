"""The small real CTR samples in ../shared/data (never copied into the project: their terms forbid it). Tests
that read them skip when ../shared is absent."""

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# Preset name -> the sample of its layout.
SAMPLES = {
    "criteo": "criteo_sample_deepctr.txt",
    "avazu": "avazu_sample_deepctr.txt",
    "taobao": "taobao_ad_tiny_fuxictr_train.csv",
}
