"""Typed pipeline configuration: one frozen dataclass per stage, built once at the edge and passed down.

Sources, later ones winning: the defaults below, a YAML file, environment variables (only the few named in
`ENVIRONMENT_KEYS`), then explicit `section.key=value` overrides (CLI flags or Airflow params). This module is
the only place that reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from components.errors import ConfigError


@dataclass(frozen=True)
class PathsConfig:
    # Root of everything the pipeline writes locally: raw logs, features, samples, checkpoints, MLflow, Airflow.
    data_root: str = "var"
    # Model store: a local directory or s3://bucket/prefix. Empty means <data_root>/model_store.
    model_store: str = ""
    # Optional S3 endpoint (MinIO, or a moto server in tests).
    s3_endpoint_url: str = ""

    @property
    def root(self) -> Path:
        return Path(self.data_root).absolute()

    @property
    def model_store_uri(self) -> str:
        return self.model_store or str(self.root / "model_store")


@dataclass(frozen=True)
class GenerateConfig:
    start: str = "2026-01-01T00:00"  # first minute written, UTC
    minutes: int = 60
    rows_per_minute: int = 5000
    seed: int = 7
    # Share of categorical draws that are values never seen before (new ads, new users).
    new_value_rate: float = 0.01


@dataclass(frozen=True)
class EventsConfig:
    # A click labels its impression 1 when its time is at most this many seconds after the impression's time.
    # A minute's samples are final only once the click stream is complete up to the minute's end plus this.
    attribution_window_s: int = 600
    # Clicked item ids kept in each impression's behaviour sequence, the most recent last.
    sequence_length: int = 20
    # How far before a run's first minute it reads events: a click whose impression is older counts as an
    # orphan, not late. A run that reads the lookback (a daily run, the first minute run of a chain) builds
    # behaviour sequences from the clicks in it; a minute run that continues the run before it
    # (spark_jobs.events.run) carries them on from that run's history state, however old.
    history_lookback_s: int = 3600
    # A minute run that continues the run before it keeps the lookback's narrow columns it read (request id,
    # time, user, item; the clicks) in its process for the next minute, up to this many MiB per stream: in
    # the step worker, each minute then reads only the minute files it has not read yet (spark_jobs.events.
    # LookbackReads). An hour of 60 K impressions a minute took 150 MiB, its clicks 16 MiB. 0 reads them every
    # minute.
    lookback_keep_mib: int = 512
    # Generator (the impression count, start, minutes and seed come from `generate`). Click delays are
    # lognormal with this median and log-space sigma; `late_click_rate` of the clicks are drawn from its tail
    # beyond the attribution window, the rest from below it (1 - CDF(window) keeps the plain lognormal).
    click_delay_median_s: float = 30.0
    click_delay_sigma: float = 1.5
    late_click_rate: float = 0.03
    # Share of impressions, and separately of clicks, delivered twice.
    duplicate_rate: float = 0.01
    # Share of impressions never delivered; their clicks arrive as orphans.
    lost_impression_rate: float = 0.002
    num_users: int = 20_000
    num_items: int = 5_000


@dataclass(frozen=True)
class SparkConfig:
    master: str = "local[2]"
    # Spark Connect URL (sc://host:port). When set, jobs run against that server instead of a local session.
    remote: str = ""
    driver_memory: str = "4g"
    # On a cluster (master spark://...): the memory of each executor the Connect server asks the workers for.
    executor_memory: str = "2g"
    # The Connect server's Spark UI (and its REST API, /api/v1) on this port; 0 leaves it off.
    ui_port: int = 0
    shuffle_partitions: int = 4
    # spark.sql.shuffle.partitions of the events join of a span up to 15 minutes (a minute run's join:
    # spark_jobs.events.run). A minute holds some 60 K impressions, and each partition is a task per shuffle stage
    # whose fixed cost outweighs its share of them: about one per core the tasks run on. On local[2], a minute run
    # took 0.90x the time with 2 as with 8, 0.92x as with 4, and 1.15x with 1 as with 2, the gain all in the join
    # (docs/spark.md).
    minute_shuffle_partitions: int = 2


@dataclass(frozen=True)
class FeatureConfig:
    # The feature spec (components/feature_spec.py): a preset name (criteo, avazu, taobao, events) or a YAML
    # file. The per-feature settings it leaves unset come from min_count, evict_after_days,
    # max_rows_per_feature below and train.embedding_dim.
    spec: str = "criteo"
    # What the daily pipeline reads: "click_log" (labelled Criteo-layout minute slices, raw/click_log) or
    # "events" (impression and click streams, raw/impressions and raw/clicks, labelled by the join step).
    source: Literal["click_log", "events"] = "click_log"
    # A categorical value gets its own embedding row after this many occurrences; rarer values share a row.
    # 0 chooses it at the daily run from its training rows (components.feature_state.auto_min_count: 2 up to
    # 300 K rows, one more per 100 K rows, 20 from 2 M rows on), and its minute runs keep it. A fixed 20 sent
    # nearly every value of a ten-thousand-row log to the shared row.
    min_count: int = 0
    # Share of the interval's minutes, taken from its end, held out for evaluation.
    eval_fraction: float = 0.1
    # Admitted values unseen for this many days are evicted by the daily run (their rows are freed for reuse);
    # candidates below min_count unseen as long are forgotten. 0 disables eviction.
    evict_after_days: int = 7
    # Embedding rows per categorical feature, reserved rows included. Values admitted beyond it stay shared.
    max_rows_per_feature: int = 1_000_000
    # Rows each table gets beyond its admitted values at the daily run: minute runs admit new values into this
    # room (a minute's model keeps its daily parent's shape, so its delta only changes rows). Values admitted
    # once the room is full wait as candidates for the next daily run.
    growth_rows: int = 1000
    # Layout of the sample TFRecords: "block" (one tf.Example per block_rows rows; what the trainer reads
    # fastest) or "row" (one tf.Example per row, one feature per column: label, I1..I13, C1..C26, the layout
    # TFX tools such as TFDV read; ~10x slower to train from, see bench-input).
    samples_layout: Literal["block", "row"] = "block"
    # Rows per TFRecord block (one tf.Example per block).
    block_rows: int = 1024
    # TFRecord shards per split, and the seed of the order rows are shuffled into. The join's samples
    # (source "events") come already shuffled in the join's hash order and are not shuffled again: they keep
    # the join's partitions, merged down to num_shards (a small day can have fewer), and the seed is unused.
    num_shards: int = 4
    seed: int = 7


@dataclass(frozen=True)
class TrainConfig:
    model: Literal["dcnv2", "deepfm", "dien", "din", "dlrm", "wide_deep"] = "dcnv2"
    # The Keras backend of the train step. "jax" trains in a child process with KERAS_BACKEND=jax that imports
    # no TensorFlow and reads the block files with trainer.block_reader (trainer/jax_train.py): what a GPU host
    # whose image carries JAX and not TensorFlow runs. Its checkpoint is the same model.keras, so the export,
    # the deltas and serving stay on TensorFlow. Block samples only; XLA is always on under JAX.
    backend: Literal["tensorflow", "jax"] = "tensorflow"
    # train.backend=jax: the devices the train step uses, 0 for all this host shows. Above 1, every batch is split
    # across them (dense weights replicated: data parallel) and the embedding table, when it holds more than
    # shard_table_rows rows, is sharded row-wise across them: keras.distribution.ModelParallel over a one-axis
    # mesh (trainer/devices.py). The TensorFlow backend ignores both.
    devices: int = 0
    shard_table_rows: int = 1_000_000
    # train.backend=jax: training processes joined into one mesh by keras.distribution.initialize (over
    # jax.distributed; trainer/processes.py). Above 1 the train step starts that many on this host, on loopback, and
    # train.devices counts the devices of all of them: each process feeds its share of every batch and holds its
    # share of a sharded table. On several hosts a cluster scheduler starts them (docs/scale.md).
    processes: int = 1
    # Who starts the train step's processes: "local" (this host, as above) or "scheduler": the step writes its
    # request under the checkpoint directory (which every host must mount at the same path) and waits up to
    # scheduler_timeout_s for the processes a cluster scheduler starts on it (a Kubernetes Indexed Job:
    # docker/kubernetes/train-job.yaml) to write the checkpoint.
    launcher: Literal["local", "scheduler"] = "local"
    scheduler_timeout_s: float = 3600.0
    embedding_dim: int = 16
    num_cross_layers: int = 3
    # DCNv2's cross layers: r > 0 gives each a low-rank matrix, [width, r] then [r, width] (the paper's
    # cost-efficient form); 0 a full [width, width] one. At the criteo spec's width of 429, rank 64 scored the
    # same AUC as full rank in bench-quality (0.8310 and 0.8307) and took 0.70-0.81x its time to serve 100
    # candidates (docs/serving.md). A model trained at another rank cannot warm-start this one.
    cross_projection_dim: int = 64
    mlp_units: tuple[int, ...] = (512, 256, 128)
    # Dropout after each hidden layer of a model's deep part (DCNv2's deep network, the MLPs of DeepFM,
    # Wide&Deep, DIN and DIEN, DLRM's over arch), in training only; its draws are seeded by train.seed.
    dropout: float = 0.0
    # Rows per optimizer step. 0 chooses it from the training rows (trainer.arguments.auto_batch_size: the largest
    # power of two from 64 to 2,048 that gives an epoch at least 300 steps; 2,048 from 614,400 rows on). A minute
    # run takes 2,048 when it is 0.
    batch_size: int = 0
    # The most epochs a daily run trains; early stopping decides the end before it.
    epochs: int = 20
    # Early stopping: the held-out slice is scored after every epoch; after this many epochs in a row without
    # a val_auc gain of more than early_stopping_min_delta training stops, and the best epoch's weights are the
    # ones calibrated, checkpointed and exported (trainer/early_stopping.py). 0 keeps the last epoch. With 1,
    # wide_deep on 90 K MovieLens rows would have stopped after a dip at epoch 4 (held-out AUC 0.7223 after 0.7230),
    # one epoch before its best (0.7295).
    early_stopping_patience: int = 2
    early_stopping_min_delta: float = 0.0
    # True: the kept model is the mean of the best epoch's weights and those of the epochs after it that did not
    # beat it (trainer/early_stopping.py). Off: on MovieLens's later rows it scored 0.6916 against 0.6938 for
    # the best epoch alone, on the same epochs (docs/real_data.md).
    average_epochs: bool = False
    learning_rate: float = 0.02
    # The optimizer of the weights that are not tables' (trainer/optimizers.py): "adagrad" or "adam", at
    # learning_rate. The tables keep row-sparse Adagrad at embedding_learning_rate either way.
    dense_optimizer: Literal["adagrad", "adam"] = "adagrad"
    # Row-sparse updates: embeddings get Adagrad's scatter updates; only touched rows change.
    embedding_learning_rate: float = 0.2
    # L2 on the embedding rows a training batch reads (trainer/layers/categorical_embedding.py row_l2): the
    # mean over the batch of their squared norms, times this, added to the loss; row-sparse like the updates.
    embedding_l2: float = 0.0
    # The share of a training batch's categorical values read as the shared rare row, the row every value never
    # seen in training reads at serving (trainer/layers/categorical_embedding.py rare_row_rate). 0 leaves that
    # row trained only by the values below the admission count.
    rare_row_rate: float = 0.0
    # The same per categorical column, in the feature spec's order (overrides rare_row_rate when set).
    rare_row_rates: tuple[float, ...] = ()
    # XLA. Off by default: on CPU it made the demo's training 1.5x slower (28.6-29.7 K vs 43.8-45.2 K
    # examples/s, `ctr run daily --steps train --set train.jit_compile=...`). Turn it on for GPUs.
    jit_compile: bool = False
    mixed_precision: bool = False
    # Gradient accumulation over this many micro-batches per optimizer step (1 = off).
    micro_batches: int = 1
    # Embedding gradients applied to the touched rows only (TensorFlow backend, micro_batches = 1: Keras'
    # accumulated gradients are dense). False applies them to the whole table, for comparison.
    row_sparse_updates: bool = True
    shuffle_buffer_blocks: int = 64
    log_every_steps: int = 20
    # Training progress (weights and optimizer state) is saved every this many steps and at each epoch's end;
    # a killed training resumes from the last save (trainer/progress.py).
    checkpoint_every_steps: int = 500
    # The daily run starts from the previous interval's checkpoint when there is one: rows of values still
    # admitted are kept, new and evicted rows start fresh (trainer/warm_start.py).
    warm_start: bool = True
    # After training, one logit shift makes the mean prediction on this many training rows equal their click
    # rate (trainer/calibration.py): Adagrad leaves the level off by up to ~20 % while the ranking is right.
    calibrate: bool = True
    # Where: "held_out" fits a scale and a shift of the logit on half the held-out rows (the latest of the
    # interval) and folds them into the output layer (trainer/calibration.py: on MovieLens's later rows it took
    # the served logloss from 0.7065 to 0.6428 at the same AUC); with fewer than calibration_min_clicks clicks or
    # non-clicks in that half, or with "training", the level shift on calibration_rows training rows.
    calibrate_on: Literal["held_out", "training"] = "held_out"
    calibration_min_clicks: int = 100
    calibration_rows: int = 262_144
    seed: int = 7
    # Multi-hash compression (trainer/layers/multi_hash_embedding.py): each feature named here gets
    # multi_hash_functions tables of multi_hash_buckets rows, combined by multi_hash_combiner ("sum" or
    # "concat"), instead of one row per admitted value. For very-high-cardinality features; any model.
    multi_hash_features: tuple[str, ...] = ()
    multi_hash_buckets: int = 16_384
    multi_hash_functions: int = 2
    multi_hash_combiner: Literal["sum", "concat"] = "sum"
    # DLRM: the bottom MLP on the dense input, before its last layer of embedding_dim units.
    bottom_mlp_units: tuple[int, ...] = (64,)
    # DIN and DIEN: the history input holds the last sequence_length behaviours as row ids of the table of
    # sequence_feature, which is also the target item's feature.
    sequence_length: int = 20
    sequence_feature: str = "C1"
    # Hidden widths of the attention MLP of DIN and DIEN.
    attention_units: tuple[int, ...] = (80, 40)
    # DIN: the deep network also reads the target item's vector times the interest vector, element by element
    # (as the DIN and DIEN authors' code does beside the interest), so how well the item matches the history is
    # an input the MLP need not learn to multiply out.
    interest_product: bool = True
    # DIN: weight of an auxiliary loss on the behaviour sequences alone, as word2vec trains on sentences: each
    # behaviour against the mean of the same row's other behaviours (a positive) and against the behaviour at
    # its place in another row of the batch (a negative). The click label reaches an item's row only where the
    # item is the target; this teaches the item table, from every row's history, which items one user clicks
    # together, which is what the attention matches. 1.0 is the DIEN paper's weight for its auxiliary loss;
    # 0 turns it off (docs/real_data.md, "What one user clicks together").
    # DIEN: weight of the paper's own auxiliary loss: each interest state of the extractor against the behaviour
    # that came next (a positive) and against the one at the same place in another row of the batch (a negative).
    history_aux_weight: float = 1.0
    # DIEN's interest extractor: "gru" (keras GRU) or "sru" (simple recurrent unit).
    interest_cell: Literal["gru", "sru"] = "gru"


@dataclass(frozen=True)
class GateConfig:
    min_auc: float = 0.60
    # ... refused only when the AUC is below min_auc by more than this many of its standard errors (Hanley and
    # McNeil's, from the numbers of held-out clicks and non-clicks, at the AUC measured or at min_auc, whichever
    # is larger: at an AUC of 0 the first is 0 however few the rows): the Open Bandit logs' held-out slice holds
    # about 8 clicks, where an AUC's standard error is near 0.1 and a good model measures 0.527 by chance. With
    # thousands of clicks the allowance is under 0.02. 0 gives the bare threshold.
    auc_noise_z: float = 1.96
    max_logloss: float = 0.69
    # |mean prediction - mean label| / mean label
    max_calibration_error: float = 0.15
    # ... and only when that difference is also more than this many standard errors of the held-out click rate
    # (sqrt(p (1 - p) / n)): 20,000 Open Bandit rows hold about 80 clicks, and a held-out slice of 2,000 rows
    # with 4 of them has a click rate that 15 % cannot describe (its standard error is 50 % of it).
    calibration_noise_z: float = 3.0
    # The model against its own baseline (baseline.*) on the same held-out rows: refused when even the top of
    # the 95 % bootstrap interval of its AUC minus the baseline's is below this. At 0.0 a model is refused only
    # when it is worse than the baseline beyond the held-out slice's noise: on 8,573 held-out MovieLens rows the
    # interval ran from -0.012 to +0.019 around a lift of +0.004, so a gate on the point estimate alone would
    # refuse good models by chance. Raise it to demand a lift; -1 turns the check off.
    min_lift_auc: float = 0.0


@dataclass(frozen=True)
class BaselineConfig:
    """The run's own baseline (components/baseline.py): a hashed logistic regression (scikit-learn) trained on
    the daily run's training rows and scored on its held-out rows, beside the model."""

    enabled: bool = True
    # Training rows the baseline fits on, drawn at random from the interval's when it holds more (the held-out
    # rows are always all scored).
    max_train_rows: int = 500_000
    # Inverse regularization strengths tried; the one with the best logloss on the last validation_fraction of
    # the training rows (in time) is kept, and the baseline refitted on all of them.
    regularization_grid: tuple[float, ...] = (0.1, 0.3, 1.0)
    validation_fraction: float = 0.1
    # Columns of the hashed one-hot encoding.
    num_features: int = 1 << 20


