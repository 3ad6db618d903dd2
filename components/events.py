"""Raw event streams: impressions and clicks in event-time minute partitions, labelled by the planted model.

An impression carries the join's keys (KEY_SCHEMA: a request id, its event time `ts` in epoch milliseconds UTC,
a user and an item) and whatever further columns the feature spec reads (impression_payload); the join checks
those by the spec (impression_problems) and carries them to its samples. The generator here writes the `events`
preset's: context (ad slot, device) and the click-log generator's columns (its default spec's, the Criteo
fields) drawn by `components.synthetic.generate_minute`.
Its click probability is the planted model's, plus a position effect and a user-item affinity: every item
belongs to one of NUM_TOPICS topics, every user prefers one topic, and a share of each user's impressions
shows items of that topic. A user's clicked items reveal the preferred topic, which is what makes behaviour
sequences worth having.

A click arrives `delay` after its impression. Delays are lognormal (median tens of seconds, long tail); a
configurable share of them is drawn from the tail beyond the attribution window (late clicks), the rest from
below it. Like real logs, the streams have delivery faults: each impression and each click is delivered twice
with probability `duplicate_rate`, and a share of impressions is never delivered, so their clicks arrive as
orphans. Everything is a pure function of (seed, minute index): any minute can be generated alone.

Layout: raw/<stream>/date=YYYY-MM-DD/minute=HHMM/part-00000.parquet, then an empty _SUCCESS marker. A record
lives in the partition of its own event time; both streams end at the same moment (the end of the generated
span), so clicks on the last minutes' impressions that would come later are not written, as in a log cut at
one moment. Parquet rather than the Criteo TSV: the join reads only the columns it needs (request_id and ts
of both streams to classify clicks; user, item and time for behaviour sequences), which Spark reads 1.6-2.3x
faster from Parquet than from TSV; files are 2.6x smaller; times are exact int64 and a missing value is a
null, not an empty string; the schema is checked from file footers before a job starts. Reading every column
is only ~1.1x faster than TSV on 2 cores (bench/bench_events.py; noisy on a shared machine).
Raw partitions are immutable: written once under a temporary name and renamed; writing a minute again with
the same content is a no-op, with different content an error.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from scipy.special import ndtr, ndtri

from components.config import ConfigError, EventsConfig, GenerateConfig
from components.feature_spec import (
    CategoricalFeature,
    DenseFeature,
    FeatureSpec,
    MultiCategoricalFeature,
    SequenceFeature,
    TimestampFeature,
)
from components.interval import parse_time
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER, default_shape, generate_minute, hex8, splitmix64, zipf_ranks

IMPRESSIONS = "impressions"
CLICKS = "clicks"
STREAMS = (IMPRESSIONS, CLICKS)
EVENT_FILE = "part-00000.parquet"

REQUEST_ID = "request_id"
TS = "ts"  # event time, epoch milliseconds UTC
USER_ID = "user_id"
ITEM_ID = "item_id"
SLOT = "slot"  # ad position on the page, 1 = top
DEVICE = "device"
CONTEXT_COLUMNS = (SLOT, DEVICE)
# What the join makes: the label, the click's time and each impression's behaviour sequence.
LABEL = "label"
CLICK_TS = "click_ts"  # time of the click that made the label 1, else null
HISTORY = "history"

# The columns the join reads from every impression stream, with their types; the rest is named by the spec.
KEY_SCHEMA = pa.schema([(REQUEST_ID, pa.string()), (TS, pa.int64()), (USER_ID, pa.string()),
                        (ITEM_ID, pa.string())])
# What the generator writes (the `events` preset's columns): the keys, the context and the click-log generator's
# own columns (its default spec's dense and categorical ones).
BASE_SHAPE = default_shape()
IMPRESSION_SCHEMA = pa.schema(
    [(REQUEST_ID, pa.string()), (TS, pa.int64()), (USER_ID, pa.string()), (ITEM_ID, pa.string()),
     (SLOT, pa.int32()), (DEVICE, pa.string())]
    + [(name, pa.int64()) for name in BASE_SHAPE.dense]
    + [(name, pa.string()) for name in BASE_SHAPE.categorical]
)
CLICK_SCHEMA = pa.schema([(REQUEST_ID, pa.string()), (TS, pa.int64())])


def impression_payload(spec: FeatureSpec) -> tuple[str, ...]:
    """The impression columns `spec` reads besides the join's keys, in the spec's order: what the join carries
    from each impression to its sample. The label and `history` are the join's own (not read from a stream)."""
    made = {spec.label.column, HISTORY}
    return tuple(c for c in spec.input_columns if c not in made and c not in KEY_SCHEMA.names)


