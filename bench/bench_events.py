"""Event input speed on one generated hour: how fast Spark reads the raw impression stream as Parquet versus
the same rows as TSV, and how fast the impression x click join (with behaviour sequences) runs.
Writes bench/results/events.json.

    python -m bench.bench_events [--rows-per-minute 5000] [--minutes 60] [--root /tmp/ctr-bench-events]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from bench.provenance import provenance
from components.config import EventsConfig, GenerateConfig, SparkConfig
from components.events import CLICKS, EVENT_FILE, IMPRESSION_SCHEMA, IMPRESSIONS, generate_events
from components.feature_spec import load_spec
from components.interval import Interval
from components.layout import Layout
from spark_jobs.events import (
    attributed_clicks,
    behaviour_sequences,
    collect_metrics,
    extract_events,
    join_events,
    run,
    spark_schema,
)
from spark_jobs.session import get_spark

REPEATS = 3
EVENTS_SPEC = load_spec("events")  # the generated streams' columns


def best_seconds(fn) -> float:
    fn()  # warm-up: JIT, file listing caches
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-per-minute", type=int, default=5000)
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--root", default="/tmp/ctr-bench-events")
    args = parser.parse_args(argv)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    layout = Layout(root)
    generate = GenerateConfig(start="2026-01-01T00:00", minutes=args.minutes, rows_per_minute=args.rows_per_minute)
    events = EventsConfig()
    started = time.perf_counter()
    summary = generate_events(generate, events, layout)
    generate_seconds = time.perf_counter() - started

    start = datetime(2026, 1, 1, tzinfo=UTC)
    minutes = [start + timedelta(minutes=i) for i in range(args.minutes)]
    tsv_files = []
    for minute in minutes:  # the same impressions in the Criteo-like text layout, for the format comparison
        table = pq.read_table(layout.raw_events_minute_dir(IMPRESSIONS, minute) / EVENT_FILE)
        path = root / "tsv" / f"{minute:%H%M}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        pacsv.write_csv(table, path, pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
        tsv_files.append(str(path))

    spark = get_spark(SparkConfig(master="local[2]", shuffle_partitions=4), "bench-events")
    from pyspark.sql import functions as F

    columns = IMPRESSION_SCHEMA.names
    text_schema = ", ".join(f"{name} string" for name in columns)
    typed = dict(part.rsplit(" ", 1) for part in spark_schema(IMPRESSION_SCHEMA).split(", "))

    def read_parquet(selected):
        frame = extract_events(spark, layout, IMPRESSIONS, minutes, EVENTS_SPEC)
        return frame.select(F.bit_xor(F.xxhash64(*selected))).collect()

    def read_tsv(selected):
        frame = spark.read.csv(tsv_files, sep="\t", schema=text_schema, header=False, emptyValue=None)
        frame = frame.select(*[F.col(name).cast(typed[name]).alias(name) for name in columns])
        return frame.select(F.bit_xor(F.xxhash64(*selected))).collect()

    rows = summary["impression_deliveries"]
    timings = {
        "parquet_all_columns": best_seconds(lambda: read_parquet(columns)),
        "tsv_all_columns": best_seconds(lambda: read_tsv(columns)),
        "parquet_request_id_ts": best_seconds(lambda: read_parquet(["request_id", "ts"])),
        "tsv_request_id_ts": best_seconds(lambda: read_tsv(["request_id", "ts"])),
    }

    def join_only():
        impressions = extract_events(spark, layout, IMPRESSIONS, minutes, EVENTS_SPEC)
        clicks = extract_events(spark, layout, CLICKS, minutes, EVENTS_SPEC)
        samples, metrics = join_events(impressions, clicks, events.attribution_window_s)
        samples.write.format("noop").mode("overwrite").save()
        return collect_metrics(metrics)

    def join_and_sequences():
        impressions = extract_events(spark, layout, IMPRESSIONS, minutes, EVENTS_SPEC)
        clicks = extract_events(spark, layout, CLICKS, minutes, EVENTS_SPEC)
        samples, _ = join_events(impressions, clicks, events.attribution_window_s)
        with_history = behaviour_sequences(samples, attributed_clicks(samples), events.sequence_length)
        with_history.write.format("noop").mode("overwrite").save()

    final_end = start + timedelta(minutes=args.minutes - 1 - events.attribution_window_s // 60)
    span = Interval(start + timedelta(minutes=events.attribution_window_s // 60), final_end)

    def full_run():
        return run(spark, layout, span, root / "joined", spec=EVENTS_SPEC, window_s=events.attribution_window_s,
                   sequence_length=events.sequence_length, lookback_s=events.history_lookback_s)

    timings["join_and_metrics"] = best_seconds(join_only)
    timings["join_and_sequences"] = best_seconds(join_and_sequences)
    timings["run_span_to_parquet"] = best_seconds(full_run)
    run_metrics = full_run()
    spark.stop()

    result = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "spark_master": "local[2]"},
        "generated": {**summary, "generate_seconds": round(generate_seconds, 2)},
        "impression_deliveries": rows,
        "seconds": {k: round(v, 3) for k, v in timings.items()},
        "rows_per_second": {
            "parquet_all_columns": round(rows / timings["parquet_all_columns"]),
            "tsv_all_columns": round(rows / timings["tsv_all_columns"]),
            "parquet_request_id_ts": round(rows / timings["parquet_request_id_ts"]),
            "tsv_request_id_ts": round(rows / timings["tsv_request_id_ts"]),
            "join_and_metrics": round(rows / timings["join_and_metrics"]),
            "join_and_sequences": round(rows / timings["join_and_sequences"]),
            "run_span_to_parquet_input_rows": round(rows / timings["run_span_to_parquet"]),
        },
        "run_span": span.tag,
        "run_samples": run_metrics["impressions"],
        "bytes": {
            "parquet": sum(p.stat().st_size for p in (root / "raw" / IMPRESSIONS).rglob("*.parquet")),
            "tsv": sum(Path(p).stat().st_size for p in tsv_files),
        },
    }
    arguments = argv if argv is not None else sys.argv[1:]
    result = {**provenance(" ".join(["python -m bench.bench_events", *arguments])), **result}
    out = Path(__file__).parent / "results" / "events.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
