"""A feature spec with tiered tables (storage: tiered) through the daily run and two minute runs, in-process: the
tables train through hot tiers smaller than themselves, the daily export is served whole, each minute's delta
carries the rows its batches read of a tiered table (its checkpoint holds only those rows, on top of its
parent's), and serving the chain answers as the last checkpoint does."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from components.config import load_config
from components.delta import DELTA_KIND
from components.feature_spec import PRESET_DIR
from components.feature_state import categorical_rows, load_feature_state, transform_dense
from components.interval import Interval
from components.layout import Layout
from components.model_store import open_model_store
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES
from components.synthetic import generate
from pipelines.context import RunContext
from pipelines.runner import run_steps, select_steps
from serving.watcher import ModelWatcher
from tests.pipelines.test_incremental_pipeline import OVERRIDES, raw_columns, run_minute

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAY = Interval.parse("2026-01-01T00:00", "2026-01-01T00:10")
TIERED = ("C1", "C2")
HOT_ROWS = 300  # above a batch's 256 rows, below the tables' rows (416 and more)
CACHE_ROWS = 64  # the served row cache: requests of 40 rows evict each other's rows


def tiered_criteo(directory: Path) -> Path:
    spec = yaml.safe_load((PRESET_DIR / "criteo.yaml").read_text())
    spec["name"] = "criteo_tiered"
    categorical = next(entry for entry in spec["features"] if entry["kind"] == "categorical")
    spec["features"].remove(categorical)
    spec["features"] += [{**categorical, "names": list(TIERED), "storage": "tiered", "hot_rows": HOT_ROWS},
                         {**categorical, "names": [n for n in categorical["names"] if n not in TIERED]}]
    path = directory / "criteo_tiered.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def chain(tmp_path_factory, spark):
    root = tmp_path_factory.mktemp("tiered")
    config = load_config(overrides={"paths.data_root": str(root), **OVERRIDES, "serving.row_cache_rows": CACHE_ROWS,
                                    "features.spec": str(tiered_criteo(root))}, environ={})
    generate(config.generate, Layout(config.paths.root))
    daily = run_steps(RunContext(config=config, interval=DAY, pipeline="daily", run_id="test-daily"),
                      select_steps("daily", None))
    outputs = {minute: run_minute(config, minute) for minute in ("2026-01-01T00:10", "2026-01-01T00:11")}
    return {"config": config, "store": open_model_store(config.paths.model_store_uri), "daily": daily,
            "outputs": outputs, "layout": Layout(config.paths.root)}


def in_memory_predictions(layout: Layout, minute: str, columns: dict, spec) -> np.ndarray:
    from trainer.model_inputs import model_inputs
    from trainer.train import load_in_memory

    directory = layout.incremental_dir(Interval.minute(minute))
    state = load_feature_state(directory / "feature_state")
    model = load_in_memory(directory / "checkpoint", model_inputs(spec).tables)
    dense = np.array([columns[name] for name in DENSE_FEATURES], dtype=np.float32).T
    rows = [categorical_rows(pa.array(columns[name], pa.string()), *state.lookup(name))
            for name in spec.categorical_names]
    inputs = {"dense": transform_dense(dense, state).astype(np.float32), "categorical": np.stack(rows, axis=1)}
    return np.asarray(model(inputs, training=False)).reshape(-1)


def test_the_daily_run_trains_the_tiered_tables_through_hot_tiers_and_reports_them(chain):
    from components.feature_spec import spec_for

    layout, config = chain["layout"], chain["config"]
    checkpoint = json.loads((layout.checkpoint_dir(DAY) / "manifest.json").read_text())
    assert checkpoint["tiered_tables"] == dict.fromkeys(TIERED, HOT_ROWS)
    sizes = load_feature_state(layout.feature_state_dir(DAY)).table_sizes()
    assert min(sizes[name] for name in TIERED) > HOT_ROWS  # the hot tier is smaller than the table
    from components.table_report import format_report

    report = json.loads((layout.evaluation_dir(DAY) / "tables.json").read_text())
    tables = {t["name"]: t for t in report["tables"]}
    text = format_report(report)
    for name in TIERED:
        assert f"tiered {name}: {HOT_ROWS} hot rows, hit rate {100 * tables[name]['hit_rate']:.1f} %" in text
    for name in TIERED:
        assert tables[name]["storage"] == "tiered" and 0 < tables[name]["hit_rate"] < 1
        assert tables[name]["rows_written_back"] > 0  # rows were evicted and written back during training
        # A new store draws a row from its seed until the row is first written, without a read on a hole.
        assert 0 < tables[name]["rows_drawn_without_read"] <= tables[name]["rows_drawn"] <= tables[name]["rows_loaded"]
        assert f"{tables[name]['rows_drawn']:,} rows drawn from their seed" in text
    assert set(CATEGORICAL_FEATURES) - set(TIERED) <= {n for n, t in tables.items() if t["storage"] == "memory"}
    spec = spec_for(config)
    assert [name for name, table in spec.tables().items() if table.tiered] == list(TIERED)


def test_each_minute_publishes_the_rows_its_batches_read_and_serving_answers_as_its_checkpoint(chain, tmp_path):
    from components.feature_spec import spec_for

    store, layout = chain["store"], chain["layout"]
    versions = store.versions("ctr")
    assert versions[-2:] == ["202601010011", "202601010012"]
    for position, minute in enumerate(chain["outputs"], start=1):
        manifest = store.manifest("ctr", Interval.minute(minute).end.strftime("%Y%m%d%H%M"))
        assert manifest["kind"] == DELTA_KIND
        table = next(path for path in manifest["rows_changed"] if path.endswith("embedding/embeddings"))
        total = next(s for s in manifest["weight_specs"] if s["path"] == table)["shape"][0]
        assert 0 < manifest["rows_changed"][table] < total - 26 * 10  # a minute's rows, not the tables
        train = chain["outputs"][minute]["train"]
        assert set(train["tiered_rows_touched"]) == set(TIERED) and min(train["tiered_rows_touched"].values()) > 0
        tables = layout.incremental_dir(Interval.minute(minute)) / "checkpoint" / "tables"
        # Rows, no table: the minute's overlays, and at the chain's second minute the spans of both minutes,
        # written by the step after the publish into tables/spans/ (trainer/tiered_tables.py, `write_spans`).
        assert sorted(p.name for p in tables.iterdir()) == sorted(
            ["C1.overlay.npz", "C2.overlay.npz", *(["spans"] if position == 2 else [])])
        spans = chain["outputs"][minute]["spans"]["span_rows"]
        if position == 2:
            assert sorted(p.name for p in (tables / "spans").iterdir()) == [
                "C1.span.npz", "C2.span.npz", "manifest.json"]
            assert set(spans) == set(TIERED) and min(spans.values()) >= min(train["tiered_rows_touched"].values())
        else:
            assert spans == {}
        caches = [spec["path"] for spec in manifest["weight_specs"] if "/tiered_table_" in spec["path"]]
        assert len(caches) == 2 and all(manifest["rows_changed"][path] == 0 for path in caches)  # serving fills them
    # The first minute made the chain's live stores from the daily checkpoint's; the second trained them in place.
    assert [chain["outputs"][m]["train"]["tiered_live_reused"] for m in chain["outputs"]] == [False, True]
    columns = raw_columns(layout, "2026-01-01T00:15")
    watcher = ModelWatcher(store, "ctr", tmp_path / "cache", poll_seconds=60)
    assert watcher.poll_once() and watcher.version == "202601010012"
    expected = in_memory_predictions(layout, "2026-01-01T00:11", columns, spec_for(chain["config"]))
    served = watcher.current()
    # Loaded, the model's caches hold the reserved rows and the rows training counted most (the export's preload
    # rows), as many as each cache holds, before the first request.
    full = store.manifest("ctr", "202601010010")
    for table in served.tiered.tables:
        preload = np.load(served.directory / full["tiered_serving"][table.name]["preload"])
        assert len(preload) == CACHE_ROWS and len(set(preload.tolist())) == CACHE_ROWS
        assert preload[:2].tolist() == [0, 1]
        # the warm-up's rows (the missing row) among them; the most counted in the protected segment
        assert set(table.slots) | set(table.protected) == set(preload.tolist())
        assert set(table.protected) == set(preload[:table.protected_rows].tolist())
        assert table.rows_preloaded == CACHE_ROWS and table.rows_loaded == 0
    # The first request reads some of them and loads the rest, with one load call for both tables, which answers
    # it too (the loaded endpoint, on the inputs the cached endpoint's call preprocessed: two graph calls).
    before = {name: counts["rows_loaded"] for name, counts in served.tiered.counters().items()}
    calls, loaded_answers = served.tiered.load_calls, served.tiered.loaded_answers
    first = served.predict_columns({name: values[:40] for name, values in columns.items()})
    np.testing.assert_allclose(first, expected[:40], rtol=0, atol=1e-6)
    assert served.tiered.load_calls == calls + 1 and served.tiered.loaded_answers == loaded_answers + 1
    assert all(counts["rows_loaded"] > before[name] and counts["rows_hit"] > 0
               for name, counts in served.tiered.counters().items())
    # The export writes the caches through that one endpoint; the per-table loads and the rows endpoint of
    # earlier exports are gone.
    assert hasattr(served.root, "load_all_slots") and not hasattr(served.root, "tiered_rows")
    assert not any(hasattr(served.root, f"load_slots_{table}") for table in range(len(CATEGORICAL_FEATURES)))
    # Requests of 40 rows through row caches of 64: each loads what it reads, evicting what earlier ones read.
    chunks = [served.predict_columns({name: values[start:start + 40] for name, values in columns.items()})
              for start in range(0, len(expected), 40)]
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=0, atol=1e-6)
    # The last request again: its rows are all cached, so the model answers it in one graph call.
    answered = served.tiered.one_call_answers
    start = (len(expected) - 1) // 40 * 40
    last = {name: values[start:start + 40] for name, values in columns.items()}
    np.testing.assert_allclose(served.predict_columns(last), expected[start:start + 40], rtol=0, atol=1e-6)
    assert served.tiered.one_call_answers == answered + 1
    # The same requests from four threads at once: loads wait for the requests reading the cache, and a request
    # whose rows another one evicted loads them again.
    from concurrent.futures import ThreadPoolExecutor

    starts = list(range(0, len(expected), 40)) * 3
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda start, model=served: (start, model.predict_columns({n: v[start:start + 40]
                                                                      for n, v in columns.items()})),
            starts))
    for start, answer in answers:
        np.testing.assert_allclose(answer, expected[start:start + 40], rtol=0, atol=1e-6)
    # Served as exports before the loaded endpoint are (the same replica and caches, without that endpoint): the
    # load, then the packed call under the read lock (three calls).
    import dataclasses

    assert served.packed is not None and served.packed.loaded_function is not None
    older = dataclasses.replace(served, packed=dataclasses.replace(served.packed, loaded_function=None))
    loaded_answers, calls = served.tiered.loaded_answers, served.tiered.load_calls
    chunks = [older.predict_columns({name: values[start:start + 40] for name, values in columns.items()})
              for start in range(0, len(expected), 40)]
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=0, atol=1e-6)
    assert served.tiered.loaded_answers == loaded_answers and served.tiered.load_calls > calls
    counters = served.tiered.counters()
    assert set(counters) == set(TIERED)
    for name in TIERED:
        assert counters[name]["cache_rows"] == CACHE_ROWS and counters[name]["cached"] <= CACHE_ROWS
        # rows were evicted and loaded again (the preloaded rows among the ones evicted)
        assert counters[name]["rows_loaded"] + counters[name]["rows_preloaded"] > CACHE_ROWS
        assert counters[name]["delta_rows"] > 0  # the two minutes' rows, kept beside the store
    # /metrics shows the same counters, per table.
    from starlette.testclient import TestClient

    from components.config import ServingConfig
    from serving.app import create_app

    text = TestClient(create_app(watcher, ServingConfig(model_name="ctr"))).get("/metrics").text
    for name in TIERED:
        for metric, key in (("hits_total", "rows_hit"), ("loads_total", "rows_loaded"), ("rows", "cached"),
                            ("capacity_rows", "cache_rows"), ("delta_rows", "delta_rows"),
                            ("preloaded_rows", "rows_preloaded"), ("protected_rows", "protected")):
            assert f'ctr_row_cache_{metric}{{table="{name}"}} {float(counters[name][key])}\n' in text
    assert f"ctr_row_cache_load_calls_total {float(served.tiered.load_calls)}\n" in text
    assert served.tiered.loaded_answers > 0
    assert f"ctr_row_cache_loaded_answers_total {float(served.tiered.loaded_answers)}\n" in text
    # ... on disk under the watcher's cache, a sparse store per table, gone with the model.
    scratch = served.tiered.scratch
    assert scratch is not None and scratch.parent == tmp_path / "cache" / "delta-rows"
    assert sorted(path.name for path in scratch.iterdir()) == sorted(f"{name}.rows" for name in TIERED)
    from serving.model import InvalidInput

    with pytest.raises(InvalidInput, match=r"distinct rows of tiered table 'C\d', more than its row cache of 64"):
        served.predict_columns(columns)  # 300 rows at once read more rows than the cache holds
    assert set(full["tiered_serving"]) == set(TIERED) and "tables/C1.rows" in full["files"]
    assert "tables/C1.preload.npy" in full["files"]
    del served, older, answers, watcher
    gc.collect()
    assert not scratch.exists()


def test_a_minute_on_the_jax_backend_trains_the_chains_live_stores_and_serving_answers_as_its_checkpoint(
        chain, tmp_path):
    """train.backend=jax for the next minute (a child process without TensorFlow): it trains the live stores
    the TensorFlow minutes left, in place, through its hot tiers; its delta carries the rows its batches read,
    and serving the chain answers as its checkpoint does."""
    from components.feature_spec import spec_for
    from components.synthetic import SUCCESS_MARKER, write_minute

    config, layout, store = chain["config"], chain["layout"], chain["store"]
    minute = "2026-01-01T00:12"
    start = Interval.minute(minute).start
    if not (layout.raw_minute_dir(start) / SUCCESS_MARKER).exists():
        write_minute(config.generate, layout, start.hour * 60 + start.minute, start)
    train = run_minute(config, minute, **{"train.backend": "jax"})["train"]
    assert train["tiered_live_reused"] is True  # the chain's stores, trained in place
    assert set(train["tiered_rows_touched"]) == set(TIERED) and min(train["tiered_rows_touched"].values()) > 0
    for name in TIERED:
        assert train["tiered_tables"][name]["tier_rows_loaded"] > 0
    assert store.latest("ctr") == "202601010013"
    manifest = store.manifest("ctr", "202601010013")
    assert (manifest["kind"], manifest["parent"]) == (DELTA_KIND, "202601010012")
    table = next(path for path in manifest["rows_changed"] if path.endswith("embedding/embeddings"))
    assert manifest["rows_changed"][table] > 0
    columns = raw_columns(layout, "2026-01-01T00:15")
    watcher = ModelWatcher(store, "ctr", tmp_path / "cache", poll_seconds=60)
    assert watcher.poll_once() and watcher.version == "202601010013"
    expected = in_memory_predictions(layout, minute, columns, spec_for(config))
    served = watcher.current()
    chunks = [served.predict_columns({name: values[start:start + 40] for name, values in columns.items()})
              for start in range(0, len(expected), 40)]
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def linear_chain(tmp_path_factory, spark):
    """The same spec trained with Wide & Deep, whose linear part reads the tiered tables too: a daily run and a
    minute. (DeepFM, tested through the export in the `criteo_tiered_deepfm` case of test_spec_pipeline.py, failed
    the quality gate here: held-out AUC 0.7071 against the linear baseline's 0.7742 on these generated rows.)"""
    root = tmp_path_factory.mktemp("tiered_wide_deep")
    config = load_config(overrides={"paths.data_root": str(root), **OVERRIDES, "serving.row_cache_rows": CACHE_ROWS,
                                    "features.spec": str(tiered_criteo(root)), "train.model": "wide_deep"},
                         environ={})
    generate(config.generate, Layout(config.paths.root))
    run_steps(RunContext(config=config, interval=DAY, pipeline="daily", run_id="test-daily-wide-deep"),
              select_steps("daily", None))
    minute = "2026-01-01T00:10"
    return {"config": config, "store": open_model_store(config.paths.model_store_uri), "minute": minute,
            "output": run_minute(config, minute), "layout": Layout(config.paths.root)}


def test_a_wide_deep_minute_on_tiered_tables_is_served_as_its_checkpoint_through_the_row_caches(linear_chain,
                                                                                               tmp_path):
    """Each record of the stores, the minute's overlays and its delta is a row's values then its linear weight:
    the served row caches of both layers take their parts, and the chain answers as the checkpoint read into
    memory."""
    from components.feature_spec import spec_for
    from trainer.tiered_tables import read_overlays

    store, layout, config = linear_chain["store"], linear_chain["layout"], linear_chain["config"]
    assert store.latest("ctr") == "202601010011"
    manifest = store.manifest("ctr", "202601010011")
    caches = [spec["path"] for spec in manifest["weight_specs"] if "/tiered_table_" in spec["path"]]
    assert len(caches) == 4 and all(manifest["rows_changed"][path] == 0 for path in caches)  # two layers' caches
    overlays = read_overlays(layout.incremental_dir(Interval.minute(linear_chain["minute"])) / "checkpoint")
    dim = config.train.embedding_dim
    assert {name: overlay["values"].shape[1] for name, overlay in overlays.items()} == dict.fromkeys(TIERED, dim + 1)
    assert all(np.count_nonzero(overlay["values"][:, dim]) for overlay in overlays.values())
    columns = raw_columns(layout, "2026-01-01T00:15")
    watcher = ModelWatcher(store, "ctr", tmp_path / "cache", poll_seconds=60)
    assert watcher.poll_once() and watcher.version == "202601010011"
    expected = in_memory_predictions(layout, linear_chain["minute"], columns, spec_for(config))
    served = watcher.current()
    chunks = [served.predict_columns({name: values[start:start + 40] for name, values in columns.items()})
              for start in range(0, len(expected), 40)]
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=0, atol=1e-6)
    counters = served.tiered.counters()
    for name in TIERED:
        assert counters[name]["rows_loaded"] + counters[name]["rows_preloaded"] > CACHE_ROWS
        assert counters[name]["delta_rows"] > 0
    # With serving.row_cache_protected_share 0 the caches are plain LRU (no protected row, preloaded or read
    # again) and answer the same; the default's caches protect some.
    plain = ModelWatcher(store, "ctr", tmp_path / "cache-lru", poll_seconds=60, row_cache_protected_share=0.0)
    assert plain.poll_once() and plain.version == "202601010011"
    lru = plain.current()
    chunks = [lru.predict_columns({name: values[start:start + 40] for name, values in columns.items()})
              for start in range(0, len(expected), 40)]
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=0, atol=1e-6)
    assert all(t.protected_rows == 0 and not t.protected and t.num_cached > 0 for t in lru.tiered.tables)
    assert all(t.protected_rows == int(CACHE_ROWS * 0.8) and t.protected for t in served.tiered.tables)
    del served, watcher, lru, plain
    gc.collect()
