"""The server's metrics in Prometheus' text exposition format 0.0.4, written by prometheus_client.

    ctr_requests_total{endpoint, code}        counter: every response, errors included (gRPC calls under grpc_*
                                              endpoints, with the HTTP status REST would answer)
    ctr_request_duration_seconds{endpoint}    histogram: responses of any status of the timed endpoints (predict,
                                              classify, regress and their gRPC twins), from request start to
                                              response end
    ctr_request_stage_seconds{endpoint, stage}  histogram: where an answered REST predict, classify or regress
                                              request spends its time, stage by stage (STAGES; not gRPC's): `read`
                                              the body received, `queue` from then until a worker thread starts it,
                                              `compute` the body read into the model's arguments and the model's
                                              call (the last try, where a delta moved the model on), `return`
                                              from its end until the event loop has the result; what is left of
                                              ctr_request_duration_seconds is routing and writing the answer
    ctr_predictions_total                     counter: instances predicted by successful predict, classify and
                                              regress calls
    ctr_model_loaded                          gauge: 1 while a model is loaded, else 0
    ctr_model_version                         gauge: the loaded version as a number (absent if not numeric)
    ctr_model_freshness_seconds               gauge: now - data_end (absent without data_end)
    ctr_model_info{version, parent, chain_root}  gauge: always 1; a missing parent or chain_root is ""
    ctr_gc_pause_seconds{generation}          histogram: CPython's garbage collections in the server process,
                                              each of which stops every request in flight (`GcPauses`; only
                                              where the process installs it, as serving.server does)

A model with tiered tables (`storage: tiered`) reads their rows through its row cache (serving.row_cache); per
table, from when its full version was loaded (its deltas keep the cache, a new full version starts at zero,
which Prometheus' `rate` reads as a counter reset):

    ctr_row_cache_hits_total{table}           counter: distinct rows a request read that were cached when it came
    ctr_row_cache_loads_total{table}          counter: rows loaded into the cache from the table's store (a row
                                              evicted and read again is loaded again)
    ctr_row_cache_rows{table}                 gauge: rows in the cache now
    ctr_row_cache_capacity_rows{table}        gauge: the cache's size in rows
    ctr_row_cache_delta_rows{table}           gauge: rows the version's deltas changed, kept beside the store
    ctr_row_cache_preloaded_rows{table}       gauge: rows loaded before the first request (the ones training
                                              read most; not in loads_total)
    ctr_row_cache_protected_rows{table}       gauge: rows in the cache's protected segment (read by more than
                                              one request, or preloaded; serving.row_cache "Eviction")
    ctr_row_cache_load_calls_total            counter: graph calls that wrote rows into the caches (one per
                                              request that missed a row, for all its tables, and one per delta
                                              that changed cached rows)
    ctr_row_cache_loaded_answers_total        counter: requests answered by the call that loaded their rows (a
                                              request that missed a row takes two graph calls where the export
                                              has the loaded endpoint, three where it has not)

The hit rate of a table over a window is rate(hits) / (rate(hits) + rate(loads)).

Counters live in one `ServerMetrics` per app; the model gauges are computed at scrape time from the model
serving then (`ModelInfo`), so they cannot go stale. The values are kept here and handed to prometheus_client
as metric families at each scrape (a custom collector): the GC pauses are recorded inside the collector's
callback, where no lock may be taken, and the client library's own metric objects take one.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Upper bounds in seconds; the +Inf bucket is implied.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# A request's stages, in order (ctr_request_stage_seconds), and their buckets: a thread hop is tenths of a ms.
STAGES = ("read", "queue", "compute", "return")
# After the stages in a REST answer's Server-Timing header (serving.app): the request's whole time in the app
# until its answer started.
APP_TIMING = "app"
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
SLOW_GC_S = 0.1  # collections at least this long are logged


@dataclass(frozen=True)
class ModelInfo:
    """Where the served model comes from and how old its newest data is, for /v1/models and /metrics."""

    version: str
    parent: str | None  # the version this one was fine-tuned from; None for a model trained in full
    chain_root: str | None  # the full model at the start of the parent chain
    data_end: str | None  # ISO-8601 UTC: the close of the newest minute of data in the model
    freshness_seconds: float | None  # now - data_end

    def as_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "parent": self.parent,
            "chain_root": self.chain_root,
            "data_end": self.data_end,
            "freshness_s": self.freshness_seconds,
        }


def describe_model(version: str, manifest: Mapping[str, Any], now: float) -> ModelInfo:
    """The lineage and freshness of a model from its manifest; `now` is seconds since the epoch."""
    parent = manifest.get("parent")
    chain_root = manifest.get("chain_root")
    if chain_root is None and parent is None:
        chain_root = version
    data_end = manifest.get("data_end")
    end = data_end_timestamp(version, data_end)
    freshness = None if end is None else now - end
    return ModelInfo(version, parent, chain_root, data_end, freshness)


def data_end_timestamp(version: str, data_end: Any) -> float | None:
    """`data_end` in seconds since the epoch (naive times taken as UTC); None if absent or unreadable.

    An unreadable value is logged rather than raised: it must not take down /metrics and its counters.
    """
    if data_end is None:
        return None
    try:
        end = datetime.fromisoformat(data_end)
    except (TypeError, ValueError):
        logger.warning(
            "model version %s has data_end %r in its manifest, expected an ISO-8601 time such as "
            "'2026-01-01T00:00:00+00:00'; its freshness is unknown", version, data_end,
        )
        return None
    return (end if end.tzinfo else end.replace(tzinfo=UTC)).timestamp()


@dataclass(frozen=True)
class RowCacheCounts:
    """A served model's row cache counters: per tiered table, `TieredRows.counters()`'s ("cache_rows", "cached",
    "rows_hit", "rows_loaded", "rows_preloaded", "delta_rows", "protected"), the graph calls that loaded rows, and
    the requests the loaded endpoint answered in the call that loaded their rows."""

    tables: Mapping[str, Mapping[str, int]]
    load_calls: int
    loaded_answers: int = 0


class ServerMetrics:
    """Request counters and latency histograms of `timed_endpoints`, safe to update from any thread.

    The histograms exist from the start, so a scrape before the first request reads zeros, not nothing.
    """

    def __init__(self, timed_endpoints: Iterable[str], buckets: Iterable[float] = DURATION_BUCKETS,
                 gc_pauses: GcPauses | None = None, staged_endpoints: Iterable[str] | None = None) -> None:
        """`staged_endpoints`: the timed endpoints whose stages are timed too (all of them by default)."""
        bounds = tuple(sorted(buckets))
        self.timed_endpoints = frozenset(timed_endpoints)
        self.staged_endpoints = self.timed_endpoints if staged_endpoints is None else frozenset(staged_endpoints)
        self.gc_pauses = gc_pauses
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = {}
        self._durations = {endpoint: _Histogram(bounds) for endpoint in self.timed_endpoints}
        self._stages = {(endpoint, stage): _Histogram(STAGE_BUCKETS) for endpoint in self.staged_endpoints
                        for stage in STAGES}
        self._predictions = 0

    def count_request(self, endpoint: str, code: int) -> None:
        with self._lock:
            key = (endpoint, code)
            self._requests[key] = self._requests.get(key, 0) + 1

    def observe_duration(self, endpoint: str, seconds: float) -> None:
        if endpoint not in self._durations:
            raise ValueError(f"endpoint {endpoint!r} is not timed; the timed ones are {sorted(self._durations)}")
        with self._lock:
            self._durations[endpoint].observe(seconds)

    def observe_stages(self, endpoint: str, seconds: Mapping[str, float]) -> None:
        """One answered request's time in each of STAGES (seconds by stage; every stage must be there)."""
        if set(seconds) != set(STAGES):
            raise ValueError(f"stages {sorted(seconds)} given; a request's stages are {list(STAGES)}")
        if endpoint not in self.staged_endpoints:
            raise ValueError(f"endpoint {endpoint!r} is not staged; the staged ones are "
                             f"{sorted(self.staged_endpoints)}")
        with self._lock:
            for stage, value in seconds.items():
                self._stages[(endpoint, stage)].observe(value)

    def count_predictions(self, num_instances: int) -> None:
        with self._lock:
            self._predictions += num_instances

    def render(self, model: ModelInfo | None, row_cache: RowCacheCounts | None = None) -> str:
        """The exposition text: the counters as they stand now and the gauges of `model` (None: none loaded);
        `row_cache`: the served model's row cache counters, where it has tiered tables."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(lambda: self.families(model, row_cache)))
        return generate_latest(registry).decode()

    def families(self, model: ModelInfo | None, row_cache: RowCacheCounts | None = None) -> list[Metric]:
        with self._lock:
            requests = CounterMetricFamily("ctr_requests", "Responses by endpoint and HTTP status code.",
                                           labels=["endpoint", "code"])
            for (endpoint, code), count in sorted(self._requests.items()):
                requests.add_metric([endpoint, str(code)], count)
            durations = HistogramMetricFamily("ctr_request_duration_seconds",
                                              "Time from request start to response end.", labels=["endpoint"])
            for endpoint in sorted(self._durations):
                self._durations[endpoint].add_to(durations, [endpoint])
            stages = HistogramMetricFamily("ctr_request_stage_seconds",
                                           "An answered request's time by stage: read, queue, compute, return.",
                                           labels=["endpoint", "stage"])
            for endpoint in sorted(self.staged_endpoints):
                for stage in STAGES:
                    self._stages[(endpoint, stage)].add_to(stages, [endpoint, stage])
            predictions = CounterMetricFamily("ctr_predictions", "Instances predicted.", value=self._predictions)
        out = [requests, durations, stages, predictions, *_model_families(model)]
        if row_cache is not None:
            out += _row_cache_families(row_cache)
        if self.gc_pauses is not None:
            out.append(self.gc_pauses.family())
        return out


class _Families:
    """A collector of the families a function returns at each scrape."""

    def __init__(self, families) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families()


class GcPauses:
    """CPython's garbage collections in this process, timed through gc.callbacks: a collection stops every
    thread, so every request in flight waits for it. A full collection took 0.3-0.35 s under bench-serving,
    most of it walking TensorFlow's modules (serving.server.freeze_imports takes those out; docs/serving.md).
    Kept as a histogram per generation for /metrics; those of SLOW_GC_S or more are also logged.

    The callback takes no lock: a collection can start inside any allocation, also one made while a lock is
    held. CPython runs one collection at a time and holds the GIL through it and its callbacks, so the
    histograms are never updated by two threads at once; a scrape copies them."""

    def __init__(self, buckets: Iterable[float] = GC_PAUSE_BUCKETS) -> None:
        bounds = tuple(sorted(buckets))
        self._histograms = {generation: _Histogram(bounds) for generation in range(3)}
        self._started: float | None = None
        self._started_cpu = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started, self._started_cpu = time.perf_counter(), time.thread_time()
            return
        if self._started is None:  # installed during a collection
            return
        seconds, self._started = time.perf_counter() - self._started, None
        generation = min(max(int(info.get("generation", 2)), 0), 2)
        self._histograms[generation].observe(seconds)
        if seconds >= SLOW_GC_S:
            logger.warning("garbage collection of generation %d stopped every request for %.3f s, %.3f s of it on "
                           "the CPU, on thread %s (%d objects collected)", generation, seconds,
                           time.thread_time() - self._started_cpu, threading.current_thread().name,
                           info.get("collected", 0))

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily("ctr_gc_pause_seconds",
                                       "CPython's garbage collections, each stopping every request in flight.",
                                       labels=["generation"])
        for generation, histogram in self._histograms.items():
            histogram.copy().add_to(family, [str(generation)])
        return family


class _Histogram:
    """Cumulative-bucket histogram state; the owner holds the lock."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
                break
        self.sum += value
        self.count += 1

    def copy(self) -> _Histogram:
        copied = _Histogram(self.buckets)
        copied.counts, copied.sum, copied.count = list(self.counts), self.sum, self.count
        return copied

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(labels, [*buckets, ("+Inf", self.count)], self.sum)


