"""The figures the README quotes from bench/results, rebuilt from the files: a result file that is rerun, or a
README sentence edited by hand, fails here until the two agree again. Each entry is the README's wording with
the file's values put in at the README's precision; line breaks and runs of spaces do not count."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


@cache
def result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def value(name: str, path: str):
    found = result(name)
    for key in path.split("."):
        found = found[int(key)] if isinstance(found, list) else found[key]
    return found


def values(names: tuple[str, ...], path: str) -> list[float]:
    return [value(name, path) for name in names]


def log_runs(key: str, exponent: str = "1.05") -> list[float]:
    """`key` at Zipf `exponent` in the two bench-tiers runs of the store's log."""
    return [result(name)[f"zipf_{exponent}"][key] for name in ("tiers_log.json", "tiers_log_run2.json")]


def holes_runs(key: str, exponent: str = "1.05") -> list[float]:
    """`key` at Zipf `exponent` in the two bench-tiers runs with rows on holes drawn without a read."""
    return [result(name)[f"zipf_{exponent}"][key] for name in ("tiers_holes.json", "tiers_holes_run2.json")]


def log_disk(side: str) -> int:
    """Bytes the `side` run wrote to disk at Zipf 1.05 in the first run of the log (the same in both runs)."""
    return result("tiers_log.json")["zipf_1.05"][side]["process_io"]["write_bytes"]


def quiet_runs(key: str) -> list[float]:
    """`key` at Zipf 1.05 in the four bench-tiers runs of the quiet machine (tiers_jax*, tiers_fit*)."""
    return [result(name)["zipf_1.05"][key] for name in
            ("tiers_jax.json", "tiers_jax_run2.json", "tiers_fit.json", "tiers_fit_run2.json")]


def worker_rss_after_minute(minute: int, name: str = "freshness_run2.json") -> tuple[float, float]:
    """The lowest and highest of `name`'s samples of the step worker's memory from `minute` on."""
    samples = [mib for at, mib in value(name, "step_worker_rss_mib.samples") if at >= minute * 60]
    return min(samples), max(samples)


def worker_rss_slope(name: str = "freshness_run2.json") -> float:
    """MiB a minute: the least-squares line through `name`'s memory samples from the fifth minute."""
    import numpy as np

    samples = np.array(value(name, "step_worker_rss_mib.samples"))
    later = samples[samples[:, 0] >= 300]
    return float(np.polyfit(later[:, 0] / 60, later[:, 1], 1)[0])