@dataclass(frozen=True)
class IncrementalConfig:
    """Minute runs (pipelines/incremental.py, DAG ctr_incremental): train on one minute, ship a delta."""

    # The validate step waits this long for the minute's partition to be complete (_SUCCESS) before failing.
    wait_for_data_s: float = 30.0
    # Airflow creates each scheduled minute run this long before its minute closes (pipelines/timetables.py),
    # so that its sensor task is already waiting when the minute's completion marker lands; 0 to 30 s, 0
    # creates it at the close.
    run_lead_s: float = 5.0
    # Share of the minute's rows held out (by row position) to score the delta against its parent.
    holdout_fraction: float = 0.1
    # Passes over the minute's training rows.
    epochs: int = 1
    # Gate on every delta: every value finite, no changed embedding row longer than this (L2 norm), and the
    # holdout logloss no worse than the parent's by more than this.
    max_embedding_norm: float = 50.0
    max_logloss_increase: float = 0.01
    # After an outage, minutes whose data closed more than this long before their run started are skipped
    # (logged, no delta) when catch_up is "latest_only"; with "in_order" every missed minute is trained in order.
    catch_up: Literal["in_order", "latest_only"] = "in_order"
    max_lag_s: float = 600.0
    # Airflow's tasks of ctr_incremental run their steps in the step worker (`ctr worker`,
    # pipelines/step_worker.py) when one is up for this data root, else in their own process.
    step_worker: bool = True
    # In the step worker, a step starts as soon as its upstream steps ended well, and its task takes the outcome
    # when it comes (pipelines/run_ahead.py); false: every step waits for its task.
    run_ahead: bool = True
    # The step worker validates each minute's raw partitions as soon as their completion markers land, before
    # the run asks (pipelines/arrivals.py); the validate step then finds them validated. False: validation
    # waits for the validate step.
    validate_on_arrival: bool = True
    # The step worker turns CPython's automatic garbage collections off and collects while it is idle (after a
    # run's last step, and at least every 2 minutes with no step running), so that no collection stops a
    # minute's steps (pipelines/idle_gc.py); false: CPython collects whenever a step allocates enough.
    worker_idle_gc: bool = True
    # The step worker starts over as a fresh process once a step leaves it above this resident memory (MiB).
    step_worker_max_rss_mib: float = 4096.0
    # A minute over a tiered table (storage: tiered) at position p of its chain also writes the rows of its last
    # p & -p minutes as one span, so a table made from the chain (a minute run in a new process, the next daily
    # run's warm start) reads one piece per set bit of p instead of one overlay a minute (trainer/tiered_tables.py;
    # docs/tiers.md, "Spans over a day of minutes"). A span gathers its records in memory, at most this many MiB
    # (a larger one is left out), and is merged from the pieces it replaces by the minute run's last step, after
    # its publish (a span of 256 minutes over 1.5-2 M rows took 12-14 s in bench-chain-spans, on the minute's own
    # time before it moved there). 0: no spans, one overlay a minute.
    tiered_span_max_mib: int = 256