def impression_readers(spec: FeatureSpec) -> dict[str, Any]:
    """impression_payload's columns, each with the spec's feature that reads it (the kind it is checked by)."""
    readers = {f.column: f for f in spec.features if not getattr(f, "derived_from", "")}
    return {name: readers[name] for name in impression_payload(spec)}


def impression_schema(spec: FeatureSpec, actual: pa.Schema) -> pa.Schema:
    """The schema the join reads impressions in: the keys, then `spec`'s payload columns with their types in
    `actual` (a file's, already checked by impression_problems)."""
    return pa.schema([*KEY_SCHEMA, *(actual.field(name) for name in impression_payload(spec))])


def impression_problems(actual: pa.Schema, spec: FeatureSpec) -> list[str]:
    """What keeps a file of schema `actual` from being read as impressions for `spec`: each key missing or
    not of its type, each column the spec reads that is missing or of a type its kind cannot be parsed from."""
    problems = _missing_or_mistyped(actual, KEY_SCHEMA)
    for name, feature in impression_readers(spec).items():
        index = actual.get_field_index(name)
        if index < 0:
            problems.append(f"column {name!r} (read by the feature spec) is missing")
            continue
        kind = actual.field(index).type
        allowed = _ALLOWED.get(type(feature), _ALLOWED[CategoricalFeature])
        if not any(test(kind) for test in allowed[0]):
            problems.append(f"column {name!r} is {kind}, which a {feature.kind} feature does not read; expected "
                            f"{allowed[1]}")
    return problems


def stream_problems(stream: str, actual: pa.Schema, spec: FeatureSpec | None) -> list[str]:
    """impression_problems for impressions (the keys' alone without a spec: what a lookback is read for); for
    clicks, each of CLICK_SCHEMA's columns missing or mistyped."""
    if stream != IMPRESSIONS:
        return _missing_or_mistyped(actual, CLICK_SCHEMA)
    return impression_problems(actual, spec) if spec is not None else _missing_or_mistyped(actual, KEY_SCHEMA)


def _missing_or_mistyped(actual: pa.Schema, expected: pa.Schema) -> list[str]:
    problems = []
    for field in expected:
        index = actual.get_field_index(field.name)
        if index < 0:
            problems.append(f"column {field.name!r} is missing")
        elif actual.field(index).type != field.type:
            problems.append(f"column {field.name!r} is {actual.field(index).type}, expected {field.type}")
    return problems


def _number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _id_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) and (_text(kind.value_type) or pa.types.is_integer(kind.value_type))


# Per feature kind: the Arrow types a column of it may have (spark_jobs.raw.parse_raw casts them), and words
# for the error.
_ALLOWED = {
    DenseFeature: ((_number,), "an integer or floating-point type"),
    CategoricalFeature: ((_text, pa.types.is_integer), "string or an integer type"),
    MultiCategoricalFeature: ((_id_list, _text), "a list of strings or integers, or a string split by the "
                                                 "feature's separator"),
    SequenceFeature: ((_id_list, _text), "a list of strings or integers, or a string split by the feature's "
                                         "separator"),
    TimestampFeature: ((_number, _text), "an integer or a string in the feature's format"),
}

NUM_TOPICS = 32
# Share of impressions whose item is drawn from the user's preferred topic (the rest from all items).
TARGETED_SHARE = 0.3
# Logit added when the item's topic is the user's. This and the slot effect are centred so that the click
# rate stays near the planted model's.
AFFINITY = 1.2
NUM_SLOTS = 8
SLOT_EFFECT = -0.12  # per position below the top
DEVICES = ("mobile", "desktop", "tablet")
DEVICE_SHARE = (0.6, 0.3, 0.1)
DEVICE_EFFECT = np.array([0.1, -0.1, 0.0])
USER_ZIPF_EXPONENT = 0.9
ITEM_ZIPF_EXPONENT = 1.05
# Request ids are a bijection of (seed, minute index, row): unique within a seed while both fit.
_ROW_BITS = 20
_MINUTE_BITS = 20


def final_until(watermark: datetime, window_s: int) -> datetime:
    """The exclusive end of the final minutes, given that every click with ts < `watermark` has arrived.

    Minute t is final when t + 1m + W <= watermark: its last impression's window has closed.
    """
    last_final = watermark - timedelta(seconds=window_s) - timedelta(minutes=1)
    return last_final.replace(second=0, microsecond=0) + timedelta(minutes=1)


