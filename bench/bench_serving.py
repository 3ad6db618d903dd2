"""Serving latency: the model server pinned to one core, answering requests of 1, 100 and 1,000 candidates.

    make bench-serving                          # -> bench/results/serving.json (~4 min here)
    make bench-serving BENCH_SERVING_ARGS="--requests 100"

What it builds: a DCNv2 with the default training settings and the criteo spec, its feature state made from
generated rows (every value seen once admitted: about 60 K vocabulary entries over 26 tables), exported as the
pipeline exports it (raw inputs, the feature state inside the graph) and published to a local model store.
Three more full models, each with a delta on it (1 % of the embedding rows and every dense weight changed, one
value admitted), are published during the swap phase. Candidates are generated rows the state has not seen (so some
values are out of vocabulary, some missing), sent as TF-Serving `instances`.

Phases, in one run:
- in-process (this process pinned to the server's core, before the server starts): the SavedModel's signature
  called on tensors already built (`inprocess_*`), `LoadedModel.predict` on the instances (the request's
  conversion included, `inprocess_convert_*`), and the server's own way from a request body's bytes to its
  probabilities (the native row reader, `inprocess_body_*`; msgspec's typed records, the way it falls back to,
  `inprocess_body_records_*`);
- closed loop (one request in flight, keep-alive, the standard library's http.client): p50 and p99 per size; at
  100 candidates also with httpx as the client (`httpx_*`, the client of earlier runs), and GET /healthz (the
  HTTP round trip with no model work, `healthz_*`); then the same over gRPC with TF
  Serving's stub (`grpc_*`), one float32 or string tensor per feature;
- paired (`overhead_ratio_100`): served requests of 100 candidates alternated, in blocks, with the server's own
  call in this process (on the server's core, the same batches' arguments built beforehand); the ratio of their
  p99s. `overhead_ratio_100_separate_phases` is the closed loop's p99 over the in-process phase's, measured
  minutes apart on one batch, as the runs before the paired phase computed it;
- open loop at rising rates of 100-candidate requests until the server saturates, latency from each request's
  scheduled send time (bench/loadgen.py): the highest rate that it and every lower rate held at p99 <= 10 ms
  with every request answered (`max_rate_per_s_at_p99_10ms`);
- under load: 3,000 requests of 100 candidates at half that rate (`loaded_p99_ms_100`, the goal's figure:
  p99 <= 5 ms; skipped requests count as failed), the bodies encoded before the run and sent by http.client;
  then the same 3,000 sent by a compiled client (bench/native/openloop.c: one C thread, epoll, a timer at each
  send's time; `loaded_*_compiled_client`), to tell the Python client's own lateness from the server's;
  then the same 3,000 with the load generator's earlier client (httpx, each body encoded once due:
  `loaded_*_previous_client`), which added its own time to every request's latency;
- the server's own mean time a request by stage (its /metrics: ctr_request_stage_seconds and
  ctr_request_duration_seconds) over the paired phase's served requests, one at a time
  (`paired_stage_mean_ms_100`), and over the loaded phase (`loaded_stage_mean_ms_100`); and the loaded phase's
  requests one by one, from each answer's Server-Timing header: the slowest 1 % and the middle tenth taken
  apart into the client's delay before the send, the server's stages and the rest (`loaded_tail_ms_100`),
  each stage's p99 (`loaded_stage_p99_ms_100`, `loaded_server_stages_p99_ms_100`), and how many of each band
  left while an earlier request was unanswered, and how long until it was (`sent_behind_share`, `behind_ms`);
  what a first-in-first-out queue of one server makes of the same schedule with the times of the requests
  that found the server idle (`loaded_queued_alone_100`): the tail that waiting one's turn on one core gives;
- one request at a time after idle gaps of 0, 1, 3, 10 and 30 ms, taken in turn, 200 requests each
  (`idle_gaps_100`): what the idle gap before a request costs it, by the gap, with its stages;
- swaps: an open loop at the same rate while three full models, each followed by a delta on it, are
  published, each 6 s after the one before answered; a swap's window runs from its publish to 3 s after the
  new version's first answer; the p99 of the requests due in the windows (pooled by kind) over the p99 of
  the others (`swap_p99_ratio`); a version never served fails the run (`swaps_all_served`); and the server's
  garbage collections over 0.1 s, during the swaps and in the whole run (`swaps.server_gc_pauses`, from its
  log), each of which stopped every request in flight; every request of the phase drawn against time, by the
  version that answered it, in results/serving_swaps.png;
- closed loop at 100 candidates again after the swaps, on the last version published, a delta on a full model
  (`after_deltas_*`): what a server of minute-level deltas answers with most of the time.

The share of the host's CPU time its hypervisor gave other guests (steal, from psutil's CPU times) is recorded
over the run and each loaded phase (`host_steal_share`, `loaded_host_steal_share*`): the noise of a shared host,
beside the latencies it moves.

The server runs in its own process (`python -m serving.server`) under `taskset -c 0`; this process (the client)
pins itself to the other core. Latency is wall time at the client, HTTP included. The client's garbage collector
is off while it measures: it holds TensorFlow's modules, whose collections stalled its requests.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import psutil

from bench.loadgen import run_load
from bench.native_loadgen import available as native_loadgen_available
from bench.native_loadgen import run_load_native
from bench.provenance import provenance
from components.config import GenerateConfig, TrainConfig
from components.delta import delta_arrays, write_delta
from components.feature_spec import NUM_RESERVED_ROWS, load_spec
from components.feature_state import DenseTransform, FeatureState, Vocabulary, signed_log1p
from components.manifest import write_manifest
from components.model_store import LocalModelStore
from components.synthetic import generate_minute
from serving.metrics import APP_TIMING, SLOW_GC_S

MODEL_NAME = "ctr"
SIZES = (1, 100, 1000)
FIRST_VERSION = "202601010000"
# The swap phase publishes SWAP_ROUNDS full models, each followed by a delta on it: versions 202601010100,
# 202601010101, 202601010200, ...
SWAP_ROUNDS = 3
SWAP_WINDOW_S = 3.0  # requests due this long after a new version's first answer still count as during its swap
STEADY_S = 6.0  # steady state before each publish (after the one before was served)
SWAP_TIMEOUT_S = 60.0  # a version not answering this long after its publish was never served
LOADED_REQUESTS = 3000  # requests of the loaded phase, at half the highest rate held
COMPILED_CLIENT = "compiled"  # bench/native/openloop.c (bench.native_loadgen), beside the Python client
P99_LIMIT_MS = 10.0
SATURATED_P99_MS = 50.0
IN_PROCESS_BLOCK = 20
PAIRED_BLOCK = 20
SERVER_CORE, CLIENT_CORE = 0, 1
# The generated click log is in the criteo spec's layout; its columns come from that spec.
SPEC = load_spec("criteo")
DENSE, CATEGORICAL = SPEC.dense_names, SPEC.categorical_names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentiles(latencies_ms: list[float]) -> dict[str, float]:
    values = np.asarray(latencies_ms)
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
            "mean_ms": float(values.mean()), "n": int(values.size)}


# ---------------------------------------------------------------------------------------------------------
# The model

def feature_state(rows: int, seed: int) -> FeatureState:
    """Every value of `rows` generated rows admitted; room for 64 more rows a table; dense transforms from the
    rows' quantiles and moments (as the feature job computes them)."""
    table = generate_minute(GenerateConfig(rows_per_minute=rows, seed=seed), 0, datetime(2026, 1, 1, tzinfo=UTC)).table
    vocabularies = {}
    for name in CATEGORICAL:
        values = sorted({v for v in table.column(name).to_pylist() if v})
        count = len(values)
        vocabularies[name] = Vocabulary(tuple(values), tuple(range(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + count)),
                                        (5,) * count, (0,) * count, NUM_RESERVED_ROWS + count, (),
                                        NUM_RESERVED_ROWS + count + 64)
    dense = []
    for name in DENSE:
        values = signed_log1p(table.column(name).to_numpy(zero_copy_only=False).astype(np.float64))
        values = values[~np.isnan(values)]
        low, high = np.quantile(values, [0.001, 0.999])
        clipped = np.clip(values, low, high)
        dense.append(DenseTransform(name, float(low), float(high), float(clipped.mean()),
                                    float(clipped.std()) or 1.0))
    return FeatureState(version="bench", min_count=1, vocabularies=vocabularies, dense=tuple(dense))