@dataclass(frozen=True)
class TrackingConfig:
    # Empty means sqlite:///<data_root>/mlflow/mlflow.db
    tracking_uri: str = ""
    experiment: str = "ctr"
    # Under pytest a tracking outage fails the run; elsewhere it is logged and the pipeline goes on.
    strict: bool = False
    # A tracking server that does not answer costs a run seconds: a probe of `probe_timeout_s` before the first
    # call, MLflow's HTTP calls retried `http_max_retries` times (MLflow's own default, 7 with backoff, spends
    # about 4 minutes on a refused connection) with a `http_timeout_s` socket timeout. What could not be logged
    # waits in <data_root>/mlflow/outbox and is delivered by the next run that reaches the server (spending at
    # most `flush_budget_s` of its time on it) or by `ctr tracking flush`.
    probe_timeout_s: float = 2.0
    http_max_retries: int = 2
    http_timeout_s: float = 30.0
    flush_budget_s: float = 15.0


@dataclass(frozen=True)
class ServingConfig:
    host: str = "127.0.0.1"
    port: int = 8501
    grpc_port: int = 8500  # TF Serving's gRPC API (serving.grpc_server); -1: REST only
    model_name: str = "ctr"
    max_instances: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    # The model server lists the model store for new versions every poll_seconds, and reads the store's change
    # marker (components.model_store: one small read, a HEAD on S3) every watch_seconds, listing it at once
    # when a version was published, retracted or promoted.
    poll_seconds: float = 1.0
    watch_seconds: float = 0.1
    # What the model's layers compute in (trainer.export PACKED_ENDPOINTS): "bfloat16" runs the matrix products
    # in bfloat16 with float32 weights and sums: 0.67-0.87x float32's time at 100-1,000 candidates on CPUs with
    # AVX512_BF16 or AMX, 1.1-1.4x at 1 candidate, slower still on CPUs without (bench/results/serving_bfloat16.json).
    # On 30 K held-out rows of a trained model (make bench-quality) predictions moved by 0.3 % on average, 3.3 %
    # at most, and AUC by +0.00003.
    precision: Literal["float32", "bfloat16"] = "float32"
    # Where a new full model version is loaded once one is serving (serving.handoff). "process": in a new server
    # process, started beside this one with its imports done, which takes the traffic over on the same ports
    # while this one finishes its requests and exits; a serving process then never drops a model, whose
    # collection stopped every request for 0.05-0.35 s (docs/serving.md). Costs a second process's memory (a
    # server with TensorFlow imported and no model, the standby: about 0.3-0.5 GiB). "thread": in this process,
    # as deltas are.
    full_loads: Literal["process", "thread"] = "process"
    # Row-form predict bodies read by native code (serving/native/rows.c, compiled with the host's `cc` on first
    # use) straight into the model's arguments: 0.2 ms instead of 0.55 ms at 100 candidates of the criteo spec
    # on one core (docs/serving.md). It reads only what it reads exactly as the Python way does and leaves the
    # rest to it; without a C compiler the server logs so and takes the Python way. false: always the Python way.
    native_rows: bool = True
    # A model with tiered tables (storage: tiered) is served with the tables on disk: each served table's rows a
    # request reads are loaded into a row cache of this many rows (a segmented LRU: rows read once out before rows
    # read again), the rest stay in the table's store beside the model (serving/row_cache.py). 0: the hot_rows the
    # spec gives the table.
    row_cache_rows: int = 0
    # The row cache's protected segment, as a share of its rows: rows read by more than one request, and the
    # preload's most counted rows, evicted only after the rows read once. 0: a plain LRU cache.
    row_cache_protected_share: float = 0.8
    # A `Server-Timing` header on every answered predict, classify and regress request (REST): the request's stages
    # in the server, in milliseconds (read, queue, compute, return: ctr_request_stage_seconds), then its whole time
    # in the app until the answer starts (app), which a browser's or a load generator's client reads beside its
    # own time. false: the stages stay in /metrics only.
    server_timing: bool = True


