"""For the killed-writer test: `python -m tests.spark_jobs.killed_writer DATA_ROOT OUTPUT` writes block
TFRecord samples of the generated click log under DATA_ROOT to OUTPUT with a local Spark session, slowly
enough (one row per block, one shard) that the test can kill it half-way."""

import sys
from pathlib import Path

from components.config import FeatureConfig, SparkConfig
from components.feature_spec import load_spec
from components.layout import Layout
from spark_jobs.features import build_feature_state
from spark_jobs.raw import extract_raw, parse_raw
from spark_jobs.samples import write_samples
from spark_jobs.session import get_spark

CRITEO = load_spec("criteo")


def main() -> None:
    root, output = Path(sys.argv[1]), Path(sys.argv[2])
    spark = get_spark(SparkConfig(master="local[1]", shuffle_partitions=1, driver_memory="1g"), "killed-writer")
    paths = sorted(str(p) for p in (Layout(root).root / "raw").rglob("part-00000.tsv"))
    frame = parse_raw(extract_raw(spark, paths, CRITEO), CRITEO)
    state = build_feature_state(frame, None, FeatureConfig(min_count=2), day=0, version="killed", evict=False,
                                spec=CRITEO)
    print("writing", flush=True)
    write_samples(frame, state, output, spec=CRITEO, split="train", block_rows=1, num_shards=1, seed=1, inputs={})


if __name__ == "__main__":
    main()