def candidates(num: int, seed: int) -> list[dict[str, Any]]:
    """Generated rows as a client sends them: numbers and strings, missing values left out."""
    table = generate_minute(GenerateConfig(rows_per_minute=num, seed=seed), 1,
                            datetime(2026, 1, 2, tzinfo=UTC)).table
    columns = {name: table.column(name).to_pylist() for name in (*DENSE, *CATEGORICAL)}
    out = []
    for index in range(num):
        instance = {}
        for name in DENSE:
            if columns[name][index] is not None:
                instance[name] = float(columns[name][index])
        for name in CATEGORICAL:
            if columns[name][index]:
                instance[name] = columns[name][index]
        out.append(instance)
    return out


def export_full(model, state: FeatureState, spec, directory: Path, version: str,
                tiered: dict[str, Any] | None = None) -> Path:
    """The model exported as the pipeline exports it. `tiered`: the manifest's `tiered_serving` of a model whose
    tiered tables' stores are already in `directory` (bench_row_cache.py)."""
    from trainer.export import export_serving_model, weight_specs

    files = export_serving_model(model, state, directory, spec)
    files += [file for entry in (tiered or {}).values() for file in (entry["file"], entry.get("preload")) if file]
    write_manifest(directory, kind="full_model", version=version, files=files, spec_hash=spec.hash(),
                   extra={"parent": None, "chain_root": version, "weight_specs": weight_specs(model),
                          "feature_spec": {**spec.as_dict(), "hash": spec.hash()},
                          "data_end": "2026-01-01T00:00:00+00:00",
                          **({"tiered_serving": tiered} if tiered else {})})
    return directory