@dataclass(frozen=True)
class PipelineConfig:
    paths: PathsConfig = field(default_factory=PathsConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    spark: SparkConfig = field(default_factory=SparkConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    incremental: IncrementalConfig = field(default_factory=IncrementalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    @property
    def tracking_uri(self) -> str:
        return self.tracking.tracking_uri or f"sqlite:///{self.paths.root / 'mlflow' / 'mlflow.db'}"

    def flat(self) -> dict[str, str]:
        """Every value as `section.key -> str`, for MLflow params and logs."""
        out: dict[str, str] = {}
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            for item in dataclasses.fields(values):
                value = getattr(values, item.name)
                if isinstance(value, tuple):
                    value = ",".join(str(v) for v in value)
                out[f"{section.name}.{item.name}"] = str(value)
        return out

    def with_overrides(self, overrides: Mapping[str, Any]) -> PipelineConfig:
        """Returns a copy with `section.key` values replaced, each parsed to the field's type."""
        sections: dict[str, dict[str, Any]] = {}
        for dotted, raw in overrides.items():
            section, _, key = dotted.partition(".")
            current = getattr(self, section, None) if section else None
            if current is None or not dataclasses.is_dataclass(current) or not key:
                raise ConfigError(
                    f"unknown config key {dotted!r}: expected 'section.key' with section one of "
                    f"{[f.name for f in dataclasses.fields(self)]}"
                )
            fields = {f.name: f for f in dataclasses.fields(current)}
            if key not in fields:
                raise ConfigError(
                    f"unknown config key {dotted!r}: section {section!r} has keys {sorted(fields)}"
                )
            hint = typing.get_type_hints(type(current))[key]
            sections.setdefault(section, {})[key] = _parse(dotted, raw, hint)
        replaced = {name: dataclasses.replace(getattr(self, name), **values) for name, values in sections.items()}
        return dataclasses.replace(self, **replaced)


# Environment variables read at the edge, and the config key each one sets.
ENVIRONMENT_KEYS: dict[str, str] = {
    "CTR_HOME": "paths.data_root",
    "CTR_MODEL_STORE": "paths.model_store",
    "CTR_S3_ENDPOINT_URL": "paths.s3_endpoint_url",
    "MLFLOW_TRACKING_URI": "tracking.tracking_uri",
    "SPARK_REMOTE": "spark.remote",
}


def load_config(
    overrides: Mapping[str, Any] | None = None,
    yaml_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> PipelineConfig:
    """Builds the config from defaults, an optional YAML file, the environment and explicit overrides."""
    values: dict[str, Any] = {}
    if yaml_path:
        import yaml

        path = Path(yaml_path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}  # safe: plain data only, no tags that build objects
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not plain YAML data: {err}") from err
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(loaded).__name__}")
        for section, items in loaded.items():
            if not isinstance(items, dict):
                raise ConfigError(f"config file {str(path)!r}: section {section!r} must be a mapping, got {items!r}")
            for key, value in items.items():
                values[f"{section}.{key}"] = value
    env = os.environ if environ is None else environ
    for variable, key in ENVIRONMENT_KEYS.items():
        if env.get(variable):
            values[key] = env[variable]
    values.update(overrides or {})
    return PipelineConfig().with_overrides(values)


def parse_override_args(pairs: list[str]) -> dict[str, str]:
    """Parses CLI `--set section.key=value` pairs."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"override {pair!r} is not of the form section.key=value")
        out[key.strip()] = value.strip()
    return out


def _parse(key: str, raw: Any, hint: Any) -> Any:
    try:
        if hint is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"1", "true", "yes", "on"}:
                return True
            if text in {"0", "false", "no", "off"}:
                return False
            raise ValueError("expected true or false")
        if hint is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError("expected an integer")
            return int(raw)
        if hint is float:
            return float(raw)
        if hint is str:
            if raw is None:  # an empty YAML value; str(None) would silently become the text "None"
                raise ValueError("expected a string, write '' for an empty one")
            return str(raw)
        origin = typing.get_origin(hint)
        if origin is Literal:
            allowed = typing.get_args(hint)
            text = str(raw).strip() if raw is not None else raw
            if text not in allowed:
                raise ConfigError(f"config key {key!r}: unknown value {raw!r}; expected one of "
                                  f"{', '.join(map(str, allowed))}")
            return text
        if origin is tuple:
            (item_type, *_rest) = typing.get_args(hint)
            # "64,32", or as YAML writes a list ("[64, 32]", what a config file holds)
            text = str(raw).strip()
            text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            items = raw if isinstance(raw, list | tuple) else [p for p in text.split(",") if p.strip()]
            return tuple(item_type(p) for p in items)
        if origin in (typing.Union, types.UnionType):
            return raw
    except (TypeError, ValueError) as err:
        type_name = getattr(hint, "__name__", hint)
        raise ConfigError(f"config key {key!r}: cannot read {raw!r} as {type_name}: {err}") from err
    raise ConfigError(f"config key {key!r}: unsupported type {hint!r}")
