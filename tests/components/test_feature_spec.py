from __future__ import annotations

import dataclasses
import textwrap

import pytest

from components.config import PipelineConfig
from components.feature_spec import (
    PRESET_DIR,
    CategoricalFeature,
    FeatureDefaults,
    FeatureSpecError,
    HistorySpec,
    SequenceFeature,
    load_spec,
    preset_names,
    spec_for,
    spec_from_dict,
)
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, RAW_COLUMNS

pytestmark = pytest.mark.unit


def _minimal(**extra):
    spec = {
        "name": "team",
        "source": {"format": "csv", "header": True},
        "label": {"column": "clicked"},
        "features": [
            {"name": "user", "kind": "categorical"},
            {"name": "item", "kind": "categorical", "min_count": 3, "embedding_dim": 8},
            {"name": "price", "kind": "dense"},
        ],
    }
    spec.update(extra)
    return spec


def test_the_presets_are_shipped_and_load():
    assert preset_names() == ("avazu", "criteo", "events", "movielens", "obd", "taobao")
    for name in preset_names():
        spec = load_spec(name)
        assert spec.name == name
        # The plain data logged to MLflow (spec.json) is a spec again, with the same hash.
        assert spec_from_dict(spec.as_dict()).hash() == spec.hash()


def test_the_criteo_preset_is_todays_fixed_layout():
    spec = load_spec("criteo")
    assert spec.source.format == "tsv" and spec.source.header is False
    assert spec.source.columns == RAW_COLUMNS
    assert spec.input_columns == RAW_COLUMNS
    assert spec.dense_names == DENSE_FEATURES
    assert spec.categorical_names == CATEGORICAL_FEATURES
    assert list(spec.tables()) == list(CATEGORICAL_FEATURES)
    assert spec.timestamp is None and spec.sequences == ()


def test_avazu_derives_time_features_and_hashes_the_per_user_ids():
    spec = load_spec("avazu")
    assert spec.label.column == "click"
    assert spec.timestamp.format == "%y%m%d%H"
    derived = [f for f in spec.categorical if f.derived_from]
    assert [(f.name, f.derivation) for f in derived] == [("hour_hour_of_day", "hour_of_day"),
                                                         ("hour_day_of_week", "day_of_week")]
    tables = spec.tables()
    assert tables["hour_hour_of_day"].fixed_values == tuple(str(h) for h in range(24))
    assert tables["hour_hour_of_day"].min_count == 1 and tables["hour_hour_of_day"].evict_after_days == 0
    assert tables["device_ip"].hashing.buckets == 65536
    assert tables["site_id"].hashing is None
    # "id" is in the files but not a feature: it is not read.
    assert "id" not in spec.input_columns


def test_a_bucketized_dense_feature_is_read_through_its_bucket_table():
    spec = spec_from_dict(_minimal(features=[
        {"name": "user", "kind": "categorical"},
        {"name": "price", "kind": "dense", "transform": "buckets", "num_buckets": 5},
        {"name": "age", "kind": "dense"},
    ]))
    assert spec.dense_names == ("price", "age")  # both are raw dense inputs of the signature
    assert [f.name for f in spec.scaled_dense] == ["age"]
    assert spec.dense_input_dim == 2  # age and its missing flag; price enters as an embedding
    bucket = spec.feature("price_bucket")
    assert (bucket.kind, bucket.derived_from, bucket.derivation) == ("categorical", "price", "buckets")
    assert spec.categorical_names == ("user", "price_bucket")
    table = spec.tables()["price_bucket"]
    assert table.fixed_values == ("0", "1", "2", "3", "4")
    assert (table.min_count, table.evict_after_days) == (1, 0)
    assert spec.input_columns == ("clicked", "user", "price", "age")
    # The derived feature is not declared: the spec's plain data holds the dense feature only.
    assert [f["name"] for f in spec.as_dict()["features"]] == ["user", "price", "age"]
    other = spec_from_dict(_minimal(features=[
        {"name": "user", "kind": "categorical"},
        {"name": "price", "kind": "dense", "transform": "buckets", "num_buckets": 6},
        {"name": "age", "kind": "dense"},
    ]))
    assert other.hash() != spec.hash()