def _model_families(model: ModelInfo | None) -> list[Metric]:
    loaded = GaugeMetricFamily("ctr_model_loaded", "1 while a model version is loaded, else 0.",
                               value=int(model is not None))
    version = GaugeMetricFamily("ctr_model_version", "The loaded model version, as a number.")
    freshness = GaugeMetricFamily("ctr_model_freshness_seconds", "Seconds from the model's data_end to now.")
    info = GaugeMetricFamily("ctr_model_info", "The loaded model version and its lineage; always 1.",
                             labels=["version", "parent", "chain_root"])
    if model is not None:
        if model.version.isdigit():
            version.add_metric([], int(model.version))
        if model.freshness_seconds is not None:
            freshness.add_metric([], model.freshness_seconds)
        # A missing parent or chain_root is an empty label, which Prometheus reads as absent.
        info.add_metric([model.version, "" if model.parent is None else str(model.parent),
                         "" if model.chain_root is None else str(model.chain_root)], 1)
    return [loaded, version, freshness, info]


def _row_cache_families(counts: RowCacheCounts) -> list[Metric]:
    families = {
        key: kind(f"ctr_row_cache_{name}", text, labels=["table"])
        for key, (kind, name, text) in {
            "rows_hit": (CounterMetricFamily, "hits", "Distinct rows a request read that were cached when it came."),
            "rows_loaded": (CounterMetricFamily, "loads", "Rows loaded into the row cache from the table's store."),
            "cached": (GaugeMetricFamily, "rows", "Rows in the row cache now."),
            "cache_rows": (GaugeMetricFamily, "capacity_rows", "The row cache's size in rows."),
            "delta_rows": (GaugeMetricFamily, "delta_rows",
                           "Rows the version's deltas changed, kept beside the store."),
            "rows_preloaded": (GaugeMetricFamily, "preloaded_rows",
                               "Rows loaded before the first request, the ones training read most."),
            "protected": (GaugeMetricFamily, "protected_rows",
                          "Rows in the row cache's protected segment: read by more than one request, or preloaded."),
        }.items()}
    for table in sorted(counts.tables):
        for key, family in families.items():
            family.add_metric([table], counts.tables[table][key])
    calls = CounterMetricFamily("ctr_row_cache_load_calls", "Graph calls that wrote rows into the row caches.",
                                value=counts.load_calls)
    answers = CounterMetricFamily("ctr_row_cache_loaded_answers",
                                  "Requests answered by the graph call that loaded their rows.",
                                  value=counts.loaded_answers)
    return [*families.values(), calls, answers]