def build_models(work: Path, rows: int, swap_rounds: int = SWAP_ROUNDS) -> dict[str, Any]:
    """The first full model, and `swap_rounds` more full models of the same weights, each with a delta on it."""
    import keras

    from trainer.export import weight_specs
    from trainer.models import build_model

    keras.utils.set_random_seed(7)
    spec = SPEC
    state = feature_state(rows, seed=3)
    model = build_model(TrainConfig(), state.table_sizes(), spec)
    first = export_full(model, state, spec, work / "export" / FIRST_VERSION, FIRST_VERSION)
    # The delta: what a minute's training changes (a share of the embedding rows, every dense weight) and one
    # admitted value.
    rng = np.random.default_rng(5)
    parent_weights = [np.array(v) for v in model.weights]
    weights = []
    for value in parent_weights:
        changed = value.copy()
        if value.ndim == 2 and value.shape[0] > 10_000:  # the embedding table
            rows_changed = rng.choice(value.shape[0], size=value.shape[0] // 100, replace=False)
            changed[rows_changed] += rng.normal(0, 0.01, (len(rows_changed), value.shape[1])).astype(value.dtype)
        elif value.size:
            changed = changed + rng.normal(0, 1e-3, value.shape).astype(value.dtype)
        weights.append(changed)
    vocabulary = state.vocabularies[CATEGORICAL[0]]
    grown = Vocabulary((*vocabulary.values, "new-value"), (*vocabulary.rows, vocabulary.num_rows),
                       (*vocabulary.counts, 5), (*vocabulary.last_seen, 0), vocabulary.num_rows + 1, (),
                       vocabulary.capacity)
    next_state = FeatureState(version="bench-1", min_count=1,
                              vocabularies={**state.vocabularies, CATEGORICAL[0]: grown}, dense=state.dense)
    arrays = delta_arrays(parent_weights, weights, state, next_state)
    rounds, manifest = [], None
    for index in range(swap_rounds):
        full_version = f"20260101{index + 1:02d}00"
        delta_version = f"20260101{index + 1:02d}01"
        full = export_full(model, state, spec, work / "export" / full_version, full_version)
        manifest = write_delta(work / "export" / delta_version, arrays, version=delta_version, parent=full_version,
                               chain_root=full_version, weight_specs=weight_specs(model),
                               extra={"data_end": f"2026-01-01T{index + 1:02d}:01:00+00:00"}, spec_hash=spec.hash())
        rounds.append(((full_version, full), (delta_version, work / "export" / delta_version)))
    return {"first": first, "rounds": rounds, "delta_bytes": manifest["delta_bytes"] if manifest else None,
            "vocabulary_entries": sum(len(v) for v in state.vocabularies.values()),
            "embedding_rows": sum(state.table_sizes().values()), "num_weights": len(parent_weights)}


# ---------------------------------------------------------------------------------------------------------
# Phases

def in_process(directory: Path, batches: dict[int, list[dict]], repeats: int, precision: str) -> dict[str, Any]:
    """On the server's core, per size: the SavedModel's TF-Serving signature on tensors already built
    (`signature`); the packed endpoint the server calls, in each precision, as it calls it (PackedCall.call),
    on its arguments already built (`packed_float32`, `packed_bfloat16`); LoadedModel.predict on the instances
    at `precision`, conversion included (`predict_with_conversion`); and the server's way from a request body's
    bytes to the probabilities (`body_to_prediction`: serving.app.predict_body, the native row reader where it
    reads the body), and the typed records' way it falls back to (`body_records_to_prediction`). The calls take turns in
    blocks of IN_PROCESS_BLOCK, so the machine's drift falls on all alike while each is timed warm, as a server
    repeating it runs it."""
    import tensorflow as tf

    from serving.app import predict_body
    from serving.model import LoadedModel

    loaded = {p: LoadedModel.load(directory, precision=p) for p in ("float32", "bfloat16")}
    model = loaded[precision]
    out: dict[str, Any] = {}
    for size, instances in batches.items():
        converters = model.column_converters
        tensors = {name: tf.constant(converters[name]([row.get(name) for row in instances]), dtype=spec.dtype)
                   for name, spec in model.input_specs.items()}
        body = json.dumps({"instances": instances}).encode()
        calls = {"signature": functools.partial(model.function, **tensors),
                 "predict_with_conversion": functools.partial(model.predict, instances)}
        if model.row_decoder is not None:  # what the server does with a request's body
            calls["body_to_prediction"] = lambda body=body, size=size: predict_body(model, body, size)
            calls["body_records_to_prediction"] = lambda body=body: model.predict_records(model.decode_rows(body))
        for name, one in loaded.items():
            if one.packed is not None:
                columns = {k: convert([row.get(k) for row in instances]) for k, convert in
                           one.column_converters.items()}
                arguments = one.packed.arguments(columns, size, one.input_specs)
                calls[f"packed_{name}"] = functools.partial(one.packed.call, *arguments)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(max(1, repeats // max(1, size // 100) // IN_PROCESS_BLOCK)):
            for name, call in calls.items():
                for index in range(IN_PROCESS_BLOCK + 2):
                    start = time.perf_counter()
                    call()
                    if index >= 2:  # a call after another graph finds its weights out of the caches: a server
                        times[name].append((time.perf_counter() - start) * 1000)  # repeats the same one
        out[size] = {name: percentiles(values) for name, values in times.items()}
    return out


def closed_loop(url: str, bodies: dict[int, list[bytes]], repeats: int, client: str = "http.client"
                ) -> dict[int, dict[str, Any]]:
    """One request in flight, on one keep-alive connection. `client`: "http.client" (the standard library's,
    about 0.5 ms lighter per request than httpx on this machine, so the latency is more the server's) or
    "httpx" (the client of the bench's earlier runs, for comparison)."""
    out = {}
    with poster(url, client) as post:
        for size, payloads in bodies.items():
            count = max(20, repeats // max(1, size // 100))
            latencies, failed = [], 0
            for index in range(count + 10):
                body = payloads[index % len(payloads)]
                start = time.perf_counter()
                status = post(body)
                elapsed = (time.perf_counter() - start) * 1000
                if status != 200:
                    failed += 1
                elif index >= 10:  # the first requests warm the connection and the server's code paths
                    latencies.append(elapsed)
            out[size] = {**percentiles(latencies), "failed_requests": failed}
    return out


@contextmanager
def measuring_client() -> Iterator[None]:
    """This process as a load generator while it measures: on the client core (where the host has two or more),
    its heap frozen and its collector off, as bench-serving's own loaded phases run (a collection of a heap that
    imported TensorFlow stops the client's threads mid-request); all of it undone after."""
    cores = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {CLIENT_CORE})
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        os.sched_setaffinity(0, cores)


@contextmanager
def poster(url: str, client: str) -> Iterator[Callable[[bytes], int]]:
    """A function POSTing a JSON body to `url` on one keep-alive connection of `client` and returning the
    status once the response is read whole."""
    if client == "httpx":
        import httpx

        with httpx.Client(timeout=30.0) as session:
            yield lambda body: session.post(url, content=body, headers={"Content-Type": "application/json"}
                                            ).status_code
        return
    import http.client

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30.0)

    def post(body: bytes) -> int:
        connection.request("POST", parts.path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status

    try:
        yield post
    finally:
        connection.close()


IDLE_GAPS_MS = (0.0, 1.0, 3.0, 10.0, 30.0)  # the idle gaps before a request, one request at a time
IDLE_GAP_REQUESTS = 200  # requests after each gap


def idle_gaps(url: str, bodies: list[bytes], gaps_ms: Sequence[float] = IDLE_GAPS_MS,
              requests: int = IDLE_GAP_REQUESTS) -> dict[str, Any]:
    """What an idle gap before a request costs it: one request at a time on one keep-alive connection, each sent
    `gap` ms after the answer before it, the gaps taken in turn request by request (so that every gap sees the
    same minutes of the host), `requests` per gap after 10 to warm. Per gap (its key the gap in ms): p50 / p99
    of the latency, the gap actually left (mean), and the means of the server's stages, its time in the app
    and the rest outside the app, from each answer's Server-Timing header (serving/app.py)."""
    import http.client

    from bench.loadgen import SERVER_TIMING_HEADER, parse_server_timing

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30.0)
    seen: dict[float, list[tuple[float, float, dict[str, float]]]] = {gap: [] for gap in gaps_ms}
    failed = 0
    try:
        answered = time.perf_counter()
        for index in range(10 + requests * len(gaps_ms)):
            gap = gaps_ms[index % len(gaps_ms)]
            due = answered + gap / 1000.0
            while (left := due - time.perf_counter()) > 0:
                time.sleep(left - 0.001 if left > 0.002 else 0)  # sleep most of it, then yield until due
            sent = time.perf_counter()
            connection.request("POST", parts.path, body=bodies[index % len(bodies)],
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            answered = time.perf_counter()
            if response.status != 200:
                failed += 1
            elif index >= 10:
                seen[gap].append(((sent - due) * 1e3 + gap, (answered - sent) * 1e3,
                                  parse_server_timing(response.getheader(SERVER_TIMING_HEADER)) or {}))
    finally:
        connection.close()
    out: dict[str, Any] = {"failed_requests": failed}
    for gap, rows in seen.items():
        latency = np.array([row[1] for row in rows])
        timed = [row[2] for row in rows if row[2]]
        entry = {"requests": len(rows), "gap_ms": float(np.mean([row[0] for row in rows])) if rows else None,
                 **percentiles(list(latency))}
        if timed and all(APP_TIMING in t for t in timed):
            stages = np.array([sum(v for k, v in t.items() if k != APP_TIMING) for t in timed])
            app = np.array([t[APP_TIMING] for t in timed])
            answered_latency = np.array([row[1] for row in rows if row[2]])
            entry.update({"compute_ms": float(np.mean([t.get("compute", 0.0) for t in timed])),
                          "server_stages_ms": float(stages.mean()), "app_ms": float(app.mean()),
                          "rest_outside_app_ms": float((answered_latency - app).mean())})
        out[f"{gap:g}"] = entry
    return out


def paired_overhead(url: str, directory: Path, precision: str, instances: list[dict], bodies: list[bytes],
                    rounds: int) -> dict[str, Any]:
    """The overhead ratio's two sides in one phase: blocks of PAIRED_BLOCK served requests of 100 candidates
    (the closed loop's bodies, in turn) alternated with blocks of the server's own call in this process, on the
    server's core while the server waits: the packed endpoint at its precision (PackedCall.call) on the same
    batches' arguments, built beforehand. The two sides see the same machine minute by minute, and the call
    the same candidates the server gets, not one batch again and again (whose embedding rows stay in the
    caches: one batch's call took 0.89-0.90x the p50 of calls taking 20 batches in turn, docs/serving.md)."""
    from serving.model import LoadedModel

    model = LoadedModel.load(directory, precision=precision)
    assert model.packed is not None, "the bench's model is exported with packed endpoints"
    arguments = []
    for start in range(0, len(bodies) * 100, 100):
        batch = instances[start:start + 100]
        columns = {name: convert([row.get(name) for row in batch]) for name, convert in
                   model.column_converters.items()}
        arguments.append(model.packed.arguments(columns, len(batch), model.input_specs))
    served: list[float] = []
    called: list[float] = []
    failed = 0
    with poster(url, "http.client") as post:
        for round_index in range(rounds):
            order = ("served", "called") if round_index % 2 == 0 else ("called", "served")
            for side in order:
                if side == "called":
                    os.sched_setaffinity(0, {SERVER_CORE})
                for index in range(PAIRED_BLOCK + 2):
                    turn = (round_index * PAIRED_BLOCK + index) % len(bodies)
                    start = time.perf_counter()
                    if side == "served":
                        status = post(bodies[turn])
                        failed += status != 200
                    else:
                        model.packed.call(*arguments[turn]).numpy()
                    if index >= 2:  # the first of a block wakes the other side's caches
                        (served if side == "served" else called).append((time.perf_counter() - start) * 1000)
                if side == "called":
                    os.sched_setaffinity(0, {CLIENT_CORE})
    return {"served": percentiles(served), "in_process": percentiles(called), "failed_requests": failed,
            "block": PAIRED_BLOCK, "rounds": rounds}


def http_floor(url: str, repeats: int) -> dict[str, Any]:
    """GET /healthz on one keep-alive connection: HTTP and the server's event loop, with no model work."""
    import http.client

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30.0)
    latencies = []
    try:
        for index in range(repeats + 10):
            start = time.perf_counter()
            connection.request("GET", "/healthz")
            connection.getresponse().read()
            if index >= 10:
                latencies.append((time.perf_counter() - start) * 1000)
    finally:
        connection.close()
    return percentiles(latencies)


def predict_requests(instances: list[dict], size: int, count: int) -> list[Any]:
    """gRPC PredictRequests of `size` candidates as a TF Serving client builds them: one tensor per feature,
    float32 with NaN for a missing number, strings with "" for a missing id."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    requests = []
    for start in range(0, min(len(instances) - size, count * size) + 1, size):
        rows = instances[start:start + size]
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        for name in DENSE:
            values = np.array([row.get(name, np.nan) for row in rows], dtype=np.float32)
            request.inputs[name].CopyFrom(tf.make_tensor_proto(values))
        for name in CATEGORICAL:
            request.inputs[name].CopyFrom(tf.make_tensor_proto([row.get(name, "") for row in rows]))
        requests.append(request)
    return requests


def grpc_closed_loop(port: int, requests: dict[int, list[Any]], repeats: int) -> dict[int, dict[str, Any]]:
    """The closed loop over gRPC with TF Serving's own stub: one Predict in flight."""
    import grpc
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    out = {}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for size, batch in requests.items():
            count = max(20, repeats // max(1, size // 100))
            latencies, failed = [], 0
            for index in range(count + 10):
                start = time.perf_counter()
                try:
                    stub.Predict(batch[index % len(batch)], timeout=30)
                except grpc.RpcError:
                    failed += 1
                    continue
                if index >= 10:
                    latencies.append((time.perf_counter() - start) * 1000)
            out[size] = {**percentiles(latencies), "failed_requests": failed}
    return out


def hundred_body_list(instances: list[dict]) -> list[bytes]:
    """The distinct bodies of `hundreds(instances)`, encoded: request i's is the (i % their number)th."""
    make = hundreds(instances)
    period = (len(instances) - 100) // math.gcd(100, len(instances) - 100)
    return [json.dumps({"instances": make(index)}).encode() for index in range(period)]


def hundred_bodies(instances: list[dict]) -> Callable[[int], bytes]:
    """Request i's body of `hundreds(instances)(i)`, every distinct one encoded once, beforehand."""
    bodies = hundred_body_list(instances)
    return lambda index: bodies[index % len(bodies)]


def hundreds(instances: list[dict]) -> Callable[[int], list[dict]]:
    """Request i's 100 candidates: a window of `instances` that moves by 100 each request."""
    def make(index: int) -> list[dict]:
        offset = (index * 100) % (len(instances) - 100)
        return instances[offset:offset + 100]
    return make


def open_loop(url: str, instances: list[dict], start_rate: float, seconds: float) -> dict[str, Any]:
    """Rising rates of 100-candidate requests (x1.4 each step) until the server saturates (p99 over
    SATURATED_P99_MS, or requests skipped or failed), latency from each request's scheduled send time.

    `max_rate_per_s_at_p99_10ms`: the highest rate such that it and every lower rate tried held p99 <= P99_LIMIT_MS
    with every request answered; None when the first rate missed. `max_candidates_per_s_at_p99_10ms` keeps the
    definition of the runs before (kept beside, not a goal): the highest rate whose p99 from the actual send
    time held the limit, even above a rate that missed it."""
    make = hundred_bodies(instances)
    steps, held, held_service, failed, missed = [], None, None, 0, False
    rate = start_rate
    while rate < 10_000:
        result = run_load(url, make_body=make, rate_per_s=rate, duration_s=seconds, concurrency=16, timeout_s=10.0)
        failed += result.failed_requests
        p99, service_p99 = result.latency_p99_ms, result.service_percentile_ms(99)
        steps.append({"rate_per_s": round(rate, 1), "p50_ms": result.latency_p50_ms, "p99_ms": p99,
                      "service_p99_ms": service_p99, "sent": result.num_requests, "skipped": result.skipped,
                      "failed": result.failed_requests})
        print(f"  open loop {rate:7.1f} req/s: p50 {result.latency_p50_ms:.2f} ms, p99 {p99:.2f} ms (from the send: "
              f"{service_p99:.2f} ms), skipped {result.skipped}, failed {result.failed_requests}", flush=True)
        if p99 is None or p99 > SATURATED_P99_MS or result.unanswered:
            break
        if p99 <= P99_LIMIT_MS and not missed:
            held = rate
        missed = missed or p99 > P99_LIMIT_MS
        if service_p99 is not None and service_p99 <= P99_LIMIT_MS:
            held_service = rate
        rate *= 1.4
    return {"steps": steps, "max_rate_per_s_at_p99_10ms": held,
            "max_candidates_per_s_at_p99_10ms": None if held_service is None else held_service * 100,
            "failed_requests": failed}


def loaded(url: str, instances: list[dict], rate: float, requests: int, client: str = "http.client",
           build_ahead: bool = True, by_tenths: bool = False) -> dict[str, Any]:
    """`requests` requests of 100 candidates at a fixed `rate`, latency from each one's scheduled send time;
    skipped and failed requests counted together as unanswered. `client` and `build_ahead`: bench.loadgen's (with
    `build_ahead` the bodies are encoded before the run, without it each once its request is due), or
    COMPILED_CLIENT (bench.native_loadgen, the same bodies, encoded before the run). `by_tenths`: also p50 / p99
    over each tenth of the answered requests in the order they were due (`tenths`)."""
    times = psutil.cpu_times()
    if client == COMPILED_CLIENT:
        result = run_load_native(url, hundred_body_list(instances), rate_per_s=rate, requests=requests,
                                 concurrency=16, timeout_s=10.0)
    else:
        bodies = {"make_body": hundred_bodies(instances)} if build_ahead else {"make_instances": hundreds(instances)}
        result = run_load(url, **bodies, rate_per_s=rate, duration_s=requests / rate + 1.0, max_requests=requests,
                          concurrency=16, timeout_s=10.0, client=client, build_ahead=build_ahead)
    out = {"rate_per_s": rate, "requests": result.num_requests + result.skipped, "p50_ms": result.latency_p50_ms,
           "p99_ms": result.latency_p99_ms, "service_p99_ms": result.service_percentile_ms(99),
           "skipped": result.skipped, "failed": result.failed_requests, "unanswered": result.unanswered}
    out["host_steal_share"] = steal_share(times, psutil.cpu_times())
    out.update(where_time_went(result.records))
    if by_tenths:
        answered = [r for r in sorted(result.records, key=lambda r: r.scheduled_at_s) if r.status == 200]
        tenth = max(1, len(answered) // 10)
        tenths = [[r.latency_s * 1e3 for r in answered[i:i + tenth]] for i in range(0, tenth * 10, tenth)]
        out["tenths"] = [{"p50_ms": float(np.percentile(t, 50)), "p99_ms": float(np.percentile(t, 99))}
                         for t in tenths if t]
    return out


def print_tail(phase: dict[str, Any]) -> None:
    """A loaded phase's bands (where_time_went) and what queueing alone would make of its schedule."""
    for band in ("middle_tenth", "slowest_1pct"):
        if band in phase:
            print(f"  {band}: " + ", ".join(f"{k} {v:.2f}" for k, v in phase[band].items() if k != "requests"),
                  flush=True)
    alone = phase.get("queued_alone")
    if alone:
        print(f"  one server's queue, the same schedule, idle-server times (p50 {alone['idle_service_p50_ms']:.2f} "
              f"ms): p50 {alone['p50_ms']:.2f} ms, p99 {alone['p99_ms']:.2f} ms; sent behind another: "
              f"{phase['sent_behind_share']:.1%}", flush=True)


def steal_share(before: Any, after: Any) -> float | None:
    """The share of the host's CPU time between two `psutil.cpu_times()` that the hypervisor gave to other
    guests (steal): how much this machine's neighbours took while it measured. None where the kernel does not
    say (no `steal` field)."""
    if not hasattr(after, "steal"):
        return None
    # Linux's fields; guest time is counted in user's already.
    counted = [name for name in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
               if hasattr(after, name)]
    total = sum(getattr(after, name) - getattr(before, name) for name in counted)
    return (after.steal - before.steal) / total if total > 0 else None


def sent_behind(records: list[Any]) -> dict[int, float]:
    """For each sent request (by its index in `records`), how long it still had to wait, when it left the
    client, for the requests sent before it to be answered (seconds; 0 when none was in flight): on a server of
    one core, the time it queues behind them. A request without an answer counts as in flight until its
    timeout or error (its `service_s`)."""
    order = sorted(range(len(records)), key=lambda i: records[i].sent_at_s)
    behind, last_done = {}, float("-inf")
    for i in order:
        record = records[i]
        behind[i] = max(0.0, last_done - record.sent_at_s)
        last_done = max(last_done, record.sent_at_s + record.service_s)
    return behind


def queued_alone(records: list[Any], seed: int = 0) -> dict[str, float] | None:
    """What queueing alone would make of the run's schedule: a first-in-first-out queue of one server, the
    requests arriving at their scheduled send times, each served in a time drawn (seeded) from the answered
    requests that left to an idle server (sent_behind 0, their time from the send). Its p50 / p99 (ms) beside the
    drawn times' own; None with fewer than 100 such requests. Measured latency over this is what the server adds
    under load beyond waiting its turn; this over the drawn times' is what the turn costs."""
    behind = sent_behind(records)
    idle = np.array([r.service_s for i, r in enumerate(records) if r.status == 200 and behind[i] == 0.0])
    if len(idle) < 100:
        return None
    scheduled = np.sort(np.array([r.scheduled_at_s for r in records]))
    service = np.random.default_rng(seed).choice(idle, size=len(scheduled))
    latency, free_at = np.empty(len(scheduled)), float("-inf")
    for n, (due, takes) in enumerate(zip(scheduled, service, strict=True)):
        free_at = max(due, free_at) + takes
        latency[n] = free_at - due
    return {"p50_ms": float(np.percentile(latency, 50) * 1e3), "p99_ms": float(np.percentile(latency, 99) * 1e3),
            "idle_service_p50_ms": float(np.percentile(idle, 50) * 1e3),
            "idle_service_p99_ms": float(np.percentile(idle, 99) * 1e3), "idle_requests": len(idle)}


def where_time_went(records: list[Any]) -> dict[str, Any]:
    """Each answered request's latency taken apart by its Server-Timing header (serving/app.py): the server's
    stages, the client's delay before the send (from the scheduled send time to the actual one), and the rest
    (the connection and the kernel both ways, the client reading the answer, and the server's routing and
    writing of the answer, which its stages leave out). Means over the slowest 1 % of the requests (at or over
    their p99) and over the middle tenth (45th-55th percentiles), beside each stage's own p99; {} when the server
    sent no Server-Timing. Where the header also says the request's whole time in the app (serving.app's
    APP_TIMING), the rest is split into the app's part outside the stages (`rest_in_app_ms`) and the part
    outside the app (`rest_outside_app_ms`).

    Beside them, in each band, how many of its requests left while an earlier one was still unanswered
    (`sent_behind_share`) and the mean time until the earlier ones' last answer (`behind_ms`, 0 for a request
    sent to an idle server; sent_behind): what queueing behind other requests explains of the band's latency.
    `sent_behind_share` over all answered requests is the run's own."""
    behind_of = sent_behind(records)
    timed_at = [i for i, r in enumerate(records) if r.status == 200 and r.server_ms]
    if not timed_at:
        return {}
    timed = [records[i] for i in timed_at]
    behind = np.array([behind_of[i] * 1e3 for i in timed_at])
    latency = np.array([r.latency_s * 1e3 for r in timed])
    stages = [stage for stage in timed[0].server_ms if stage != APP_TIMING]
    parts = {stage: np.array([r.server_ms.get(stage, 0.0) for r in timed]) for stage in stages}
    delay = np.array([(r.latency_s - r.service_s) * 1e3 for r in timed])
    server = sum(parts.values())
    # The request's whole time in the app until its answer started, where the server says it (serving.app).
    app = np.array([r.server_ms.get(APP_TIMING, np.nan) for r in timed])

    def means(chosen: np.ndarray) -> dict[str, float]:
        out = {"requests": int(chosen.sum()), "latency_ms": float(latency[chosen].mean()),
               "send_delay_ms": float(delay[chosen].mean()), "server_stages_ms": float(server[chosen].mean()),
               **{f"{stage}_ms": float(parts[stage][chosen].mean()) for stage in stages},
               "rest_ms": float((latency - delay - server)[chosen].mean()),
               "sent_behind_share": float((behind[chosen] > 0).mean()), "behind_ms": float(behind[chosen].mean())}
        if not np.isnan(app[chosen]).any():
            # The rest split in two: the app's own outside the stages (routing, building the answer), and
            # outside the app (the server's HTTP parsing and its event loop before the app, writing the
            # answer, the kernel both ways and the client).
            out["app_ms"] = float(app[chosen].mean())
            out["rest_in_app_ms"] = float((app - server)[chosen].mean())
            out["rest_outside_app_ms"] = float((latency - delay - app)[chosen].mean())
        return out

    low, high, top = np.percentile(latency, [45, 55, 99])
    return {"slowest_1pct": means(latency >= top), "middle_tenth": means((latency >= low) & (latency <= high)),
            "stage_p99_ms": {stage: float(np.percentile(parts[stage], 99)) for stage in stages},
            "server_stages_p99_ms": float(np.percentile(server, 99)), "timed_requests": len(timed),
            "sent_behind_share": float((behind > 0).mean()), "queued_alone": queued_alone(records)}


def swaps(url: str, port: int, instances: list[dict], store: LocalModelStore, models: dict[str, Any], rate: float,
          plot_path: Path | None = None) -> dict[str, Any]:
    """An open loop at `rate` while SWAP_ROUNDS full models, each followed by a delta on it, are published.

    Each publish waits for the one before to answer (at most SWAP_TIMEOUT_S) and then STEADY_S more, so every
    version gets its own swap. A swap's window runs from its publish to SWAP_WINDOW_S after the first request
    the new version answered (by scheduled send time): it holds the load and the switch, wherever they fall.
    The requests in the windows of full publishes are pooled into `full_swap`, of delta publishes into
    `delta_swap`; every other request after the first second is steady state. `all_served` is false when a
    version published never answered a request. `publish_window_p99_ms` keeps the definition of the runs before
    (the SWAP_WINDOW_S after each publish, latency from the actual send), for comparison."""
    published: list[tuple[str, str, float]] = []  # (kind, version, when)
    stop = threading.Event()
    time.sleep(2.0)  # the open loop's last step went past saturation: its backlog drains first

    def wait_served(version: str) -> None:
        deadline = time.time() + SWAP_TIMEOUT_S
        while time.time() < deadline:
            try:
                if served_version(port) == version:
                    return
            except Exception:  # noqa: BLE001 - a status poll that fails mid-swap is retried; the load records tell
                pass
            time.sleep(0.05)

    def publish() -> None:
        try:
            for (full_version, full), (delta_version, delta) in models["rounds"]:
                for kind, version, directory in (("full", full_version, full), ("delta", delta_version, delta)):
                    time.sleep(STEADY_S)
                    published.append((kind, version, time.time()))
                    store.publish(MODEL_NAME, version, directory)
                    wait_served(version)
            time.sleep(STEADY_S)
        finally:
            stop.set()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    longest_s = SWAP_ROUNDS * 2 * (STEADY_S + SWAP_TIMEOUT_S) + 2 * STEADY_S  # the publisher's stop ends it sooner
    result = run_load(url, make_body=hundred_bodies(instances), rate_per_s=rate, duration_s=longest_s, concurrency=16,
                      timeout_s=10.0, stop_event=stop)
    thread.join()
    records = [r for r in result.records if r.status == 200]
    start = result.records[0].scheduled_at_s + 1.0 if result.records else 0.0
    windows = []  # (kind, version, published, first answer or None, window end)
    for kind, version, when in published:
        first = min((r.scheduled_at_s for r in records if r.version == version), default=None)
        end = (first if first is not None else when + SWAP_TIMEOUT_S) + SWAP_WINDOW_S
        windows.append((kind, version, when, first, end))

    def during(kind: str | None, record: Any) -> bool:
        return any(begin <= record.scheduled_at_s < end for k, _, begin, _, end in windows
                   if kind is None or k == kind)

    def during_publish_window(kind: str, record: Any) -> bool:
        return any(when <= record.sent_at_s < when + SWAP_WINDOW_S for k, _, when in published if k == kind)

    steady = [r for r in records if r.scheduled_at_s >= start and not during(None, r)]
    out: dict[str, Any] = {"rate_per_s": rate, "rounds": SWAP_ROUNDS, "failed_requests": result.failed_requests,
                           "skipped": result.skipped, "unanswered": result.unanswered,
                           "steady": percentiles([r.latency_s * 1000 for r in steady]),
                           "all_served": all(first is not None for *_, first, _ in windows),
                           "never_served": [version for _, version, _, first, _ in windows if first is None]}
    publish_steady = [r.service_s * 1000 for r in records if r.sent_at_s >= start
                      and not any(during_publish_window(k, r) for k in ("full", "delta"))]
    out["publish_window_steady_p99_ms"] = percentiles(publish_steady)["p99_ms"] if publish_steady else None
    for kind in ("full", "delta"):
        latencies = [r.latency_s * 1000 for r in records if during(kind, r)]
        out[f"{kind}_swap"] = percentiles(latencies) if latencies else None
        if out[f"{kind}_swap"] is not None:
            # When each new version first answered, seconds after its publish (None: never).
            out[f"{kind}_swap"]["answered_after_s"] = [None if first is None else round(first - when, 2)
                                                       for k, _, when, first, _ in windows if k == kind]
        old = [r.service_s * 1000 for r in records if during_publish_window(kind, r)]
        out[f"{kind}_swap_publish_window_p99_ms"] = percentiles(old)["p99_ms"] if old else None
    out["versions_seen"] = sorted({v for _, v in result.versions if v})
    if plot_path is not None:
        out["plot"] = plot_swaps(records, windows, start, plot_path)
    return out


def plot_swaps(records: list[Any], windows: list[tuple[str, str, float, float | None, float]], start: float,
               path: Path) -> str:
    """Each request of the swap phase as a point (when it was due, its latency), coloured by the version that
    answered, with every publish marked and its window (to SWAP_WINDOW_S after the version's first answer)
    shaded: the picture of what a swap costs, and when."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    origin = start - 1.0
    versions = sorted({r.version for r in records if r.version})
    fig, ax = plt.subplots(figsize=(11, 3.6))
    colors = plt.get_cmap("tab10")
    for index, version in enumerate(versions):
        points = [(r.scheduled_at_s - origin, r.latency_s * 1000) for r in records if r.version == version]
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=5, color=colors(index % 10), label=version)
    for kind, version, when, first, end in windows:
        ax.axvspan(when - origin, end - origin, color="0.85" if kind == "full" else "0.93", zorder=0)
        ax.axvline(when - origin, color="black" if kind == "full" else "0.5", linewidth=0.8)
        label = f"{kind} {version[-4:]}" + ("" if first is not None else " (never served)")
        ax.text(when - origin, 1.02, label, transform=ax.get_xaxis_transform(), fontsize=7)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel(f"seconds into the swap phase, by scheduled send time (a line: a publish; shaded: its window, "
                  f"to {SWAP_WINDOW_S:g} s after the version's first answer)")
    ax.set_ylabel("latency (ms)")
    ax.legend(title="answered by", fontsize=7, title_fontsize=7, markerscale=3, loc="upper right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    repo = Path(__file__).resolve().parents[1]
    return str(path.relative_to(repo)) if path.resolve().is_relative_to(repo) else str(path)


def slow_collections(log: Path, start: int = 0) -> dict[str, dict[str, float]]:
    """The server's garbage collections of SLOW_GC_S or more (each stopped every request in flight that long), per
    generation: how many and their seconds, from its log after byte `start`. The log, not /metrics: the server
    processes that wrote it come and go with full versions (serving.handoff), and each counts its own."""
    text = log.read_bytes()[start:].decode(errors="replace")
    out = {generation: {"slow": 0, "seconds": 0.0} for generation in ("0", "1", "2")}
    for generation, seconds in re.findall(r"garbage collection of generation (\d) stopped every request for "
                                          r"([0-9.]+) s", text):
        out[generation]["slow"] += 1
        out[generation]["seconds"] = round(out[generation]["seconds"] + float(seconds), 3)
    return out


def stage_totals(port: int) -> dict[str, float]:
    """The server's predict time so far, from /metrics: the sums and counts of ctr_request_duration_seconds and
    of each stage of ctr_request_stage_seconds (serving.metrics.STAGES)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for item in family.samples:
            if item.labels.get("endpoint") != "predict" or not item.name.endswith(("_sum", "_count")):
                continue
            if item.name.startswith("ctr_request_duration_seconds"):
                totals[item.name.rsplit("_", 1)[1]] = item.value
            elif item.name.startswith("ctr_request_stage_seconds"):
                totals[f"{item.labels['stage']}_{item.name.rsplit('_', 1)[1]}"] = item.value
    return totals


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The mean ms a predict request spent in each stage between two stage_totals, its whole mean time
    (`total`), and what the stages leave of it (`rest`: routing, and writing the answer)."""
    from serving.metrics import STAGES

    means = {stage: 1e3 * (after[f"{stage}_sum"] - before[f"{stage}_sum"])
             / max(after[f"{stage}_count"] - before[f"{stage}_count"], 1) for stage in STAGES}
    means["total"] = 1e3 * (after["sum"] - before["sum"]) / max(after["count"] - before["count"], 1)
    means["rest"] = means["total"] - sum(means[stage] for stage in STAGES)
    return means


def served_version(port: int) -> str:
    """The version the server answers predictions with now: the newest it lists (TF Serving's model status)."""
    import httpx

    status = httpx.get(f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}", timeout=5.0).json()
    return max((str(v["version"]) for v in status["model_version_status"]), key=int)


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the vector extensions the model's speed depends on (/proc/cpuinfo): without
    AVX-512 float32 products have half the vector width, and without AVX512_BF16 or AMX bfloat16 is emulated."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"model": model, **{flag: flag in flags for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}}


def start_server(work: Path, store_root: Path, port: int, grpc_port: int, precision: str = "float32",
                 settings: Sequence[str] = ()) -> subprocess.Popen:
    """`settings`: more `--set` overrides for the server (bench_native_rows.py's `serving.native_rows=false`)."""
    command = [sys.executable, "-m", "serving.server", "--set", f"paths.data_root={work / 'data'}",
               "--set", f"serving.precision={precision}",
               "--set", f"paths.model_store={store_root}", "--set", f"serving.port={port}",
               "--set", f"serving.grpc_port={grpc_port}",
               "--set", "serving.poll_seconds=0.5", *(part for setting in settings for part in ("--set", setting))]
    if shutil.which("taskset"):
        command = ["taskset", "-c", str(SERVER_CORE), *command]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = open(work / "server.log", "wb")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (the server stops its REST, gRPC and watcher), SIGKILL if it is still there after 30 s."""
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def wait_healthy(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    """Until /healthz answers 200 and, where the server keeps a standby process (serving.handoff), that one has
    started: its start-up takes the server's core for seconds, at a low priority, which is not steady state."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the model server exited with {process.returncode}; see {log}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
            if answer.status_code == 200 and answer.json().get("standby", "ready") == "ready":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the model server did not answer /healthz within {timeout_s} s; see {log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="closed-loop requests of 100 candidates "
                        "(1 candidate: the same; 1,000: a tenth)")
    parser.add_argument("--state-rows", type=int, default=20_000, help="generated rows the vocabularies hold")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="length of each open-loop rate step")
    parser.add_argument("--loaded-requests", type=int, default=LOADED_REQUESTS,
                        help=f"requests of the loaded phase (default {LOADED_REQUESTS})")
    parser.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temporary directory)")
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                        help="serving.precision of the server (results: serving.json for float32, "
                             "serving_bfloat16.json for bfloat16)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    started = time.perf_counter()
    run_times = psutil.cpu_times()
    compiled_missing = native_loadgen_available()  # None, or why the compiled client cannot be built here
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print("building the model, its feature state and a delta ...", flush=True)
        models = build_models(work, args.state_rows)
        instances = candidates(5_000, seed=11)
        batches = {size: instances[:size] for size in SIZES}
        bodies = {size: [json.dumps({"instances": instances[i:i + size]}).encode()
                         for i in range(0, min(len(instances) - size, 20 * size) + 1, size)] for size in SIZES}
        print("in-process calls on the server's core ...", flush=True)
        if cores > 1:
            os.sched_setaffinity(0, {SERVER_CORE})
        inprocess = in_process(models["first"], batches, args.requests, args.precision)
        if cores > 1:
            os.sched_setaffinity(0, {CLIENT_CORE})
        store_root = work / "store"
        store = LocalModelStore(store_root)
        store.publish(MODEL_NAME, FIRST_VERSION, models["first"])
        port, grpc_port = free_port(), free_port()
        grpc_requests = {size: predict_requests(instances, size, 20) for size in SIZES}
        server = start_server(work, store_root, port, grpc_port, args.precision)
        # This process imported TensorFlow to build the models: a full collection of its heap stopped the
        # client's threads for 0.03-0.26 s mid-request, which read as the server's latency. Its heap is frozen
        # and its collector off while it measures (timeit turns the collector off for the same reason).
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            wait_healthy(port, server, work / "server.log")
            url = f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict"
            print("closed loop ...", flush=True)
            served_call = f"packed_{args.precision}"
            closed = closed_loop(url, bodies, args.requests)
            closed_httpx = closed_loop(url, {100: bodies[100]}, args.requests, client="httpx")[100]
            floor = http_floor(url, args.requests)
            for size in SIZES:
                print(f"  {size:5d} candidates: p50 {closed[size]['p50_ms']:.2f} ms, p99 {closed[size]['p99_ms']:.2f} "
                      f"ms (in-process: {served_call} p99 {inprocess[size][served_call]['p99_ms']:.2f} ms, signature "
                      f"p99 {inprocess[size]['signature']['p99_ms']:.2f} ms)", flush=True)
            print(f"    100 candidates with httpx as the client: p50 {closed_httpx['p50_ms']:.2f} ms, p99 "
                  f"{closed_httpx['p99_ms']:.2f} ms; GET /healthz: p50 {floor['p50_ms']:.2f} ms, p99 "
                  f"{floor['p99_ms']:.2f} ms", flush=True)
            print("served requests and the server's call in-process, alternated ...", flush=True)
            totals = stage_totals(port)
            paired = paired_overhead(url, models["first"], args.precision, instances, bodies[100],
                                     rounds=max(10, 2 * args.requests // PAIRED_BLOCK))
            paired_stages = stage_means(totals, stage_totals(port))
            print(f"    100 candidates: served p50 {paired['served']['p50_ms']:.2f} ms, p99 "
                  f"{paired['served']['p99_ms']:.2f} ms; in-process p50 {paired['in_process']['p50_ms']:.2f} ms, "
                  f"p99 {paired['in_process']['p99_ms']:.2f} ms", flush=True)
            print("one request at a time after idle gaps ...", flush=True)
            gapped = idle_gaps(url, bodies[100])
            for gap in IDLE_GAPS_MS:
                entry = gapped[f"{gap:g}"]
                compute, outside = entry.get("compute_ms", math.nan), entry.get("rest_outside_app_ms", math.nan)
                print(f"  after {entry['gap_ms']:5.1f} ms idle: p50 {entry['p50_ms']:.2f} ms, p99 "
                      f"{entry['p99_ms']:.2f} ms, the model's call with its input read {compute:.2f} ms, "
                      f"outside the app {outside:.2f} ms (means)", flush=True)
            print("closed loop over gRPC ...", flush=True)
            closed_grpc = grpc_closed_loop(grpc_port, grpc_requests, args.requests)
            for size in SIZES:
                print(f"  {size:5d} candidates: p50 {closed_grpc[size]['p50_ms']:.2f} ms, p99 "
                      f"{closed_grpc[size]['p99_ms']:.2f} ms", flush=True)
            print("open loop at rising rates ...", flush=True)
            start_rate = max(5.0, 0.2 * 1000.0 / closed[100]["p50_ms"])
            opened = open_loop(url, instances, start_rate, args.step_seconds)
            # Half the highest rate held (the lowest rate tried when none held: the goal is then not met).
            load_rate = 0.5 * (opened["max_rate_per_s_at_p99_10ms"] or opened["steps"][0]["rate_per_s"])
            time.sleep(2.0)  # the scan's last step went past saturation: its backlog drains first
            print(f"{args.loaded_requests} requests at {load_rate:.1f} req/s ...", flush=True)
            totals = stage_totals(port)
            under_load = loaded(url, instances, load_rate, args.loaded_requests)
            under_load["server_stage_mean_ms"] = stage_means(totals, stage_totals(port))
            print("  the server's mean a request, by stage (ms): one at a time "
                  + ", ".join(f"{k} {v:.2f}" for k, v in paired_stages.items()) + "; under load "
                  + ", ".join(f"{k} {v:.2f}" for k, v in under_load["server_stage_mean_ms"].items()), flush=True)
            print(f"  p50 {under_load['p50_ms']:.2f} ms, p99 {under_load['p99_ms']:.2f} ms (from the send: "
                  f"{under_load['service_p99_ms']:.2f} ms), unanswered {under_load['unanswered']}", flush=True)
            print_tail(under_load)
            under_load_compiled: dict[str, Any] = {"unanswered": 0}
            if compiled_missing is not None:
                print(f"the compiled client is not run: {compiled_missing}", flush=True)
            else:
                print("the same sent by the compiled client (bench/native/openloop.c) ...", flush=True)
                under_load_compiled = loaded(url, instances, load_rate, args.loaded_requests, client=COMPILED_CLIENT)
                print(f"  p50 {under_load_compiled['p50_ms']:.2f} ms, p99 {under_load_compiled['p99_ms']:.2f} ms "
                      f"(from the send: {under_load_compiled['service_p99_ms']:.2f} ms), unanswered "
                      f"{under_load_compiled['unanswered']}", flush=True)
                print_tail(under_load_compiled)
            print("the same with the earlier client (httpx, bodies encoded once due) ...", flush=True)
            under_load_before = loaded(url, instances, load_rate, args.loaded_requests, client="httpx",
                                       build_ahead=False)
            print(f"  p50 {under_load_before['p50_ms']:.2f} ms, p99 {under_load_before['p99_ms']:.2f} ms (from the "
                  f"send: {under_load_before['service_p99_ms']:.2f} ms), unanswered "
                  f"{under_load_before['unanswered']}", flush=True)
            swap_rate = load_rate
            print(f"swaps under {swap_rate:.1f} req/s ...", flush=True)
            server_log = work / "server.log"
            log_before = server_log.stat().st_size
            results = Path(__file__).parent / "results"
            plot = results / ("serving_swaps.png" if args.precision == "float32" else
                              f"serving_{args.precision}_swaps.png")
            swapped = swaps(url, port, instances, store, models, swap_rate, plot_path=plot)
            swapped["server_gc_pauses"] = slow_collections(server_log, log_before)
            collections = slow_collections(server_log)
            print(f"  the server's garbage collections of {SLOW_GC_S} s or more, during the swaps / in the whole run: "
                  + ", ".join(f"generation {g} {swapped['server_gc_pauses'][g]['slow']} / {c['slow']}"
                              for g, c in collections.items()), flush=True)
            print("closed loop on the last version, a delta on a full model ...", flush=True)
            after_deltas = closed_loop(url, {100: bodies[100]}, args.requests)[100]
            after_deltas["version"] = served_version(port)
            print(f"  100 candidates on {after_deltas['version']}: p50 {after_deltas['p50_ms']:.2f} ms, p99 "
                  f"{after_deltas['p99_ms']:.2f} ms (on the first full model: {closed[100]['p99_ms']:.2f} ms)",
                  flush=True)
        finally:
            stop_server(server)
            gc.enable()
            gc.unfreeze()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    steady_p99 = swapped["steady"]["p99_ms"]
    swap_p99 = max((swapped[k] or {}).get("p99_ms", 0.0) for k in ("full_swap", "delta_swap"))
    publish_window_p99 = max(swapped[f"{k}_swap_publish_window_p99_ms"] or 0.0 for k in ("full", "delta"))
    # The in-process baseline is the call the server makes (the packed endpoint at its precision), a stricter
    # one than the TF-Serving signature (inprocess_signature_*), timed in blocks alternated with the served
    # requests, on the same batches (paired_overhead). `overhead_ratio_100_separate_phases` is the ratio as
    # runs before that computed it: the closed loop over the in-process phase minutes earlier, on one batch.
    served_call = f"packed_{args.precision}"
    overhead = paired["served"]["p99_ms"] / paired["in_process"]["p99_ms"]
    result = {
        "precision": args.precision,
        **{f"p50_ms_{size}": closed[size]["p50_ms"] for size in SIZES},
        **{f"p99_ms_{size}": closed[size]["p99_ms"] for size in SIZES},
        **{f"inprocess_p99_ms_{size}": inprocess[size][served_call]["p99_ms"] for size in SIZES},
        **{f"inprocess_signature_p99_ms_{size}": inprocess[size]["signature"]["p99_ms"] for size in SIZES},
        **{f"inprocess_{p}_p99_ms_{size}": inprocess[size][f"packed_{p}"]["p99_ms"]
           for p in ("float32", "bfloat16") for size in SIZES},
        **{f"inprocess_convert_p99_ms_{size}": inprocess[size]["predict_with_conversion"]["p99_ms"]
           for size in SIZES},
        **{f"inprocess_body_p99_ms_{size}": inprocess[size]["body_to_prediction"]["p99_ms"]
           for size in SIZES if "body_to_prediction" in inprocess[size]},
        **{f"inprocess_body_records_p99_ms_{size}": inprocess[size]["body_records_to_prediction"]["p99_ms"]
           for size in SIZES if "body_records_to_prediction" in inprocess[size]},
        "overhead_ratio_100": overhead,
        "paired_p50_ms_100": paired["served"]["p50_ms"],
        "paired_p99_ms_100": paired["served"]["p99_ms"],
        "paired_inprocess_p50_ms_100": paired["in_process"]["p50_ms"],
        "paired_inprocess_p99_ms_100": paired["in_process"]["p99_ms"],
        # The server's own mean time a 100-candidate request, by stage (serving.metrics.STAGES), one request at a
        # time (the paired phase's served requests) and under load: where a request that finds it idle pays.
        "paired_stage_mean_ms_100": paired_stages,
        "loaded_stage_mean_ms_100": under_load["server_stage_mean_ms"],
        # One request at a time after idle gaps of IDLE_GAPS_MS, taken in turn (`idle_gaps`): what the gap before
        # a request costs it, by the gap.
        "idle_gaps_100": gapped,
        # The loaded phase's requests taken apart one by one (their Server-Timing headers): where the slowest 1 %
        # spent their time, against the middle tenth (`where_time_went`).
        "loaded_tail_ms_100": {key: under_load.get(key) for key in ("slowest_1pct", "middle_tenth")},
        # What a queue of one server alone makes of the loaded phase's schedule, with the times of the requests
        # that found the server idle (`queued_alone`), and the share of requests sent while another was in flight.
        "loaded_queued_alone_100": under_load.get("queued_alone"),
        "loaded_queued_alone_100_compiled_client": under_load_compiled.get("queued_alone"),
        "loaded_sent_behind_share_100": under_load.get("sent_behind_share"),
        "loaded_sent_behind_share_100_compiled_client": under_load_compiled.get("sent_behind_share"),
        "loaded_stage_p99_ms_100": under_load.get("stage_p99_ms"),
        "loaded_server_stages_p99_ms_100": under_load.get("server_stages_p99_ms"),
        "overhead_ratio_100_separate_phases": closed[100]["p99_ms"] / inprocess[100][served_call]["p99_ms"],
        "client": "http.client, one keep-alive connection; its garbage collector off while it measures",
        "httpx_p50_ms_100": closed_httpx["p50_ms"],
        "httpx_p99_ms_100": closed_httpx["p99_ms"],
        "httpx_overhead_ratio_100": closed_httpx["p99_ms"] / inprocess[100][served_call]["p99_ms"],
        "healthz_p50_ms": floor["p50_ms"],
        "healthz_p99_ms": floor["p99_ms"],
        "overhead_ratio_100_vs_signature": closed[100]["p99_ms"] / inprocess[100]["signature"]["p99_ms"],
        # A server in production mostly serves a delta on a full model: the same request after the swaps.
        "after_deltas_p50_ms_100": after_deltas["p50_ms"],
        "after_deltas_p99_ms_100": after_deltas["p99_ms"],
        "after_deltas_over_full_p99_100": after_deltas["p99_ms"] / closed[100]["p99_ms"],
        **{f"grpc_p50_ms_{size}": closed_grpc[size]["p50_ms"] for size in SIZES},
        **{f"grpc_p99_ms_{size}": closed_grpc[size]["p99_ms"] for size in SIZES},
        "grpc_overhead_ratio_100": closed_grpc[100]["p99_ms"] / inprocess[100][served_call]["p99_ms"],
        # Under load: an open loop at half the highest rate held, latency from the scheduled send time.
        "loaded_p50_ms_100": under_load["p50_ms"],
        "loaded_p99_ms_100": under_load["p99_ms"],
        "loaded_rate_per_s": under_load["rate_per_s"],
        "loaded_requests": under_load["requests"],
        "loaded_service_p99_ms_100": under_load["service_p99_ms"],
        "loaded_client": "http.client, one keep-alive connection per sending thread; bodies encoded before the run",
        # The share of the host's CPU time its hypervisor gave other guests (steal): the whole run, and each
        # loaded phase (the noise of a shared host, measured beside the latencies it moves).
        "host_steal_share": steal_share(run_times, psutil.cpu_times()),
        "loaded_host_steal_share": under_load["host_steal_share"],
        "loaded_host_steal_share_compiled_client": under_load_compiled.get("host_steal_share"),
        # The same requests at the same rate sent by a compiled client (one C thread, epoll, a timer at each
        # send's time; bench.native_loadgen), right after: the Python client's own lateness told from the server's.
        # Beside the goal's figure, not instead of it; None where no C compiler could build the client.
        "loaded_p50_ms_100_compiled_client": under_load_compiled.get("p50_ms"),
        "loaded_p99_ms_100_compiled_client": under_load_compiled.get("p99_ms"),
        "loaded_service_p99_ms_100_compiled_client": under_load_compiled.get("service_p99_ms"),
        "loaded_unanswered_compiled_client": under_load_compiled.get("unanswered"),
        "loaded_tail_ms_100_compiled_client": {key: under_load_compiled.get(key)
                                               for key in ("slowest_1pct", "middle_tenth")},
        "loaded_compiled_client": ("bench/native/openloop.c: one thread, epoll, 16 keep-alive connections opened "
                                   "before the run; bodies encoded before the run") if compiled_missing is None
        else f"not run: {compiled_missing}",
        "loaded_p50_ms_100_previous_client": under_load_before["p50_ms"],
        "loaded_p99_ms_100_previous_client": under_load_before["p99_ms"],
        "loaded_service_p99_ms_100_previous_client": under_load_before["service_p99_ms"],
        "loaded_unanswered_previous_client": under_load_before["unanswered"],
        "loaded_previous_client": "httpx, one pooled client; each body encoded once its request was due",
        "max_rate_per_s_at_p99_10ms": opened["max_rate_per_s_at_p99_10ms"],
        # The runs before's definition (the best rate held, latency from the actual send), kept beside.
        "max_candidates_per_s_at_p99_10ms": opened["max_candidates_per_s_at_p99_10ms"],
        "swap_p99_ratio": swap_p99 / steady_p99 if steady_p99 else None,
        "swaps_all_served": swapped["all_served"],
        # The runs before's definition (the 3 s after each publish, latency from the actual send), kept beside.
        "swap_p99_ratio_publish_window": (publish_window_p99 / swapped["publish_window_steady_p99_ms"]
                                          if swapped["publish_window_steady_p99_ms"] else None),
        # Every request due in a measured phase that got no 200, skipped ones included; the open-loop scan's
        # skips past saturation are its measurement, not failures (open_loop.steps has them).
        "failed_requests": sum(closed[s]["failed_requests"] + closed_grpc[s]["failed_requests"] for s in SIZES)
        + closed_httpx["failed_requests"]
        + paired["failed_requests"]
        + opened["failed_requests"]
        + under_load["unanswered"]
        + under_load_compiled["unanswered"]
        + under_load_before["unanswered"]
        + swapped["unanswered"]
        + after_deltas["failed_requests"],
        "goals": {"loaded_p99_ms_100_at_most_5": bool(under_load["p99_ms"] is not None
                                                      and under_load["p99_ms"] <= 5.0),
                  "p99_ms_100_at_most_5": closed[100]["p99_ms"] <= 5.0,
                  "overhead_ratio_100_at_most_1.5": overhead <= 1.5,
                  "swap_p99_ratio_at_most_2": bool(steady_p99 and swap_p99 / steady_p99 <= 2.0),
                  "swaps_all_served": swapped["all_served"]},
        "closed_loop": {str(k): v for k, v in closed.items()},
        "closed_loop_grpc": {str(k): v for k, v in closed_grpc.items()},
        "closed_loop_after_deltas": {"100": after_deltas},
        "paired_100": paired,
        "in_process": {str(k): v for k, v in inprocess.items()},
        "open_loop": opened,
        "loaded": under_load,
        "loaded_compiled": under_load_compiled,
        "swaps": swapped,
        "model": {"name": "dcnv2", **{k: v for k, v in models.items() if k not in ("first", "rounds")}},
        "server": {"cores": [SERVER_CORE] if cores > 1 else "all", "pinned_with": "taskset" if shutil.which("taskset")
                   else None},
        "seconds": round(time.perf_counter() - started, 1),
        "machine": platform.machine(),
        "cpu": cpu_description(),
        "cpu_count": cores,
        "python": platform.python_version(),
        **provenance("make bench-serving" + ("" if args.precision == "float32" else
                                             f" BENCH_SERVING_ARGS='--precision {args.precision}'")),
    }
    name = "serving.json" if args.precision == "float32" else f"serving_{args.precision}.json"
    out = Path(__file__).parent / "results" / name
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
    if not swapped["all_served"]:
        print(f"FAILED: versions published and never served: {', '.join(swapped['never_served'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
