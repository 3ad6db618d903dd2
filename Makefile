# Every target runs inside the one environment built from requirements.lock (tools/ensure_env.sh builds it on
# first use, outside the clone, keyed by the lock's hash, and reuses it after).
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c
WITH_ENV = env_dir=$$(tools/ensure_env.sh); export PATH="$$env_dir/bin:$$PATH" VIRTUAL_ENV="$$env_dir"
WITH_STACK_ENV = env_dir=$$(tools/ensure_env.sh --stack); export PATH="$$env_dir/bin:$$PATH" VIRTUAL_ENV="$$env_dir"
# Benchmarks are scripts under bench/: the repository root goes on the path so they import the project.
BENCH = PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" python
PYTEST_ARGS ?=
FUZZ_SECONDS ?= 300

.PHONY: help env test test-unit fuzz-native lint demo lock airflow-ui mlflow-ui serve stack stack-down stack-status test-stack bench-encode bench-input bench-train \
	bench-naive bench-gpu bench-scale bench-real bench-history bench-multi-hash bench-quality bench-quality-reference bench-spark bench-freshness bench-zoo-jax bench-events-quality bench-serving bench-reliability bench-tiers bench-tier-policy bench-tier-step bench-chain-spans bench-updates bench-row-cache bench-row-cache-calls bench-row-cache-eviction bench-native-rows bench-s3-persistence bench-worker-memory clean

help:
	@echo "make demo      generate data, run ctr_daily through Airflow, serve and query the model"
	@echo "make test      run the whole test suite"
	@echo "make test-unit run the fast unit tests only"
	@echo "make fuzz-native  fuzz the native JSON row reader (serving/native/rows.c) for FUZZ_SECONDS (300)"
	@echo "make stack     the production topology (Airflow on Celery, MLflow, S3, Spark Connect, serving) on this machine"
	@echo "make test-stack  bring a stack up, run the daily and minute pipelines through it, bring it down"
	@echo "make lint      ruff"
	@echo "make lock      re-resolve requirements.lock from requirements.in"

env:
	@$(WITH_ENV); echo "environment: $$env_dir"

test:
	@$(WITH_ENV); python -m pytest $(PYTEST_ARGS)

test-unit:
	@$(WITH_ENV); python -m pytest -m unit $(PYTEST_ARGS)

# serving/native/rows.c under libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer (make test runs 25 s of
# it); FUZZ_DIR=<folder> keeps the corpus it grows and its reproducers there for the next run.
fuzz-native:
	@$(WITH_ENV); tools/fuzz_native_rows.sh $(FUZZ_SECONDS)

lint:
	@$(WITH_ENV); ruff check .

demo:
	@$(WITH_ENV); python -m pipelines.demo

lock:
	uv pip compile requirements.in -p 3.11 -o requirements.lock --no-header

airflow-ui:
	@$(WITH_ENV); python -m pipelines.cli ui airflow

mlflow-ui:
	@$(WITH_ENV); python -m pipelines.cli ui mlflow

clean:
	rm -rf var .pytest_cache

serve:
	@$(WITH_ENV); python -m pipelines.cli serve

# The production topology as processes on this machine (pipelines/stack.py; docs/production.md).
stack:
	@$(WITH_STACK_ENV); python -m pipelines.cli stack up

stack-down:
	@$(WITH_STACK_ENV); python -m pipelines.cli stack down

stack-status:
	@$(WITH_STACK_ENV); python -m pipelines.cli stack status

# Brings a stack up on free ports, runs ctr_daily and two minutes of ctr_incremental through it, brings it down.
test-stack:
	@$(WITH_STACK_ENV); CTR_TEST_STACK=1 python -m pytest tests/stack -s $(PYTEST_ARGS)

bench-encode:
	@$(WITH_ENV); $(BENCH) bench/bench_block_encode.py

BENCH_MULTI_HASH_ARGS ?=
bench-multi-hash:
	@$(WITH_ENV); $(BENCH) bench/bench_multi_hash.py $(BENCH_MULTI_HASH_ARGS)

BENCH_TIERS_ARGS ?=
bench-tiers:
	@$(WITH_ENV); $(BENCH) bench/bench_tiers.py $(BENCH_TIERS_ARGS)

# A day of minute checkpoints over one tiered table, with the chain's spans and without: the minute's writes and
# a table made from the chain late in the day (~10 min).
BENCH_CHAIN_SPANS_ARGS ?=
bench-chain-spans:
	@$(WITH_ENV); $(BENCH) bench/bench_chain_spans.py $(BENCH_CHAIN_SPANS_ARGS)

# LRU against LFU eviction on bench-tiers' stream of ids (no training, no I/O; ~2 min).
BENCH_TIER_POLICY_ARGS ?=
bench-tier-policy:
	@$(WITH_ENV); $(BENCH) bench/bench_tier_policy.py $(BENCH_TIER_POLICY_ARGS)

# Where a tiered table's step time goes: the in-memory step, the tiered layer fed slot ids, the hot tier (~3 min).
BENCH_TIER_STEP_ARGS ?=
bench-tier-step:
	@$(WITH_ENV); $(BENCH) bench/bench_tier_step.py $(BENCH_TIER_STEP_ARGS)