def test_a_sequence_reads_the_table_of_the_feature_it_shares():
    spec = load_spec("taobao")
    (sequence,) = spec.sequences
    assert (sequence.name, sequence.separator, sequence.max_length) == ("click_sequence", "^", 20)
    assert spec.table_of("click_sequence") == "adgroup_id"
    assert spec.tables()["adgroup_id"].features == ("adgroup_id", "click_sequence")
    events = load_spec("events")
    assert events.table_of("history") == "item_id" and events.sequences[0].separator == ""


def test_unset_settings_come_from_the_pipeline_config():
    spec = spec_from_dict(_minimal()).with_defaults(
        dataclasses.replace(FeatureDefaults.of(), min_count=2, embedding_dim=32))
    tables = spec.tables()
    assert (tables["user"].min_count, tables["user"].embedding_dim) == (2, 32)
    assert (tables["item"].min_count, tables["item"].embedding_dim) == (3, 8)  # pinned in the spec
    config = PipelineConfig().with_overrides({"features.min_count": "5", "features.spec": "avazu"})
    assert spec_for(config).name == "avazu"
    assert spec_for(config).tables()["site_id"].min_count == 5


def test_the_hash_changes_with_any_setting_a_reader_depends_on():
    base = spec_from_dict(_minimal())
    assert base.hash() == spec_from_dict(_minimal()).hash()
    assert base.hash() != base.with_defaults(dataclasses.replace(FeatureDefaults.of(), min_count=2)).hash()
    changed = _minimal()
    changed["features"][2]["transform"] = "standardize"
    assert base.hash() != spec_from_dict(changed).hash()


def test_names_expands_to_one_feature_per_name_with_the_same_settings():
    spec = spec_from_dict(_minimal(features=[{"names": ["a", "b"], "kind": "categorical", "min_count": 4}]))
    assert spec.categorical == (CategoricalFeature(name="a", column="a", min_count=4),
                                CategoricalFeature(name="b", column="b", min_count=4))