def one_call_span(phase: str) -> str:
    """The p99 ratios to in memory of `phase` over the four runs of the two bench-row-cache files of one call."""
    ratios = [v for name in ("row_cache_one_call.json", "row_cache_one_call_run2.json")
              for v in result(name)["p99_ratio_to_memory"][phase]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def p50_span(names: tuple[str, ...], phase: str) -> str:
    """The p50 ratios of `phase` to the in-memory p50, run by run, over the bench-row-cache files `names`."""
    ratios = [run[phase]["p50_ms"] / run["memory"]["p50_ms"] for name in names for run in result(name)["runs"]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


ONE_LOAD = ("row_cache_one_load.json", "row_cache_one_load_run2.json")


def long_run_rss() -> list[float]:
    return value("worker_memory_150.json", "variants.glibc_default.rss_mib")


def quarter_hour_mean(index: int) -> float:
    """The worker's mean RSS over the `index`-th 15 minutes of worker_memory_150.json."""
    return float(np.mean(long_run_rss()[15 * index:15 * index + 15]))


def long_run_slope(start: int, end: int) -> float:
    """The least-squares rise of the worker's RSS in MiB a minute over minutes start+1..end."""
    rss = long_run_rss()[start:end]
    return float(np.polyfit(np.arange(start, start + len(rss)), rss, 1)[0])


def two_calls_served(label: str, name: str, key: str) -> list[float]:
    """`key` of served pass `name` of export `label`, run by run, in row_cache_two_calls.json."""
    return [run["served"][label][name][key] for run in result("row_cache_two_calls.json")["runs"]]


def train_step_runs(key: str, exponent: str = "1.05", side: str | None = None) -> list:
    """`key` at Zipf `exponent` in the two bench-tiers --train-step runs (of `side`'s run when given)."""
    runs = [result(name)[f"zipf_{exponent}"] for name in ("tiers_train_step.json", "tiers_train_step_run2.json")]
    return [run[side][key] if side else run[key] for run in runs]


def tiers_figures(key: str, runs: tuple[object, ...] = (7, 8, 9)) -> list[float]:
    """`key` at Zipf 1.05 in bench-tiers runs (by default the three of the store's I/O threads and drawn rows)."""
    return [result(f"tiers{'_run' if isinstance(run, int) else ''}{run}.json")["zipf_1.05"][key] for run in runs]


def dien(path: str):
    return value("events_quality.json", path)


def policy() -> dict:
    """bench-tier-policy's figures at Zipf 1.05."""
    return result("tier_policy.json")["zipf_1.05"]


def rng2(name: str, key: str, digits: int) -> str:
    """The range, "lo-hi" at `digits` decimals, over every entry of a {label: [per run]} mapping `key`."""
    found = [x for runs in value(name, key).values() for x in runs]
    return f"{min(found):.{digits}f}-{max(found):.{digits}f}"


def segmented_eviction(key: str) -> float:
    """Rows loaded a request in row_cache_segmented.json's eviction comparison (the same in both runs)."""
    found = {run["eviction"][key]["rows_loaded_per_request"] for run in result("row_cache_segmented.json")["runs"]}
    assert len(found) == 1, f"row_cache_segmented.json's runs differ in {key}: {found}"
    return found.pop()


def eviction_range(key: str, export: str | None = None) -> str:
    """[lowest, highest] of the segmented LRU over the plain one's `key` over row_cache_eviction.json and its
    second run, for `export` or both exports, "lo-hi" at three decimals."""
    found = [x for name in ("row_cache_eviction.json", "row_cache_eviction_run2.json")
             for label, ranges in result(name)["segmented_over_lru_range"].items()
             if export in (None, label) for x in ranges[key]]
    return f"{min(found):.3f}-{max(found):.3f}"


def pair_range(path: str) -> str:
    """The range, "lo-hi" at two decimals, of a [min, max] entry over tier_step.json and tier_step_run2.json."""
    found = [x for name in ("tier_step.json", "tier_step_run2.json") for x in value(name, path)]
    return f"{min(found):.2f}-{max(found):.2f}"


def native_range(key: str, form: str = ".3f") -> str:
    """The range over tiers_native.json to tiers_native_run17.json of zipf_1.05's `key`, "lo-hi"."""
    names = ["tiers_native.json"] + [f"tiers_native_run{n}.json" for n in range(2, 18)]
    found = [result(name)["zipf_1.05"][key] for name in names]
    return f"{format(min(found), form)}-{format(max(found), form)}"


def fastest_memory_run() -> dict:
    """zipf_1.05 of the bench-tiers run (since the planner moved to C) whose in-memory side ran fastest."""
    names = ["tiers_native.json"] + [f"tiers_native_run{n}.json" for n in range(2, 18)]
    return max((result(name)["zipf_1.05"] for name in names), key=lambda z: z["memory_ex_per_s"])


def movielens(key: str):
    return value("real.json", f"datasets.movielens.{key}")


def obd(key: str):
    return value("real.json", f"datasets.obd.{key}")


SERVING = ("serving_run1.json", "serving_run2.json", "serving_run3.json")  # the load generator's first client
LOADED = ("serving_run4.json", "serving.json")  # bodies encoded before the run, http.client
FLOAT32 = ("serving_run6.json", "serving_run7.json")  # alternated with BFLOAT16, one day, one host
BFLOAT16 = ("serving_bfloat16_run2.json", "serving_bfloat16_run3.json")
STAGED = ("serving_run8.json", "serving_run9.json")  # the server's stages in /metrics
TIMED = ("serving_run10.json", "serving_run11.json")  # each answer's stages (Server-Timing)
COMPILED = ("serving_run12.json", "serving_run13.json", "serving_run14.json")  # a compiled client beside
QUEUED = ("serving_run15.json", "serving_run16.json")  # requests sent behind another, another host
APP_SPLIT = ("serving_run17.json", "serving_run18.json")  # each answer's whole time in the app
GAPS = ("serving_run19.json", "serving_run20.json")  # one request at a time after fixed idle gaps
CHAIN_SPANS = ("chain_spans_run1.json", "chain_spans_run2.json", "chain_spans.json")
SCALE = ("scale.json", "scale_run2.json")
HISTORY = ("history.json", "history_run2.json")
S3_PERSISTENCE = ("s3_persistence.json", "s3_persistence_run2.json")
WORKER_AFTER = ("worker_memory_run_end_gc.json", "worker_memory_run_end_gc_run2.json")
HISTORY_TRAIN = ("history_with_train.json", "history_with_train_run2.json")


def rss_after_minute_10(names: tuple[str, ...]) -> list[float]:
    """The step worker's RSS after minutes 11-30 of bench-worker-memory's runs `names`, all together."""
    return [mib for name in names for mib in value(name, "variants.glibc_default.rss_mib")[10:]]


def variant_seeds(key: str):
    """`key` of MovieLens in the three-seed run with the DIN and no-history variants (real_variant_seeds.json)."""
    return value("real_variant_seeds.json", f"datasets.movielens.{key}")


def span(numbers: list[float], fmt: str, scale: float = 1.0) -> str:
    return f"{min(numbers) / scale:{fmt}}-{max(numbers) / scale:{fmt}}"


FIGURES: dict[str, Callable[[], str]] = {
    "real.json: MovieLens against the baselines": lambda: (
        f"the default run's AUC was {movielens('auc'):.4f} against {movielens('baseline_auc'):.4f} for the hashed "
        f"logistic regression on the same rows and {movielens('lightgbm_auc'):.4f} for LightGBM (lift "
        f"{movielens('lift_auc'):+.4f}, paired 95 % interval {movielens('lift_auc_ci95')[0]:+.4f} to "
        f"{movielens('lift_auc_ci95')[1]:+.4f}), its logloss {movielens('logloss'):.4f} against "
        f"{movielens('baseline_logloss'):.4f} and {movielens('lightgbm_logloss'):.4f}; trained with three seeds, "
        f"{movielens('auc_over_seeds.min'):.4f}-{movielens('auc_over_seeds.max'):.4f} (lift "
        f"{movielens('lift_auc_over_seeds.min'):+.4f} to {movielens('lift_auc_over_seeds.max'):+.4f}, mean "
        f"{movielens('lift_auc_over_seeds.mean'):+.4f})"),
    "real.json: DIN and DCNv2 without histories": lambda: (
        f"DIN over the liked items scored {movielens('auc_din_history'):.4f}, DCNv2 without histories "
        f"{movielens('auc_dcnv2_no_history'):.4f}"),
    "row_cache_calls.json": lambda: (
        f"server's mean time in the server "
        f"{span(value('row_cache_calls.json', 'three_over_two_range.tiered.server_mean_ms'), '.2f')}x the "
        f"two-call one's with an empty cache, "
        f"{span(value('row_cache_calls.json', 'three_over_two_range.evicting.server_mean_ms'), '.2f')}x with a "
        "2,000-row cache (row_cache_calls.json)"),
    "quality_reference.json": lambda: (
        f"told the generator's form {value('quality_reference.json', 'structured_lr.gap_to_planted'):.4f} at "
        f"{value('quality_reference.json', 'rows'):,} rows, and "
        f"{value('quality_reference.json', 'structured_lr_head.gap_to_planted'):.4f} when also told"),
    "real_variant_seeds.json: DIN against DCNv2 without histories over three seeds": lambda: (
        f"DIN over the liked items scored {variant_seeds('auc_din_history_over_seeds.min'):.4f}-"
        f"{variant_seeds('auc_din_history_over_seeds.max'):.4f} against "
        f"{variant_seeds('auc_dcnv2_no_history_over_seeds.min'):.4f}-"
        f"{variant_seeds('auc_dcnv2_no_history_over_seeds.max'):.4f} for DCNv2 without histories, ahead on every "
        f"seed by {variant_seeds('din_minus_dcnv2_no_history_over_seeds.min'):+.4f} to "
        f"{variant_seeds('din_minus_dcnv2_no_history_over_seeds.max'):+.4f} (mean "
        f"{variant_seeds('din_minus_dcnv2_no_history_over_seeds.mean'):+.4f}), and the default model "
        f"{variant_seeds('auc_over_seeds.min'):.4f}-{variant_seeds('auc_over_seeds.max'):.4f}"),
    "real_interest_product.json, real_interest_product_off.json": lambda: (
        f"DIN scored {value('real_interest_product.json', 'datasets.movielens.auc_din_history'):.4f} with it and "
        f"{value('real_interest_product_off.json', 'datasets.movielens.auc_din_history'):.4f} without, DCNv2 without "
        f"histories {value('real_interest_product.json', 'datasets.movielens.auc_dcnv2_no_history'):.4f}"),
    "events_quality_history_aux.json, real_history_aux.json, real_history_aux_off.json": lambda: (
        f"DIN scored {value('events_quality_history_aux.json', 'auc_din'):.4f} with it against "
        f"{value('events_quality_defaults.json', 'auc_din'):.4f} without (events_quality_history_aux.json, "
        f"events_quality_defaults.json; +0.0058 on a second seed), so its gap to the learnable ceiling fell from "
        f"{value('events_quality_defaults.json', 'best_gap_to_learnable'):.4f} to "
        f"{value('events_quality_history_aux.json', 'best_gap_to_learnable'):.4f} (goal 0.005: not met); on "
        f"MovieLens, one seed each on one AMD EPYC host, DIN scored "
        f"{value('real_history_aux.json', 'datasets.movielens.auc_din_history'):.4f} with it and "
        f"{value('real_history_aux_off.json', 'datasets.movielens.auc_din_history'):.4f} without"),
    "events_quality_interest_product.json": lambda: (
        f"(DIN {value('events_quality_interest_product.json', 'auc_din'):.4f},\n"
        "events_quality_interest_product.json)"),
    "real.json: the Open Bandit logs": lambda: (
        f"On the Open Bandit logs ({obd('test_clicks')} later clicks) {obd('auc'):.4f} against "
        f"{obd('baseline_auc'):.4f}, {obd('auc_over_seeds.min'):.2f}-{obd('auc_over_seeds.max'):.2f} over the "
        "seeds"),
    "quality.json": lambda: (
        f"DCNv2 reaches AUC {value('quality.json', 'auc'):.4f} against the planted model's "
        f"{value('quality.json', 'planted_auc'):.4f} on {value('quality.json', 'generated_rows') / 1e6:.0f} M rows, "
        f"mean prediction {value('quality.json', 'mean_prediction'):.4f} for a click rate of "
        f"{value('quality.json', 'mean_label'):.4f}"),
    "scale.json, scale_run2.json": lambda: (
        f"{span(values(SCALE, 'runs.0.steps_only_ex_per_s'), '.1f', 1e6)} M steps-only, "
        f"{span(values(SCALE, 'runs.0.end_to_end_ex_per_s'), '.1f', 1e6)} M end to end with "
        f"{value('scale.json', 'reader_workers')} reader processes"),
    "history*.json: two runs each": lambda: (
        f"validate {span(values(HISTORY, 'layouts.spread.steps_seconds.validate'), '.1f')} s "
        f"({value('history.json', 'before.layouts.spread.steps_seconds.validate'):,.1f} s before batched "
        f"validation), validate + features + samples {span(values(HISTORY, 'layouts.spread.run_seconds'), '.1f')} s "
        f"against {span(values(HISTORY, 'layouts.one_day.run_seconds'), '.1f')} s for the one day (history.json, "
        f"history_run2.json; with training {span(values(HISTORY_TRAIN, 'layouts.spread.run_seconds'), '.1f')} s "
        f"against {span(values(HISTORY_TRAIN, 'layouts.one_day.run_seconds'), '.1f')} s, "
        "history_with_train.json, history_with_train_run2.json)"),
    "worker_memory*.json: minutes 11-30": lambda: (
        f"{span(value('worker_memory.json', 'variants.glibc_default.rss_mib')[10:], ',.0f')} MiB over minutes 11-30 "
        f"when it collected only when idle (worker_memory.json), "
        f"{span(rss_after_minute_10(WORKER_AFTER), ',.0f')} MiB with a collection at every second run's end, two runs"),
    "native_rows.json": lambda: (
        f"at {value('native_rows.json', 'rate_per_s'):.0f} requests/s: the Python reader's p50 "
        + span(value("native_rows.json", "python_over_native_range.p50_ms"), ".2f") + "x the native one's, p99 "
        + span(value("native_rows.json", "python_over_native_range.p99_ms"), ".2f") + "x, the server's own mean time "
        + span(value("native_rows.json", "python_over_native_range.server_mean_ms"), ".2f") + "x ("
        + span([r["native"]["server_mean_ms"] for r in result("native_rows.json")["rounds"]], ".2f")
        + " ms native)"),
    "native_rows_run2.json": lambda: (
        "the server's own mean time "
        + span(value("native_rows_run2.json", "python_over_native_range.server_mean_ms"), ".2f") + "x ("
        + span([r["native"]["server_mean_ms"] for r in result("native_rows_run2.json")["rounds"]], ".2f")
        + " ms native), p99 " + span(value("native_rows_run2.json", "python_over_native_range.p99_ms"), ".2f")
        + "x (native_rows_run2.json)"),
    "worker_memory_150.json": lambda: (
        "over 150 minutes it levels off: 15-minute means of "
        f"{quarter_hour_mean(0):,.0f} MiB in the first quarter hour, {quarter_hour_mean(3):,.0f} MiB in the "
        f"fourth, {quarter_hour_mean(9):,.0f} MiB in the last, a least-squares rise of {long_run_slope(5, 75):.1f} "
        f"MiB a minute over minutes 6-75 and {long_run_slope(75, 150):.1f} over 76-150"),
    "s3_persistence*.json: the recorder against the snapshot": lambda: (
        f"({value('s3_persistence.json', 'requests'):,} requests, "
        f"{value('s3_persistence.json', 'live_bytes') / 1e6:.1f} MB live): moto's recorder kept a "
        f"{value('s3_persistence.json', 'recorder.disk_bytes') / 1e6:.1f} MB log and "
        f"took {span(values(S3_PERSISTENCE, 'recorder.restart_seconds'), '.1f')} s to start again, the stack's "
        f"snapshot {value('s3_persistence.json', 'snapshot.disk_bytes') / 1e6:.1f} MB and "
        f"{span(values(S3_PERSISTENCE, 'snapshot.restart_seconds'), '.2f')} s"),
    "serving_run4.json, serving.json: under load": lambda: (
        f"the highest rate that held p99 <= 10 ms was {span(values(LOADED, 'max_rate_per_s_at_p99_10ms'), '.1f')} "
        f"requests/s; at half of it ({span(values(LOADED, 'loaded_rate_per_s'), '.1f')} requests/s) p99 "
        f"{span(values(LOADED, 'loaded_p99_ms_100'), '.2f')} ms, p50 "
        f"{span(values(LOADED, 'loaded_p50_ms_100'), '.2f')} ms, {sum(values(LOADED, 'failed_requests'))} failed; "
        "the same requests with the earlier client p99 "
        f"{span(values(LOADED, 'loaded_p99_ms_100_previous_client'), '.2f')} ms"),
    "serving_run6.json, serving_run7.json, serving_bfloat16_run2.json, serving_bfloat16_run3.json": lambda: (
        f"the model's call took {span(values(BFLOAT16, 'inprocess_p99_ms_100'), '.2f')} ms at p99 in process "
        f"against {span(values(FLOAT32, 'inprocess_p99_ms_100'), '.2f')} ms for float32, yet under load p99 was "
        f"{span(values(BFLOAT16, 'loaded_p99_ms_100'), '.2f')} ms against "
        f"{span(values(FLOAT32, 'loaded_p99_ms_100'), '.2f')} ms"
        f" (two runs each, alternated: bench/results/serving_run6.json, serving_run7.json, serving_bfloat16_run2.json,"
        f" serving_bfloat16_run3.json), while one request at a time met the goal in all four (p99 "
        f"{span(values(FLOAT32 + BFLOAT16, 'p99_ms_100'), '.2f')} ms)"),
    "serving_run8.json, serving_run9.json: by stage": lambda: (
        f"under load p99 {span(values(STAGED, 'loaded_p99_ms_100'), '.2f')} ms, p50 "
        f"{span(values(STAGED, 'loaded_p50_ms_100'), '.2f')} ms, {sum(values(STAGED, 'failed_requests'))} failed "
        f"(**still over 5 ms**); the server's own mean a request "
        f"{span(values(STAGED, 'loaded_stage_mean_ms_100.total'), '.2f')} ms under load against "
        f"{span(values(STAGED, 'paired_stage_mean_ms_100.total'), '.2f')} ms one at a time, the model's call with "
        f"its input read {span(values(STAGED, 'loaded_stage_mean_ms_100.compute'), '.2f')} against "
        f"{span(values(STAGED, 'paired_stage_mean_ms_100.compute'), '.2f')} ms"),
    "serving_run10.json, serving_run11.json: each request": lambda: (
        f"under load p99 {span(values(TIMED, 'loaded_p99_ms_100'), '.2f')} ms at "
        f"{span(values(TIMED, 'loaded_rate_per_s'), '.1f')} requests/s, {sum(values(TIMED, 'failed_requests'))} "
        f"failed (**not met**); the slowest 1 % took "
        f"{span(values(TIMED, 'loaded_tail_ms_100.slowest_1pct.latency_ms'), '.2f')} ms on average: the client's "
        f"delay before the send {span(values(TIMED, 'loaded_tail_ms_100.slowest_1pct.send_delay_ms'), '.2f')} ms, "
        f"the server's stages {span(values(TIMED, 'loaded_tail_ms_100.slowest_1pct.server_stages_ms'), '.2f')} ms "
        f"and the rest {span(values(TIMED, 'loaded_tail_ms_100.slowest_1pct.rest_ms'), '.2f')} ms, against "
        f"{span(values(TIMED, 'loaded_tail_ms_100.middle_tenth.send_delay_ms'), '.2f')}, "
        f"{span(values(TIMED, 'loaded_tail_ms_100.middle_tenth.server_stages_ms'), '.2f')} and "
        f"{span(values(TIMED, 'loaded_tail_ms_100.middle_tenth.rest_ms'), '.2f')} ms in the middle tenth "
        f"(latency {span(values(TIMED, 'loaded_tail_ms_100.middle_tenth.latency_ms'), '.2f')} ms)"),
    "serving_run12.json, serving_run13.json, serving_run14.json: the compiled client": lambda: (
        f"p99 {span(values(COMPILED, 'loaded_p99_ms_100_compiled_client'), '.2f')} ms against the load "
        f"generator's\n{span(values(COMPILED, 'loaded_p99_ms_100'), '.2f')} ms, "
        f"{sum(values(COMPILED, 'failed_requests'))} failed (**not met**); the compiled client's slowest 1 % spent "
        f"{span(values(COMPILED, 'loaded_tail_ms_100_compiled_client.slowest_1pct.server_stages_ms'), '.2f')} ms "
        f"in the server's\nstages and "
        f"{span(values(COMPILED, 'loaded_tail_ms_100_compiled_client.slowest_1pct.rest_ms'), '.2f')} ms in the rest"),
    "serving_run15.json, serving_run16.json: queued or alone": lambda: (
        f"{span(values(QUEUED, 'loaded_sent_behind_share_100_compiled_client'), '.1f', scale=0.01)} % of the "
        f"compiled client's requests were sent behind another; p99 "
        f"{span(values(QUEUED, 'loaded_p99_ms_100_compiled_client'), '.2f')} ms from the compiled client, "
        f"{span(values(QUEUED, 'loaded_p99_ms_100'), '.2f')} ms from the load generator, "
        f"{sum(values(QUEUED, 'failed_requests'))} failed (**not met**); at "
        f"{value('serving_run16.json', 'loaded_rate_per_s'):.1f} requests/s (run 16, whose scan missed early) p50 "
        f"{value('serving_run16.json', 'loaded_p50_ms_100_compiled_client'):.2f} ms against "
        f"{value('serving_run15.json', 'loaded_p50_ms_100_compiled_client'):.2f} ms at "
        f"{value('serving_run15.json', 'loaded_rate_per_s'):.1f} requests/s"),
    "serving_bfloat16_run4.json: bfloat16 on the same host": lambda: (
        f"p99 {value('serving_bfloat16_run4.json', 'loaded_p99_ms_100'):.2f} ms, "
        f"{value('serving_bfloat16_run4.json', 'loaded_p99_ms_100_compiled_client'):.2f} ms from the compiled "
        f"client, at {value('serving_bfloat16_run4.json', 'loaded_rate_per_s'):.1f} requests/s (**not met**)"),
    "serving_run17.json, serving_run18.json: the rest split at the app": lambda: (
        f"p99 {span(values(APP_SPLIT, 'loaded_p99_ms_100'), '.2f')} ms, "
        f"{span(values(APP_SPLIT, 'loaded_p99_ms_100_compiled_client'), '.2f')} ms from the compiled client, "
        f"**not met**) the app added "
        f"{span(values(APP_SPLIT, 'loaded_tail_ms_100_compiled_client.slowest_1pct.rest_in_app_ms'), '.2f')} ms "
        f"outside its stages to the compiled client's slowest 1 %, which spent "
        f"{span(values(APP_SPLIT, 'loaded_tail_ms_100_compiled_client.slowest_1pct.rest_outside_app_ms'), '.2f')} "
        f"ms outside the app"),
    "serving_run21.json": lambda: (
        f"On an AMD EPYC host (serving_run21.json): p99 {value('serving_run21.json', 'loaded_p99_ms_100'):.2f} ms "
        f"under load, {value('serving_run21.json', 'loaded_p99_ms_100_compiled_client'):.2f} ms from the compiled "
        f"client, at {value('serving_run21.json', 'loaded_rate_per_s'):.1f}"),
    "serving_run19.json, serving_run20.json: idle gaps": lambda: (
        f"p50 {span(values(GAPS, 'idle_gaps_100.1.p50_ms'), '.2f')} ms after 1 ms idle, "
        f"{span(values(GAPS, 'idle_gaps_100.10.p50_ms'), '.2f')} ms after 10 ms and "
        f"{span(values(GAPS, 'idle_gaps_100.30.p50_ms'), '.2f')} ms after 30 ms"),
    "chain_spans_run1.json, chain_spans_run2.json, chain_spans.json": lambda: (
        f"made from the chain at minute 1,440 in {span(values(CHAIN_SPANS, 'spans.materialize_s_at_1440'), '.1f')} s "
        f"with spans against {span(values(CHAIN_SPANS, 'overlays_only.materialize_s_at_1440'), '.1f')} s from "
        f"{value('chain_spans.json', 'overlays_only.pieces_at_1440'):,} overlays "
        f"({value('chain_spans.json', 'spans.pieces_at_1440')} pieces), for "
        f"{value('chain_spans.json', 'write_amplification'):.2f}x the bytes written over the day and minutes "
        f"that write a large span taking up to {max(values(CHAIN_SPANS, 'spans.write_s_max')):.1f} s longer"),
    "chain_spans_run3.json": lambda: (
        f"spans merged from their pieces "
        f"{value('chain_spans_run3.json', 'span_minutes_pieces_over_store.p50'):.2f}x of the time of spans read from "
        f"the store at the median, a minute's overlays p99 "
        f"{value('chain_spans_run3.json', 'overlays_only.write_s_p99'):.3f} s"),
    "serving_run1.json, serving_run2.json, serving_run3.json: under load": lambda: (
        f"({span(values(SERVING, 'loaded_rate_per_s'), 'g')} requests/s): p99 "
        f"{span(values(SERVING, 'loaded_p99_ms_100'), '.2f')} ms, p50 "
        f"{span(values(SERVING, 'loaded_p50_ms_100'), '.2f')} ms, "
        f"{sum(values(SERVING, 'failed_requests'))} failed"),
    "serving_run1.json, serving_run2.json, serving_run3.json: one request at a time": lambda: (
        f"the one-at-a-time closed loop of the same runs gave {span(values(SERVING, 'p99_ms_100'), '.2f')} ms"),
    "events_quality.json": lambda: (
        f"lift AUC from {value('events_quality.json', 'auc_criteo_columns'):.4f} (DCNv2 on the Criteo-like columns) "
        f"to {value('events_quality.json', 'auc_dcnv2'):.4f} (DCNv2) and {value('events_quality.json', 'auc_din'):.4f} "
        f"(DIN), against the planted model's {value('events_quality.json', 'planted_auc'):.4f}"),
    "events_quality.json: DIEN": lambda: (
        f"trained at {dien('dien_sru.ex_per_s') / dien('dien_gru.ex_per_s'):.3f}x GRU's examples/s here "
        f"(events_quality.json; 0.847-0.849 in two runs before; published results found it faster) at the same AUC "
        f"({dien('dien_sru.auc'):.4f} vs {dien('dien_gru.auc'):.4f}); 2 micro-batches cost "
        f"{100 * (1 - dien('dien_gru_micro2.ex_per_s') / dien('dien_gru.ex_per_s')):.1f} % of GRU's speed (8-14 % "
        f"before) at unchanged AUC ({dien('dien_gru_micro2.auc'):.4f})"),
    "events_quality_defaults.json": lambda: (
        f"DCNv2 {value('events_quality_defaults.json', 'auc_dcnv2'):.4f}, DIN "
        f"{value('events_quality_defaults.json', 'auc_din'):.4f} (its best epoch the third of five), Criteo-like "
        f"columns {value('events_quality_defaults.json', 'auc_criteo_columns'):.4f}; DIN is "
        f"{value('events_quality_defaults.json', 'best_gap_to_learnable'):.4f} under the learnable ceiling"),
    "events_quality_ceiling.json": lambda: (
        f"DCNv2 {value('events_quality_ceiling.json', 'auc_dcnv2'):.4f}, DIN "
        f"{value('events_quality_ceiling.json', 'auc_din'):.4f}, Criteo-like columns "
        f"{value('events_quality_ceiling.json', 'auc_criteo_columns'):.4f}, the ceiling "
        f"{value('events_quality_ceiling.json', 'learnable_auc'):.4f} again; DIN "
        f"{value('events_quality_ceiling.json', 'best_gap_to_learnable'):.4f} under it and "
        f"{value('events_quality_ceiling.json', 'best_gap_to_planted'):.4f} under the planted model"),
    "quality_900k.json": lambda: (
        f"costs {value('quality_900k.json', 'auc_gap'):.4f} on their own generated day (DCNv2 "
        f"{value('quality_900k.json', 'auc'):.4f} against its planted model's "
        f"{value('quality_900k.json', 'planted_auc'):.4f}, `quality_900k.json`)"),
    "naive.json": lambda: (
        f"{value('naive.json', 'ratio_sized_tables'):.2f}x the naive speed (naive.json's\n"
        f"                           `ratio_sized_tables`); the first definition's 100,002-row tables, which inflate "
        f"the\n                           naive side's dense Adam updates, {value('naive.json', 'ratio'):.2f}x"),
    "updates.json": lambda: (
        f"grows by\n{value('updates.json', 'ms_per_million_rows.jax'):.1f} ms a step per million rows, the "
        f"TensorFlow step by {value('updates.json', 'ms_per_million_rows.tensorflow'):.1f} ms; at 16.8 M rows\n"
        + "-".join(f"{ratio:.2f}" for ratio in sorted(result('updates.json')['by_rows'][-1]['jax_over_tensorflow']))
        + "x the TensorFlow step's time (updates.json"),
    "row_cache.json": lambda: (
        "p99 " + span([value("row_cache.json", f"runs.{run}.memory.p99_ms") for run in (0, 1)], ".2f")
        + " ms in\nmemory; with every row cached "
        + "-".join(f"{v:.2f}" for v in value("row_cache.json", "p99_ratio_to_memory.warm"))
        + "x that, with an empty cache "
        + "-".join(f"{v:.2f}" for v in value("row_cache.json", "p99_ratio_to_memory.cold"))
        + "x,\nwith a cache smaller than the rows read "
        + "-".join(f"{v:.2f}" for v in value("row_cache.json", "p99_ratio_to_memory.evicting"))
        + "x (row_cache.json)"),
    "events_quality_dien_aux.json, events_quality_dien_aux_off.json": lambda: (
        f"on the events day DIEN scored {value('events_quality_dien_aux.json', 'auc_dien'):.4f} with it against "
        f"{value('events_quality_dien_aux_off.json', 'auc_dien'):.4f} without (events_quality_dien_aux.json"),
    "row_cache_served.json": lambda: (
        f"under open-loop load at {value('row_cache_served.json', 'runs.0.served.rate_per_s'):.0f} requests/s (2 "
        f"runs of\n{value('row_cache_served.json', 'settings.loaded_requests'):,} requests a pass): p99 "
        + "-".join(f"{v:.2f}" for v in value("row_cache_served.json", "served_p99_ratio_to_memory.tiered_warm"))
        + "x in memory's with every row cached, "
        + "-".join(f"{v:.2f}" for v in value("row_cache_served.json", "served_p99_ratio_to_memory.tiered_cold"))
        + "x\nfor a server just started, whose cache does not warm within the "
        f"{value('row_cache_served.json', 'settings.loaded_requests'):,} requests, "
        + span(value("row_cache_served.json", "served_p99_ratio_to_memory.evicting_cold")
               + value("row_cache_served.json", "served_p99_ratio_to_memory.evicting_warm"), ".2f")
        + "x evicting (row_cache_served.json"),
    "row_cache_two_calls.json": lambda: (
        "its p50 is " + span(value("row_cache_two_calls.json", "p50_ratio_to_memory.cold"), ".2f")
        + "x in memory's with an empty cache, against "
        + span(value("row_cache_two_calls.json", "p50_ratio_to_memory.cold_three_calls"), ".2f")
        + "x for three calls in the same runs; served under load, a cache preloaded with the whole table answered "
        "at " + span(value("row_cache_two_calls.json", "served_p99_ratio_to_memory.tiered_preloaded_cold"), ".2f")
        + "x in memory's p99 with " + ("no row loaded" if max(two_calls_served("tiered_preloaded", "cold",
                                                                               "rows_loaded_per_request")) == 0
                                       else "rows loaded") + ", while a "
        f"{value('row_cache_two_calls.json', 'settings.small_cache'):,}-row cache loaded rows on "
        + ("every request" if all(calls == 1.0 for label in ("evicting", "evicting_preloaded")
                                  for name in ("cold", "warm")
                                  for calls in two_calls_served(label, name, "load_calls_per_request"))
           else "some requests") + ", preloaded or not (row_cache_two_calls.json"),
    "tiers_jax.json, tiers_jax_run2.json, tiers_fit.json, tiers_fit_run2.json": lambda: (
        f"On a quiet machine (the in-memory side at {min(quiet_runs('memory_ex_per_s')):,.0f}-"
        f"{max(quiet_runs('memory_ex_per_s')):,.0f} ex/s) the library runs gave {min(quiet_runs('speed_ratio')):.3f}-"
        f"{max(quiet_runs('speed_ratio')):.3f}x at Zipf 1.05, the goal missed in "
        f"{['no', 'one', 'two', 'three', 'four'][sum(r < 0.5 for r in quiet_runs('speed_ratio'))]} run"
        f"{'' if sum(r < 0.5 for r in quiet_runs('speed_ratio')) == 1 else 's'} of four (tiers_jax.json, "
        f"tiers_jax_run2.json, tiers_fit.json, tiers_fit_run2.json); the same tiered run on JAX, in a process without "
        f"TensorFlow, peaks at {min(quiet_runs('tiered_jax_peak_rss_bytes')) / 2**20:,.0f}-"
        f"{max(quiet_runs('tiered_jax_peak_rss_bytes')) / 2**20:,.0f} MiB RSS, under the 1 GiB limit"),
    "row_cache_one_call.json, row_cache_one_call_run2.json": lambda: (
        "since a request whose rows are all cached is answered in one graph call, "
        + one_call_span("warm") + "x with every row cached over four runs, " + one_call_span("cold")
        + "x with an empty cache, " + one_call_span("evicting") + "x evicting (row_cache_one_call.json, "
        "row_cache_one_call_run2.json)"),
    "row_cache_one_load.json, row_cache_one_load_run2.json, row_cache_one_call_run3.json": lambda: (
        "with one load call for the three tables' rows (row_cache_one_load.json, row_cache_one_load_run2.json; in "
        "memory p99 " + span([run["memory"]["p99_ms"] for name in ONE_LOAD for run in result(name)["runs"]], ".1f")
        + " ms on that host) the p50 is " + p50_span(ONE_LOAD, "cold") + "x in memory's with an empty cache and "
        + p50_span(ONE_LOAD, "evicting") + "x evicting, against " + p50_span(("row_cache_one_call_run3.json",), "cold")
        + "x and " + p50_span(("row_cache_one_call_run3.json",), "evicting")
        + "x for a load call per table on the same host (row_cache_one_call_run3.json); the p99 ratios did not "
        "move beyond their noise"),
    "freshness.json": lambda: (
        f"over {value('freshness.json', 'minutes')} minutes p50 {value('freshness.json', 'p50_s'):.1f} s,\n"
        f"p95 {value('freshness.json', 'p95_s'):.1f} s, max {value('freshness.json', 'max_s'):.1f} s, the cold first "
        f"minute {value('freshness.json', 'cold_first_minute_s'):.1f} s; the minute's Spark steps as the scheduler "
        f"ran them {value('freshness.json', 'minute_spark_in_run_p50_s'):.1f} s\nat the median, "
        f"{value('freshness.json', 'minute_spark_cold_s'):.1f} s cold; {value('freshness.json', 'failed_requests')} "
        f"failed of {value('freshness.json', 'requests'):,} requests"),
    "freshness_run2.json": lambda: (
        f"over {value('freshness_run2.json', 'minutes')} minutes p50 {value('freshness_run2.json', 'p50_s'):.1f} s, "
        f"p95 {value('freshness_run2.json', 'p95_s'):.1f} s, max {value('freshness_run2.json', 'max_s'):.1f} s, the "
        f"cold first minute {value('freshness_run2.json', 'cold_first_minute_s'):.1f} s: the p50 goal of 10 s "
        f"**not met** there; the step worker's memory, sampled every "
        f"{value('freshness_run2.json', 'step_worker_rss_mib.every_s'):.0f} s, "
        f"{worker_rss_after_minute(5)[0]:,.0f}-{worker_rss_after_minute(5)[1]:,.0f} MiB from the fifth minute on, "
        f"rising {worker_rss_slope():.1f} MiB a minute"),
    "freshness_run3.json": lambda: (
        f"p50 {value('freshness_run3.json', 'p50_s'):.1f} s, p95 {value('freshness_run3.json', 'p95_s'):.1f} s, "
        f"max {value('freshness_run3.json', 'max_s'):.1f} s, the cold first minute "
        f"{value('freshness_run3.json', 'cold_first_minute_s'):.1f} s; the worker "
        f"{worker_rss_after_minute(5, 'freshness_run3.json')[0]:,.0f}-"
        f"{worker_rss_after_minute(5, 'freshness_run3.json')[1]:,.0f} MiB, rising "
        f"{worker_rss_slope('freshness_run3.json'):.1f} MiB a minute"),
    "tiers.json, tiers_run0.json": lambda: (
        # ("zipf_1.05" holds a dot, so not through `value`)
        f"same AUC ({result('tiers.json')['zipf_1.05']['tiered_auc']:.4f} at Zipf 1.05), peak RSS "
        f"{result('tiers.json')['zipf_1.05']['peak_rss_bytes'] / 2**20:.0f} MiB, speed "
        f"{result('tiers.json')['zipf_1.05']['speed_ratio']:.3f}x of in memory (tiers.json; "
        f"{result('tiers_run0.json')['zipf_1.05']['speed_ratio']:.3f}x in tiers_run0.json, before the speed work)"),
    "tiers_run3.json, tiers_ranked.json": lambda: (
        f"{result('tiers_run3.json')['zipf_1.05']['speed_ratio']:.3f}x (tiers_run3.json, peak RSS "
        f"{result('tiers_run3.json')['zipf_1.05']['peak_rss_bytes'] / 2**20:.0f} MiB: over the limit's "
        f"{result('tiers_run3.json')['memory_limit_bytes'] / 2**20:.0f}), and "
        f"{result('tiers_ranked.json')['zipf_1.05']['speed_ratio']:.3f}x with the popular ids on the lowest rows"),
    "tiers_run7.json to tiers_run9.json, tiers_ranked_run2.json": lambda: (
        f"{min(tiers_figures('speed_ratio')):.3f}-{max(tiers_figures('speed_ratio')):.3f}x over three runs "
        f"(tiers_run7.json to tiers_run9.json; the tiered side {min(tiers_figures('tiered_ex_per_s')):,.0f}-"
        f"{max(tiers_figures('tiered_ex_per_s')):,.0f} ex/s), "
        f"{result('tiers_ranked_run2.json')['zipf_1.05']['speed_ratio']:.3f}x ranked (tiers_ranked_run2.json)"),
    "tiers_run5.json, tiers_run6.json, tiers_hot_1m.json, tiers_hot_1m_run2.json": lambda: (
        f"with the I/O threads alone {min(tiers_figures('speed_ratio', (5, 6))):.3f}-"
        f"{max(tiers_figures('speed_ratio', (5, 6))):.3f}x (tiers_run5.json, tiers_run6.json): the 0.5x goal was not "
        f"met, the step waiting on the write-back's page writes (docs/tiers.md). With 8x the hot rows inside the "
        f"same limit, {min(tiers_figures('speed_ratio', ('_hot_1m', '_hot_1m_run2'))):.3f}-"
        f"{max(tiers_figures('speed_ratio', ('_hot_1m', '_hot_1m_run2'))):.3f}x"),
    "tiers_log.json, tiers_log_run2.json": lambda: (
        f"With the rows written back appended to a log after the table, {min(log_runs('speed_ratio')):.3f}-"
        f"{max(log_runs('speed_ratio')):.3f}x over two runs (tiers_log.json, tiers_log_run2.json; the tiered side "
        f"{min(log_runs('tiered_ex_per_s')):,.0f}-{max(log_runs('tiered_ex_per_s')):,.0f} ex/s, the same AUC): the "
        f"goal is met on this day's machine, where the in-place store ran at "
        f"{min(log_runs('in_place_speed_ratio')):.3f}-{max(log_runs('in_place_speed_ratio')):.3f}x in the same runs; "
        f"the log is {min(log_runs('log_speedup')):.2f}-{max(log_runs('log_speedup')):.2f}x faster than it "
        f"({min(log_runs('log_speedup', '0.8')):.2f}-{max(log_runs('log_speedup', '0.8')):.2f}x at Zipf 0.8) and "
        f"writes {log_disk('tiered') / 1e6:.0f} MB to disk instead of {log_disk('tiered_in_place') / 1e9:.2f} GB"),
    "tiers_holes.json, tiers_holes_run2.json": lambda: (
        f"With rows on pages that hold no data drawn without a read, {min(holes_runs('speed_ratio')):.3f}-"
        f"{max(holes_runs('speed_ratio')):.3f}x (tiers_holes.json, tiers_holes_run2.json; the tiered side "
        f"{min(holes_runs('tiered_ex_per_s')):,.0f}-{max(holes_runs('tiered_ex_per_s')):,.0f} ex/s), "
        f"{min(holes_runs('speed_ratio', '0.8')):.3f}-{max(holes_runs('speed_ratio', '0.8')):.3f}x at Zipf 0.8"),
    "tiers_train_step.json, tiers_train_step_run2.json": lambda: (
        f"0.518-0.628x at Zipf 0.8. Through the pipeline's train step with the trainer's defaults (`--train-step`: "
        f"DCNv2, batches of {train_step_runs('batch_size', side='tiered')[0]:,}, one epoch), "
        f"{min(train_step_runs('speed_ratio')):.3f}-{max(train_step_runs('speed_ratio')):.3f}x by the step's own "
        f"examples/s over two runs, AUC {train_step_runs('tiered_auc')[0]:.4f} against "
        f"{train_step_runs('memory_auc')[0]:.4f} in memory, the whole step {min(train_step_runs('wall_ratio')):.2f}-"
        f"{max(train_step_runs('wall_ratio')):.2f}x faster than in memory (the in-memory side builds and writes its "
        f"4 GiB table: peak RSS {min(train_step_runs('peak_rss_bytes', side='memory')) / 2**20:,.0f}-"
        f"{max(train_step_runs('peak_rss_bytes', side='memory')) / 2**20:,.0f} MiB, "
        f"{train_step_runs('process_io', side='memory')[0]['write_bytes'] / 1e9:.1f} GB written), tiered peak RSS "
        f"{min(train_step_runs('peak_rss_bytes')) / 2**20:,.0f}-{max(train_step_runs('peak_rss_bytes')) / 2**20:,.0f} "
        f"MiB (tiers_train_step.json, tiers_train_step_run2.json); {min(train_step_runs('speed_ratio', '0.8')):.3f}-"
        f"{max(train_step_runs('speed_ratio', '0.8')):.3f}x at Zipf 0.8"),
    "multi_hash.json, multi_hash_run2.json, multi_hash_own_settings.json": lambda: (
        f"0.853 of the embedding memory saved for AUC {value('multi_hash.json', 'auc_difference'):.4f} "
        f"(multi_hash.json; a second run repeats it, multi_hash_run2.json), one hash function at the same memory "
        f"{value('multi_hash.json', 'other_settings.single_hash_same_memory.auc_difference'):.4f}; with the bench's "
        f"earlier settings of its own {value('multi_hash_own_settings.json', 'auc_difference'):.4f}"
        if round(value('multi_hash.json', 'embedding_memory_saved_ratio'), 3) == 0.853
        and value('multi_hash_run2.json', 'auc_difference') == value('multi_hash.json', 'auc_difference')
        else "multi_hash.json no longer holds 0.853 saved, or its second run differs"),
    "row_cache_eviction.json": lambda: (
        f"at 40 requests/s (2 runs of 2 rounds): {eviction_range('rows_loaded_per_request')}x the rows loaded a "
        f"request, and the server's mean time a request {eviction_range('server_mean_ms', 'evicting_preloaded')}x "
        f"the plain LRU's preloaded, {eviction_range('server_mean_ms', 'evicting')}x without a preload"),
    "row_cache_segmented.json": lambda: (
        f"a 2,000-row cache loads {rng2('row_cache_segmented.json', 'eviction_rows_loaded_ratio', 3)}x the rows a "
        f"plain LRU does, {segmented_eviction('evicting_preloaded_cold_segmented'):.1f} rows a request preloaded "
        f"against {segmented_eviction('evicting_preloaded_cold_lru'):.1f}"),
    "tier_step.json": lambda: (
        f"the tiered layer fed slot ids {pair_range('ranges.slots.p50_over_memory')}x the in-memory step's p50, "
        f"through the hot tier {pair_range('ranges.tiered.p50_over_memory')}x, with "
        f"{pair_range('ranges.tiered.prepare_cpu_ms_per_step')} ms of the producer's CPU a batch planning and "
        f"reading and {pair_range('ranges.tiered.apply_ms_per_step')} ms applying the plan; with the planner and "
        f"the log index in numpy instead of C, {pair_range('ranges.tiered_numpy.p50_over_memory')}x and "
        f"{pair_range('ranges.tiered_numpy.prepare_cpu_ms_per_step')} ms"),
    "tiers_native.json": lambda: (
        f"{native_range('speed_ratio')}x at Zipf 1.05 over seventeen runs of seven days (the in-memory side at "
        f"{native_range('memory_ex_per_s', ',.0f')} ex/s), where the same tiered run with them in numpy made "
        f"{native_range('numpy_speed_ratio')}x: C {native_range('native_speedup')}x numpy's speed in the same runs, "
        f"the same AUC (tiers_native.json to tiers_native_run17.json). The goal was missed once "
        f"({native_range('speed_ratio').split('-')[0]}); the run with the fastest in-memory side gave "
        f"{fastest_memory_run()['speed_ratio']:.3f}"),
    "tier_policy.json": lambda: (
        f"in one pass {round(100 * policy()['first_touch_misses'] / policy()['lru_misses'])} % of LRU's misses are "
        f"rows read for the first time, which every policy misses, and LFU saves "
        f"{100 * policy()['lfu_saves_of_lru_misses']:.1f} % of them; over three passes "
        f"{100 * policy()['passes_3']['lfu_saves_of_lru_misses']:.1f} % (tier_policy.json)"),
    "real_avazu_sample.json": lambda: (
        f"all three seeds were published with AUC "
        f"{value('real_avazu_sample.json', 'datasets.avazu_sample.auc_over_seeds.min'):.4f}, the baseline "
        f"{value('real_avazu_sample.json', 'datasets.avazu_sample.baseline_auc'):.4f} (real_avazu_sample.json)"),
    "spark.json": lambda: (
        f"the join runs at {value('spark.json', 'join_over_sql'):.2f}x the throughput of a plain dedup-and-join of "
        f"the same streams (goal 0.5), the feature state at {value('spark.json', 'features_over_count'):.2f}x one "
        f"groupBy().count() of the same columns (goal 0.5), the block TFRecords at "
        f"{value('spark.json', 'samples_stage_over_parquet'):.2f}x Spark's Parquet write"),
    "spark_spec_join.json": lambda: (
        f"the join stage took {value('spark_before_spec_join.json', 'join_s'):.2f} s before "
        f"(spark_before_spec_join.json, {value('spark_before_spec_join.json', 'commit')[:7]}) and "
        f"{span(values(SPEC_JOIN, 'join_s'), '.2f')} s after (spark_spec_join.json, spark_spec_join_run2.json), "
        f"join_over_sql {value('spark_before_spec_join.json', 'join_over_sql'):.3f} before and "
        f"{span(values(SPEC_JOIN, 'join_over_sql'), '.3f')} after, the steady minute "
        f"{value('spark_before_spec_join.json', 'minute_spark_s'):.2f} s before and "
        f"{span(values(SPEC_JOIN, 'minute_spark_s'), '.2f')} s after"),
}
SPEC_JOIN = ("spark_spec_join.json", "spark_spec_join_run2.json")


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_the_readme_quotes_the_result_files_figures(name):
    expected = normalized(FIGURES[name]())
    assert expected in normalized((REPO / "README.md").read_text()), (
        f"the README does not say {expected!r}, which is what {name} holds now: rerun-and-update the README, or "
        "the file was not rewritten by its benchmark")


def test_a_changed_figure_is_caught(tmp_path):
    """The check can fail: the README with one of the quoted figures changed no longer matches."""
    readme = normalized((REPO / "README.md").read_text())
    expected = normalized(FIGURES["quality.json"]())
    assert expected in readme
    changed = readme.replace(expected, expected.replace(f"{value('quality.json', 'auc'):.4f}", "0.9999"))
    assert expected not in changed