def stream_watermark(layout: Layout, stream: str) -> datetime | None:
    """The end of the newest complete (_SUCCESS) minute partition of `stream`, or None if there is none."""
    span = stream_span(layout, stream)
    return None if span is None else span[1]


def stream_span(layout: Layout, stream: str) -> tuple[datetime, datetime] | None:
    """(the oldest complete minute partition of `stream`, the end of the newest), or None if there is none."""
    minutes = [datetime.strptime(f"{marker.parent.parent.name}{marker.parent.name}", "date=%Y-%m-%dminute=%H%M")
               for marker in (layout.root / "raw" / stream).glob(f"date=*/minute=*/{SUCCESS_MARKER}")]
    if not minutes:
        return None
    return min(minutes).replace(tzinfo=UTC), max(minutes).replace(tzinfo=UTC) + timedelta(minutes=1)


class RawPartitionError(RuntimeError):
    """A raw partition exists with other content; raw partitions are never rewritten."""


@dataclass(frozen=True)
class EventMinute:
    minute: datetime
    impressions: pa.Table  # deliveries with ts in this minute, duplicates included, lost impressions left out
    clicks: pa.Table  # deliveries of the clicks on this minute's impressions, at whatever later time
    truth: pa.Table  # one row per impression, lost ones too: what the logs only show indirectly


def check_events_config(generate: GenerateConfig, events: EventsConfig) -> None:
    """Raises ConfigError naming the key, its value and the allowed range."""

    def fail(key: str, value, expected: str) -> None:
        raise ConfigError(f"config key {key!r} = {value!r}: expected {expected}; set it with --set {key}=...")

    for name in ("late_click_rate", "duplicate_rate", "lost_impression_rate"):
        value = getattr(events, name)
        if not 0.0 <= value < 1.0:
            fail(f"events.{name}", value, "a share in [0, 1)")
    for name in ("attribution_window_s", "click_delay_median_s", "click_delay_sigma"):
        if getattr(events, name) <= 0:
            fail(f"events.{name}", getattr(events, name), "a positive number")
    if events.num_users < 1:
        fail("events.num_users", events.num_users, "at least 1")
    if events.num_items < NUM_TOPICS:
        fail("events.num_items", events.num_items, f"at least {NUM_TOPICS} (one item per topic)")
    if not 1 <= generate.rows_per_minute < (1 << _ROW_BITS):
        fail("generate.rows_per_minute", generate.rows_per_minute, f"between 1 and {(1 << _ROW_BITS) - 1}")


def item_topic(item_ids: np.ndarray | list[str]) -> np.ndarray:
    """The topic of each item id ('i<number>')."""
    numbers = np.array([int(item[1:]) for item in item_ids], dtype=np.int64)
    return numbers % NUM_TOPICS


def user_topic(seed: int, user_ids: np.ndarray | list[str]) -> np.ndarray:
    """The preferred topic of each user id ('u<number>') under the planted model of `seed`."""
    return _user_topic(seed, np.array([int(user[1:]) for user in user_ids], dtype=np.int64))


def _user_topic(seed: int, users: np.ndarray) -> np.ndarray:
    mixed = splitmix64(users.astype(np.uint64) + (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32)))
    return (mixed % np.uint64(NUM_TOPICS)).astype(np.int64)