def test_a_shared_table_is_declared_once_and_read_by_both_features():
    spec = spec_from_dict(_minimal(features=[
        {"name": "item", "kind": "categorical", "min_count": 3},
        {"name": "last_item", "kind": "categorical", "table": "item"},
        {"name": "items_seen", "kind": "multi_categorical", "separator": "|", "max_length": 5, "table": "item"},
    ]))
    assert list(spec.tables()) == ["item"]
    assert spec.tables()["item"].features == ("item", "last_item", "items_seen")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, r"unknown key 'colour' \(value 'red'\)"),
        ({"features": [{"name": "x", "kind": "fancy"}]}, r"features\[0\]: unknown kind 'fancy'"),
        ({"features": [{"name": "x", "kind": "categorical", "min_cnt": 3}]},
         r"features\[0\]: unknown key 'min_cnt' \(value 3\)"),
        ({"features": [{"name": "x", "kind": "categorical"}, {"name": "x", "kind": "dense"}]},
         r"duplicate feature name 'x'"),
        ({"features": [{"name": "clicked", "kind": "dense"}]}, r"duplicate feature name 'clicked'"),
        ({"features": [{"name": "x", "kind": "categorical"},
                       {"name": "hist", "kind": "sequence", "max_length": 5, "shares": "item"}]},
         r"sequence 'hist' has shares='item', which names no categorical feature"),
        ({"features": [{"name": "hist", "kind": "sequence", "max_length": 5}]},
         r"'hist', kind sequence\): missing required key\(s\) \['shares'\]"),
        ({"features": [{"name": "x", "kind": "categorical", "min_count": 0}]}, r"min_count must be at least 1, got 0"),
        ({"features": [{"name": "x", "kind": "categorical", "min_count": "many"}]},
         r"min_count must be int, got 'many'"),
        ({"features": [{"name": "x", "kind": "dense", "transform": "sqrt"}]}, r"transform: unknown value 'sqrt'"),
        ({"features": [{"name": "x", "kind": "dense", "transform": "buckets", "num_buckets": 1}]},
         r"features\[0\] \('x'\): transform 'buckets' needs num_buckets >= 2, got 1"),
        ({"features": [{"name": "x", "kind": "dense", "transform": "buckets", "embedding_dim": 8}]},
         r"features\[0\]: unknown key 'embedding_dim' \(value 8\)"),
        ({"features": [{"name": "x", "kind": "dense", "transform": "buckets"}, {"name": "x_bucket",
                                                                              "kind": "categorical"}]},
         r"duplicate feature name 'x_bucket'"),
        ({"features": [{"name": "x", "kind": "categorical"}, {"name": "y", "kind": "categorical", "table": "x",
                                                              "min_count": 2}]},
         r"'y' shares the table of 'x', so it cannot set \['min_count'\]"),
        ({"features": [{"name": "y", "kind": "categorical", "table": "nope"}]},
         r"'y' has table='nope', which is not a categorical feature"),
        ({"features": [{"name": "t", "kind": "timestamp", "derive": ["minute_of_hour"]}, {"name": "x",
                                                                                         "kind": "dense"}]},
         r"derive: unknown value 'minute_of_hour'"),
        ({"source": {"format": "tsv"}}, r"source.format='tsv' without a header needs source.columns"),
        ({"source": {"format": "xlsx", "header": True}}, r"source.format: unknown value 'xlsx'"),
        ({"source": {"format": "tsv", "columns": ["clicked", "user"]}},
         r"columns \['item', 'price'\] are read by the spec but not in source.columns"),
        ({"features": [{"name": "bad name", "kind": "dense"}]}, r"name must be letters, digits and _"),
        ({"features": [{"name": "x", "kind": "categorical", "storage": "ssd"}]}, r"storage: unknown value 'ssd'"),
        ({"features": [{"name": "x", "kind": "categorical", "hot_rows": 100}]},
         r"hot_rows=100 sizes the hot tier of a tiered table; set storage: tiered too"),
        ({"features": [{"name": "x", "kind": "categorical", "storage": "tiered", "hot_rows": 0}]},
         r"hot_rows must be at least 1, got 0"),
        ({"features": [{"name": "x", "kind": "categorical", "storage": "tiered", "hashing": {"buckets": 8}}]},
         r"either hashed \(hashing\) or tiered"),
        ({"features": [{"name": "x", "kind": "categorical"}, {"name": "y", "kind": "categorical", "table": "x",
                                                              "storage": "tiered"}]},
         r"'y' shares the table of 'x', so it cannot set \['storage'\]"),
        ({"features": [{"name": "x", "kind": "multi_categorical", "max_length": 3, "storage": "tiered"}]},
         r"unknown key 'storage'"),
        ({"features": []}, r"features must be a non-empty list"),
    ],
)
def test_a_malformed_spec_is_refused_naming_the_key_and_the_value(change, message):
    with pytest.raises(FeatureSpecError, match=message):
        spec_from_dict(_minimal(**change))


def test_a_tiered_table_may_be_read_by_lists_of_ids_too():
    spec = spec_from_dict(_minimal(features=[
        {"name": "x", "kind": "categorical", "storage": "tiered", "hot_rows": 64},
        {"name": "tags", "kind": "multi_categorical", "max_length": 3, "table": "x"}]))
    table = spec.tables()["x"]
    assert table.tiered and table.hot_rows == 64 and set(table.features) == {"x", "tags"}