# The local S3 endpoint across a restart: moto's recorder against the stack's snapshot of the buckets.
BENCH_S3_PERSISTENCE_ARGS ?=
bench-s3-persistence:
	@$(WITH_ENV); $(BENCH) bench/bench_s3_persistence.py $(BENCH_S3_PERSISTENCE_ARGS)

# The step worker's resident memory minute after minute, with glibc's arenas as they come and capped.
BENCH_WORKER_MEMORY_ARGS ?=
bench-worker-memory:
	@$(WITH_ENV); $(BENCH) bench/bench_worker_memory.py $(BENCH_WORKER_MEMORY_ARGS)

# The JAX step's dense embedding update against the TensorFlow step's row-sparse one as the table grows.
BENCH_UPDATES_ARGS ?=
bench-updates:
	@$(WITH_ENV); $(BENCH) bench/bench_updates.py $(BENCH_UPDATES_ARGS)

# Serving tiered tables from their stores through the row cache (cold, warm, evicting) against them in memory.
BENCH_ROW_CACHE_ARGS ?=
bench-row-cache:
	@$(WITH_ENV); $(BENCH) bench/bench_row_cache.py $(BENCH_ROW_CACHE_ARGS)

# What a logistic regression told the generated day's planted form reaches at 900,000 rows.
BENCH_QUALITY_REFERENCE_ARGS ?=
bench-quality-reference:
	@$(WITH_ENV); $(BENCH) bench/bench_quality_reference.py $(BENCH_QUALITY_REFERENCE_ARGS)

# One tiered export served with two graph calls a miss and with three, fresh servers each round, passes alternated.
BENCH_ROW_CACHE_CALLS_ARGS ?=
bench-row-cache-calls:
	@$(WITH_ENV); $(BENCH) bench/bench_row_cache_calls.py $(BENCH_ROW_CACHE_CALLS_ARGS)

# The row cache's segmented LRU against a plain LRU, served: fresh servers each round, passes alternated.
BENCH_ROW_CACHE_EVICTION_ARGS ?=
bench-row-cache-eviction:
	@$(WITH_ENV); $(BENCH) bench/bench_row_cache_eviction.py $(BENCH_ROW_CACHE_EVICTION_ARGS)

bench-native-rows:
	@$(WITH_ENV); $(BENCH) bench/bench_native_rows.py $(BENCH_NATIVE_ROWS_ARGS)

bench-input:
	@$(WITH_ENV); $(BENCH) bench/bench_input.py

bench-train:
	@$(WITH_ENV); $(BENCH) bench/bench_train.py

bench-naive:
	@$(WITH_ENV); $(BENCH) bench/bench_naive.py

bench-quality:
	@$(WITH_ENV); $(BENCH) bench/bench_quality.py $(BENCH_QUALITY_ARGS)

# The events spec's columns and sequence models on 1 M generated impressions (~15 min here).
bench-events-quality:
	@$(WITH_ENV); $(BENCH) bench/bench_events_quality.py $(BENCH_EVENTS_QUALITY_ARGS)

bench-spark:
	@$(WITH_ENV); $(BENCH) bench/bench_spark.py $(BENCH_SPARK_ARGS)

# The model server on one core: 1 / 100 / 1,000 candidates, open loop to p99 10 ms, full and delta swaps.
bench-serving:
	@$(WITH_ENV); $(BENCH) bench/bench_serving.py $(BENCH_SERVING_ARGS)

# Bad raw data through real minute runs, bad requests under good traffic, faults (tracking server, S3, a killed
# training, a corrupt checkpoint): bench/results/reliability.json.
bench-reliability:
	@$(WITH_ENV); $(BENCH) bench/bench_reliability.py $(BENCH_RELIABILITY_ARGS)

# Airflow's ctr_incremental, Spark Connect, live traffic and the model server under load, for 12 minutes.
bench-freshness:
	@$(WITH_ENV); $(BENCH) bench/bench_freshness.py $(BENCH_FRESHNESS_ARGS)

# For an NVIDIA GPU host with JAX and no TensorFlow. BENCH_GPU_ARGS=--small: tiny sizes (a CPU check);
# BENCH_GPU_ARGS=--data-only: only the TensorFlow-free write + read path.
bench-gpu:
	@$(WITH_ENV); KERAS_BACKEND=jax $(BENCH) bench/bench_gpu.py $(BENCH_GPU_ARGS)

# The pipeline's JAX train step (train.backend=jax) on the criteo spec's DCNv2-small, from block TFRecords.
# A first training over months of sparse minute partitions against the same rows in one day (bench/results/history.json).
bench-history:
	@$(WITH_ENV); $(BENCH) bench/bench_history.py $(BENCH_HISTORY_ARGS)

# Real logs (MovieLens 100K and the Open Bandit Dataset from their wheels, the samples in ../shared/data), defaults
# only: the served model against a hashed logistic regression on later rows (bench/results/real.json).
bench-real:
	@$(WITH_ENV); $(BENCH) bench/bench_real.py $(BENCH_REAL_ARGS)

bench-scale:
	@$(WITH_ENV); KERAS_BACKEND=jax $(BENCH) bench/bench_scale.py $(BENCH_SCALE_ARGS)

# Every model of the zoo trained, scored and reloaded on the JAX backend (a GPU host without TensorFlow).
bench-zoo-jax:
	@$(WITH_ENV); KERAS_BACKEND=jax $(BENCH) bench/bench_zoo_jax.py