def click_delays_ms(events: EventsConfig, uniform: np.ndarray, late: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: the lognormal below the window where `late` is false, its tail beyond it where true.

    On-time delays are floored to whole milliseconds (so they stay <= the window), late ones are at least one
    millisecond past it.
    """
    window = float(events.attribution_window_s)
    median, sigma = events.click_delay_median_s, events.click_delay_sigma
    below = float(ndtr((np.log(window) - np.log(median)) / sigma))  # lognormal CDF at the window
    probability = np.where(late, below + uniform * (1.0 - below), uniform * below)
    delay_s = median * np.exp(sigma * ndtri(np.clip(probability, 0.0, 1.0 - 1e-16)))
    window_ms = int(events.attribution_window_s * 1000)
    on_time = np.minimum(np.floor(delay_s * 1000.0), window_ms)
    too_late = np.maximum(np.ceil(delay_s * 1000.0), window_ms + 1)
    return np.where(late, too_late, on_time).astype(np.int64)


def _request_ids(seed: int, minute_index: int, n: int) -> pa.Array:
    if not 0 <= minute_index < (1 << _MINUTE_BITS):
        raise ValueError(f"minute index {minute_index} is out of range [0, {1 << _MINUTE_BITS}): generate in "
                         "spans of at most two years per seed")
    key = ((seed & 0xFFFFFF) << (_ROW_BITS + _MINUTE_BITS)) + (minute_index << _ROW_BITS)
    mixed = splitmix64(np.arange(n, dtype=np.uint64) + np.uint64(key))
    high = hex8((mixed >> np.uint64(32)).astype(np.uint32))
    low = hex8((mixed & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    return pa.array(np.char.add(high, low), pa.binary()).cast(pa.string())


def _prefixed(prefix: str, numbers: np.ndarray) -> pa.Array:
    return pa.array(np.char.add(prefix, numbers.astype(str)), pa.string())


def generate_event_minute(generate: GenerateConfig, events: EventsConfig, minute_index: int,
                          minute: datetime) -> EventMinute:
    """The impressions of one minute, every click on them, and the planted truth behind both."""
    check_events_config(generate, events)
    base = generate_minute(generate, minute_index, minute, BASE_SHAPE)  # the base fields, planted probability
    n = generate.rows_per_minute
    rng = np.random.default_rng([generate.seed, minute_index, 0xE7])
    minute_ms = int(minute.timestamp() * 1000)
    # Every draw is made for every row, in a fixed order, so each stream of draws is stable.
    ts = minute_ms + np.sort(rng.integers(0, 60_000, n))
    users = zipf_ranks(events.num_users, rng.random(n), USER_ZIPF_EXPONENT)
    preferred = _user_topic(generate.seed, users)
    targeted = rng.random(n) < TARGETED_SHARE
    per_topic = events.num_items // NUM_TOPICS
    in_topic = zipf_ranks(per_topic, rng.random(n), ITEM_ZIPF_EXPONENT) * NUM_TOPICS + preferred
    anywhere = zipf_ranks(events.num_items, rng.random(n), ITEM_ZIPF_EXPONENT)
    items = np.where(targeted, in_topic, anywhere)
    slot = rng.integers(1, NUM_SLOTS + 1, n)
    device = rng.choice(len(DEVICES), n, p=DEVICE_SHARE)
    click_draw = rng.random(n)
    late = rng.random(n) < events.late_click_rate
    delay_ms = click_delays_ms(events, rng.random(n), late)
    lost = rng.random(n) < events.lost_impression_rate
    impression_twice = rng.random(n) < events.duplicate_rate
    click_twice = rng.random(n) < events.duplicate_rate

    match = (items % NUM_TOPICS) == preferred
    expected_match = TARGETED_SHARE + (1.0 - TARGETED_SHARE) / NUM_TOPICS
    p = base.probability
    logit = (np.log(p) - np.log1p(-p) + SLOT_EFFECT * (slot - (NUM_SLOTS + 1) / 2) + DEVICE_EFFECT[device]
             + AFFINITY * (match - expected_match))
    probability = 1.0 / (1.0 + np.exp(-logit))
    clicked = click_draw < probability

    request_id = _request_ids(generate.seed, minute_index, n)
    columns = {
        REQUEST_ID: request_id,
        TS: pa.array(ts, pa.int64()),
        USER_ID: _prefixed("u", users),
        ITEM_ID: _prefixed("i", items),
        SLOT: pa.array(slot, pa.int32()),
        DEVICE: pa.array(np.array(DEVICES)[device], pa.string()),
    }
    for name in (*BASE_SHAPE.dense, *BASE_SHAPE.categorical):
        columns[name] = base.table.column(name).combine_chunks()
    every_impression = pa.table(columns, schema=IMPRESSION_SCHEMA)
    delivered = np.flatnonzero(~lost)
    impressions = every_impression.take(np.repeat(delivered, 1 + impression_twice[delivered]))

    rows = np.flatnonzero(clicked)
    click_ts = ts[rows] + delay_ms[rows]
    order = np.argsort(click_ts, kind="stable")
    click_rows = np.repeat(rows[order], 1 + click_twice[rows[order]])
    clicks = pa.table({REQUEST_ID: request_id.take(click_rows),
                       TS: pa.array(ts[click_rows] + delay_ms[click_rows], pa.int64())}, schema=CLICK_SCHEMA)
    truth = pa.table({
        REQUEST_ID: request_id,
        TS: pa.array(ts, pa.int64()),
        "probability": pa.array(probability),
        # What the learnable ceiling needs (learnable_event_auc): the logit without the user-item affinity,
        # the user's number and the item's topic.
        "logit_without_affinity": pa.array(logit - AFFINITY * (match - expected_match)),
        "user": pa.array(users, pa.int64()),
        "item_topic": pa.array(items % NUM_TOPICS, pa.int64()),
        "clicked": pa.array(clicked),
        "delay_ms": pa.array(delay_ms, mask=~clicked),
        "late": pa.array(late & clicked),
        "lost": pa.array(lost),
        "impression_deliveries": pa.array(np.where(lost, 0, 1 + impression_twice)),
        "click_deliveries": pa.array(np.where(clicked, 1 + click_twice, 0)),
    })
    return EventMinute(minute, impressions, clicks, truth)


def write_event_minute(table: pa.Table, directory: Path) -> Path:
    """Writes one immutable minute partition (temporary name, rename, then _SUCCESS).

    A complete partition is never rewritten: the same content again is a no-op, other content an error.
    """
    final = directory / EVENT_FILE
    if (directory / SUCCESS_MARKER).exists():
        existing = pq.read_table(final) if final.exists() else None
        if existing is not None and existing.equals(table):
            return final
        found = "no data file" if existing is None else f"{existing.num_rows} other rows"
        raise RawPartitionError(
            f"raw partition {directory} is complete and holds {found} (this write has {table.num_rows} rows, "
            "made with another seed or config?); raw partitions are immutable: generate into a new data root, "
            "or delete the partition first if it was written by mistake"
        )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{EVENT_FILE}.{uuid.uuid4().hex[:8]}.tmp"
    pq.write_table(table, tmp, compression="snappy")
    os.replace(tmp, final)
    (directory / SUCCESS_MARKER).touch()
    return final


def planted_events_path(layout: Layout, minute: datetime) -> Path:
    """Where the generator keeps the planted click probability of each impression of a minute (beside, not
    inside, the raw streams: a real log has no such column)."""
    return layout.root / "generated" / "planted_events" / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}.parquet"


def planted_event_auc(layout: Layout, minutes: list[datetime], request_ids: np.ndarray,
                      labels: np.ndarray) -> float | None:
    """The planted model's AUC on samples (request ids and their joined labels) of `minutes`: the best any
    model can reach on them. None when the generator's planted probabilities are not there (real data)."""
    from components.evaluation import roc_auc

    paths = [planted_events_path(layout, minute) for minute in minutes]
    if not paths or not all(path.exists() for path in paths):
        return None
    planted = pa.concat_tables([pq.read_table(path) for path in paths])
    probability = dict(zip(planted.column(REQUEST_ID).to_pylist(), planted.column("probability").to_pylist(),
                           strict=True))
    scores = np.array([probability.get(r, np.nan) for r in request_ids], dtype=np.float64)
    known = ~np.isnan(scores)
    return roc_auc(np.asarray(labels)[known], scores[known]) if known.any() else None


def learnable_event_auc(layout: Layout, train_minutes: list[datetime], minutes: list[datetime],
                        request_ids: np.ndarray, labels: np.ndarray) -> float | None:
    """A ceiling for models that learn from labels: the AUC on samples of `minutes` of a predictor that knows
    the planted model's form and every parameter except each user's preferred topic, which it infers from the
    labels of that user's impressions in `train_minutes` (the exact posterior over topics, uniform prior).

    The planted AUC knows every user's topic; no model trained on these labels can, so the distance between
    the two is out of any model's reach. (The posterior here uses labels only: the items a user was shown
    also reveal the topic, but a click model is not given them.) None when the generator's files are absent.
    """
    from components.evaluation import roc_auc

    paths = [planted_events_path(layout, minute) for minute in (*train_minutes, *minutes)]
    if not minutes or not all(path.exists() for path in paths):
        return None
    columns = ["clicked", "logit_without_affinity", "user", "item_topic"]
    train = pa.concat_tables([pa.schema([(name, pq.read_schema(paths[-1]).field(name).type) for name in columns])
                              .empty_table(),
                              *(pq.read_table(planted_events_path(layout, m), columns=columns) for m in train_minutes)])
    users = train.column("user").to_numpy()
    topics = train.column("item_topic").to_numpy()
    clicked = train.column("clicked").to_numpy(zero_copy_only=False)
    rest = train.column("logit_without_affinity").to_numpy()
    user_index, users = np.unique(users, return_inverse=True)
    expected_match = TARGETED_SHARE + (1.0 - TARGETED_SHARE) / NUM_TOPICS
    log_likelihood = np.zeros((len(user_index), NUM_TOPICS))
    for topic in range(NUM_TOPICS):
        p = 1.0 / (1.0 + np.exp(-(rest + AFFINITY * ((topics == topic) - expected_match))))
        log_likelihood[:, topic] = np.bincount(users, np.where(clicked, np.log(p), np.log1p(-p)),
                                               minlength=len(user_index))
    posterior = np.exp(log_likelihood - log_likelihood.max(axis=1, keepdims=True))
    posterior /= posterior.sum(axis=1, keepdims=True)

    scored = pa.concat_tables([pq.read_table(planted_events_path(layout, m), columns=[REQUEST_ID, *columns[1:]])
                               for m in minutes])
    position = dict(zip(scored.column(REQUEST_ID).to_pylist(), range(scored.num_rows), strict=True))
    rows = np.array([position.get(r, -1) for r in request_ids], dtype=np.int64)
    known = rows >= 0
    rows = rows[known]
    user = scored.column("user").to_numpy()[rows]
    slot = np.minimum(np.searchsorted(user_index, user), max(len(user_index) - 1, 0))
    seen = (user_index[slot] == user) if len(user_index) else np.zeros(len(rows), dtype=bool)
    match = np.full(len(rows), 1.0 / NUM_TOPICS)  # a user never seen in training: the prior
    match[seen] = posterior[slot[seen], scored.column("item_topic").to_numpy()[rows][seen]]
    rest = scored.column("logit_without_affinity").to_numpy()[rows]
    score = (match / (1.0 + np.exp(-(rest + AFFINITY * (1.0 - expected_match))))
             + (1.0 - match) / (1.0 + np.exp(-(rest - AFFINITY * expected_match))))
    return roc_auc(np.asarray(labels)[known], score) if known.any() else None


def generate_events(generate: GenerateConfig, events: EventsConfig, layout: Layout, progress=None) -> dict:
    """Writes both streams for generate.minutes minutes from generate.start; returns counts of what was made."""
    check_events_config(generate, events)
    start = parse_time(generate.start).replace(second=0, microsecond=0)
    start_ms = int(start.timestamp() * 1000)
    pending: dict[int, list[pa.Table]] = {}  # click minute index -> click deliveries not yet written
    totals = dict.fromkeys(("impressions", "impression_deliveries", "lost_impressions", "clicks",
                            "click_deliveries", "late_clicks", "clicks_after_end"), 0)
    for index in range(generate.minutes):
        minute = start + timedelta(minutes=index)
        piece = generate_event_minute(generate, events, index, minute)
        write_event_minute(piece.impressions, layout.raw_events_minute_dir(IMPRESSIONS, minute))
        click_minute = (piece.clicks.column(TS).to_numpy() - start_ms) // 60_000
        for target in np.unique(click_minute):
            if target < generate.minutes:
                pending.setdefault(int(target), []).append(piece.clicks.filter(pa.array(click_minute == target)))
        # Delays are never negative, so no later impression minute can add clicks to this one.
        clicks = pa.concat_tables([CLICK_SCHEMA.empty_table(), *pending.pop(index, [])])
        clicks = clicks.take(pc.sort_indices(clicks, [(TS, "ascending"), (REQUEST_ID, "ascending")]))
        write_event_minute(clicks, layout.raw_events_minute_dir(CLICKS, minute))

        truth = piece.truth
        planted = planted_events_path(layout, minute)
        planted.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(truth.select([REQUEST_ID, "probability", "clicked", "logit_without_affinity", "user",
                                     "item_topic"]), planted)
        clicked = truth.column("clicked").to_numpy(zero_copy_only=False)
        click_ts = truth.column(TS).to_numpy() + truth.column("delay_ms").fill_null(0).to_numpy()
        totals["impressions"] += truth.num_rows - int(pc.sum(truth.column("lost")).as_py())
        totals["impression_deliveries"] += piece.impressions.num_rows
        totals["lost_impressions"] += int(pc.sum(truth.column("lost")).as_py())
        totals["clicks"] += int(clicked.sum())
        totals["click_deliveries"] += piece.clicks.num_rows
        totals["late_clicks"] += int(pc.sum(truth.column("late")).as_py())
        totals["clicks_after_end"] += int((clicked & (click_ts >= start_ms + generate.minutes * 60_000)).sum())
        if progress:
            progress(index + 1, generate.minutes)
    return {"start": start.isoformat(), "end": (start + timedelta(minutes=generate.minutes)).isoformat(),
            "minutes": generate.minutes, **totals}