def test_a_spec_file_is_read_as_safe_yaml_and_never_runs_code(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['touch " + str(tmp_path / "ran") + "']\n")
    with pytest.raises(FeatureSpecError, match="is not valid YAML"):
        load_spec(str(path))
    assert not (tmp_path / "ran").exists()


def test_a_spec_is_loaded_from_a_yaml_file(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(textwrap.dedent("""\
        name: team
        source: {format: parquet}
        label: clicked
        features:
          - {name: item, kind: categorical, dtype: int}
          - {name: viewed, kind: sequence, shares: item, max_length: 3}
    """))
    spec = load_spec(str(path))
    assert spec.label.column == "clicked"
    assert spec.sequences == (SequenceFeature(name="viewed", column="viewed", max_length=3, shares="item"),)


def test_an_unknown_preset_or_missing_file_says_what_exists():
    with pytest.raises(FeatureSpecError, match=r"features.spec='kriteo' is neither a preset \(avazu, criteo"):
        load_spec("kriteo")
    with pytest.raises(FeatureSpecError, match=r"the file 'nope.yaml' does not exist"):
        load_spec("nope.yaml")


def test_a_preset_name_is_the_preset_even_beside_a_folder_or_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "criteo").mkdir()  # a team's data folder, named after its layout
    (tmp_path / "avazu").write_text("not: [a spec")
    assert load_spec("criteo") == load_spec(str(PRESET_DIR / "criteo.yaml"))
    assert load_spec("avazu").name == "avazu"
    with pytest.raises(FeatureSpecError, match=r"features.spec='\./criteo' is a directory; expected a preset name "
                                               r"\(avazu, criteo.*\) or a feature spec YAML file"):
        load_spec("./criteo")
    (tmp_path / "team").mkdir()
    with pytest.raises(FeatureSpecError, match=r"features.spec='team' is a directory; expected a preset name"):
        load_spec("team")
    (tmp_path / "specs.yaml").mkdir()
    with pytest.raises(FeatureSpecError, match=r"features.spec='specs.yaml' is a directory"):
        load_spec("specs.yaml")


def test_the_cli_reads_a_preset_beside_a_folder_of_its_name(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CTR_HOME", str(tmp_path / "var"))
    (tmp_path / "criteo").mkdir()
    log = tmp_path / "criteo" / "day.tsv"
    log.write_text("\t".join(["1", *["2"] * 13, *["a"] * 26]) + "\n")
    assert main(["ingest", "--spec", "criteo", str(log), "--start", "2026-01-01T00:00"]) == 0
    assert "1 rows in 1 minutes" in capsys.readouterr().out
    assert main(["ingest", "--spec", "./criteo", str(log), "--start", "2026-01-01T00:00"]) == 2
    assert "features.spec='./criteo' is a directory; expected a preset name" in capsys.readouterr().err


def test_the_source_encoding_is_checked_and_leaves_the_hash_of_utf8_specs_alone():
    default = spec_from_dict(_minimal())
    assert default.source.encoding == "utf-8" and "encoding" not in default.as_dict()["source"]
    latin = spec_from_dict(_minimal(source={"format": "csv", "header": True, "encoding": "latin-1"}))
    assert latin.as_dict()["source"]["encoding"] == "latin-1" and latin.hash() != default.hash()
    assert spec_from_dict(latin.as_dict()) == latin
    with pytest.raises(FeatureSpecError, match=r"source.encoding='utf-9' is not an encoding Python knows"):
        spec_from_dict(_minimal(source={"format": "csv", "header": True, "encoding": "utf-9"}))


def test_a_raw_row_becomes_the_request_a_client_sends():
    spec = spec_from_dict(_minimal(features=[
        {"name": "user", "kind": "categorical", "dtype": "int"},
        {"name": "price", "kind": "dense", "transform": "buckets", "num_buckets": 5},
        {"name": "ts", "kind": "timestamp", "format": "unix_seconds", "derive": ["hour_of_day"]},
        {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_length": 2},
        {"name": "history", "kind": "sequence", "separator": "^", "max_length": 3, "shares": "user"},
    ]))
    raw = {"clicked": "1", "user": "42", "price": "9.5", "ts": "1767225600", "tags": "a|b|c", "history": "7^8"}
    assert spec.request_instance(raw) == {"user": "42", "price": 9.5, "ts": 1767225600, "tags": ["b", "c"],
                                          "history": ["7", "8"]}
    empty = spec.request_instance({"user": None, "price": float("nan"), "tags": "", "history": ["1", "2"]})
    assert empty == {"user": None, "price": None, "ts": None, "tags": [], "history": ["1", "2"]}


def _with_history(history, **extra):
    return _minimal(features=[
        {"names": ["user", "item"], "kind": "categorical"},
        {"name": "hour", "kind": "categorical", "table": "item"},
        {"name": "ts", "kind": "timestamp", "format": "unix_seconds", "derive": ["hour_of_day"]},
        {"name": "liked", "kind": "sequence", "shares": "item", "max_length": 5, "history": history, **extra},
    ])


def test_a_history_sequence_is_computed_not_read():
    spec = spec_from_dict(_with_history({"key": "user", "positive_only": True}))
    liked = spec.feature("liked")
    assert liked.history == HistorySpec(key="user", value="item", positive_only=True)  # value: the shared feature
    assert spec.histories == (liked,) and "liked" not in spec.input_columns
    assert spec.tables()["item"].features == ("item", "hour", "liked")
    assert spec_from_dict(spec.as_dict()) == spec and spec_from_dict(spec.as_dict()).hash() == spec.hash()
    other = spec_from_dict(_with_history({"key": "user", "value": "hour", "positive_only": False}))
    assert other.hash() != spec.hash()  # a reader of the samples depends on what the history holds
    movielens = load_spec("movielens")
    liked, rated = movielens.feature("liked_items"), movielens.feature("rated_items")
    assert (liked.shares, liked.max_length, liked.history) == \
        ("item_id", 20, HistorySpec(key="user_id", value="item_id", positive_only=True))
    assert (rated.shares, rated.max_length, rated.history) == \
        ("item_id", 20, HistorySpec(key="user_id", value="item_id", positive_only=False))
    assert movielens.histories == (liked, rated)


@pytest.mark.parametrize(("history", "extra", "message"), [
    ({"key": "nobody"}, {}, r"history.key='nobody', which names no categorical feature of the raw rows; "
                            r"categorical features: \['user', 'item', 'hour'\]"),
    ({"key": "ts_hour_of_day"}, {}, r"history.key='ts_hour_of_day', which names no categorical feature"),
    ({"key": "user", "value": "user"}, {}, r"history.value='user', which reads the table of 'user', but the "
                                           r"sequence shares 'item'"),
    ({"key": "user", "positive_only": "yes"}, {}, r"history.positive_only must be true or false, got 'yes'"),
    ({"key": "user", "window": 3}, {}, r"history: unknown key 'window'"),
    ("user", {}, r"history must be a mapping \['key', 'positive_only', 'value'\]"),
    ({"key": "user"}, {"separator": "^"}, r"reads no separator \(got separator='\^'\); drop separator"),
    ({"key": "user"}, {"column": "liked_col"}, r"reads no column \(got column='liked_col'\)"),
])
def test_a_malformed_history_is_refused_naming_what_to_change(history, extra, message):
    with pytest.raises(FeatureSpecError, match=message):
        spec_from_dict(_with_history(history, **extra))


def test_a_tiered_table_takes_its_hot_rows_and_leaves_the_hash_of_other_specs_alone():
    from components.feature_spec import DEFAULT_HOT_ROWS

    plain = spec_from_dict(_minimal(features=[{"name": "x", "kind": "categorical"}]))
    tiered = spec_from_dict(_minimal(features=[{"name": "x", "kind": "categorical", "storage": "tiered"}]))
    sized = spec_from_dict(_minimal(features=[{"name": "x", "kind": "categorical", "storage": "tiered",
                                               "hot_rows": 5000}]))
    assert (plain.tables()["x"].storage, plain.tables()["x"].hot_rows) == ("memory", 0)
    assert (tiered.tables()["x"].tiered, tiered.tables()["x"].hot_rows) == (True, DEFAULT_HOT_ROWS)
    assert sized.tables()["x"].hot_rows == 5000
    assert len({plain.hash(), tiered.hash(), sized.hash()}) == 3
    assert "storage" not in plain.as_dict()["features"][0] and spec_from_dict(sized.as_dict()) == sized
    # Spec hashes from before storage existed (what every written sample and model names).
    assert load_spec("criteo").hash() == "98cfcf0e1fb92198" and load_spec("avazu").hash() == "036880a81f90f303"
