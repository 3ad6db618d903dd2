"""Export of a trained model as a TF SavedModel that serves raw features and takes deltas in place.

The `serving_default` signature takes the raw values of the feature spec's inputs (raw_input_signature: the
criteo spec's are I1..I13 float32 with NaN for missing, C1..C26 string with "" for missing), applies the
feature state inside the graph and returns {"probability": float32 [batch]}. It equals `model(preprocessed)`
where the preprocessing is components.feature_state.transform_dense, categorical_rows and list_rows, so
serving needs nothing but TensorFlow.

The packed endpoints (PACKED_ENDPOINTS, one per compute precision) are the same model and preprocessing taking
the inputs of one dtype stacked into one tensor (packed_layout, written beside the SavedModel as
PACKED_LAYOUT_FILE): the server's fast path. The bfloat16 one runs the layers under the policies mixed_bfloat16
training gives them, over the same float32 variables.

The `apply_delta` endpoint (trainer.delta) writes a delta into the loaded model: vocabulary entries go into
the lookup table (a mutable one for that reason) and, for every weight i, the rows `rows_i` of the weight
take `values_i`. The weights are numbered in the order `weight_specs` lists them in the manifest.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

# The metrics, models and optimizers imports register the classes a checkpoint names, so that
# keras.saving.load_model of a checkpoint works once this module is imported.
import trainer.metrics  # noqa: F401
import trainer.models  # noqa: F401
import trainer.optimizers  # noqa: F401
from components.delta import KEY_SEPARATOR, rows_name, values_name
from components.delta import weight_specs as weight_specs  # noqa: F401 - callers import it from here
from components.feature_spec import BUCKET_DERIVATION, MISSING_ROW, RARE_ROW, FeatureSpec, derive_time, load_spec
from components.feature_state import FeatureState, check_state_matches
from trainer.keras_internals import flatten_layers
from trainer.model_inputs import CATEGORICAL_INPUT, DENSE_INPUT
from trainer.models.blocks import valid_ids

SAVED_MODEL_DIR = "saved_model"
SIGNATURE_NAME = "serving_default"
OUTPUT_NAME = "probability"
APPLY_DELTA_ENDPOINT = "apply_delta"
# The packed serving endpoints by compute precision: the same model and preprocessing as SIGNATURE_NAME, taking
# packed_layout's few tensors (a server's fast path) and returning the probabilities [batch].
PACKED_ENDPOINTS = {"float32": "serve_packed", "bfloat16": "serve_packed_bfloat16"}
PACKED_LAYOUT_FILE = "packed_inputs.json"
# A model with tiered tables: the writes of rows into the row caches of all its tiered tables in one call, each
# table t's under the keys of load_slots_signature (serving/row_cache.py).
LOAD_ALL_SLOTS_ENDPOINT = "load_all_slots"
# A model with tiered tables, per precision: the packed call answered in the same graph call when every row it
# reads is cached ({"probability", "cached", "table_<t>": the row ids}; serving/row_cache.py), else only the rows.
CACHED_ENDPOINTS = {"float32": "serve_packed_if_cached", "bfloat16": "serve_packed_if_cached_bfloat16"}
# The model's inputs among a cached endpoint's outputs, each under this prefix and its key: the preprocessed
# request, for LOADED_ENDPOINTS.
MODEL_INPUT_PREFIX = "input_"
# A model with tiered tables, per precision: a load (load_slots_signature) written into the row caches, then the
# model run on model inputs that a cached endpoint gave (its MODEL_INPUT_PREFIX outputs), in one graph call: a
# request whose rows were not all cached is answered without preprocessing it again (serving/row_cache.py).
LOADED_ENDPOINTS = {"float32": "serve_loaded", "bfloat16": "serve_loaded_bfloat16"}

def raw_input_signature(spec: FeatureSpec) -> dict[str, tf.TensorSpec]:
    """The serving signature's inputs, from the feature spec: raw values, one tensor per input.

    - a dense feature: float32 [batch], NaN when missing;
    - a categorical feature: string [batch], "" when missing (integer ids as their decimal text);
    - the timestamp, when features are derived from it: int64 [batch], whole seconds since 1970 UTC;
    - a multi-valued or sequence feature: string [batch, max_length], its values newest last, the front padded
      with "" (serving pads and checks the length).
    """
    signature = {f.name: tf.TensorSpec([None], tf.float32, name=f.name) for f in spec.dense}
    signature.update({f.name: tf.TensorSpec([None], tf.string, name=f.name)
                      for f in spec.categorical if not f.derived_from})
    if spec.timestamp is not None and spec.timestamp.derive:
        signature[spec.timestamp.name] = tf.TensorSpec([None], tf.int64, name=spec.timestamp.name)
    signature.update({f.name: tf.TensorSpec([None, f.max_length], tf.string, name=f.name) for f in spec.lists})
    return signature


RAW_INPUT_SIGNATURE = raw_input_signature(load_spec("criteo"))


def packed_layout(spec: FeatureSpec) -> list[dict[str, Any]]:
    """The arguments of the packed serving endpoints (PACKED_ENDPOINTS), in order: the raw inputs of one dtype and
    width stacked into one tensor, so a server passes a few tensors instead of one per feature.

    - "dense": float32 [batch, len(inputs)], the dense features in spec order;
    - "categorical": string [batch, len(inputs)], the categorical features that are not derived, in spec order;
    - the timestamp (when features are derived from it) and each multi-valued or sequence feature: its
      raw_input_signature tensor as it is.
    Written beside the SavedModel as PACKED_LAYOUT_FILE; serving reads it rather than knowing this rule."""
    layout: list[dict[str, Any]] = []
    if spec.dense:
        layout.append({"name": "dense", "dtype": "float32", "stacked": True, "inputs": [f.name for f in spec.dense]})
    raw_categorical = [f.name for f in spec.categorical if not f.derived_from]
    if raw_categorical:
        layout.append({"name": "categorical", "dtype": "string", "stacked": True, "inputs": raw_categorical})
    signature = raw_input_signature(spec)
    single = ([spec.timestamp.name] if spec.timestamp is not None and spec.timestamp.derive else []) + [
        f.name for f in spec.lists]
    for name in single:
        layout.append({"name": name, "dtype": signature[name].dtype.name, "stacked": False, "inputs": [name]})
    return layout


def packed_input_signature(spec: FeatureSpec) -> list[tf.TensorSpec]:
    signature = raw_input_signature(spec)
    out = []
    for argument in packed_layout(spec):
        if argument["stacked"]:
            out.append(tf.TensorSpec([None, len(argument["inputs"])], argument["dtype"], name=argument["name"]))
        else:
            out.append(tf.TensorSpec(signature[argument["name"]].shape, argument["dtype"], name=argument["name"]))
    return out


class RawFeaturePreprocessor(tf.Module):
    """The feature state as TensorFlow ops: raw values (raw_input_signature, or packed_layout's tensors) -> the
    model's inputs (trainer.model_inputs)."""

    def __init__(self, state: FeatureState, spec: FeatureSpec | None = None) -> None:
        super().__init__(name="raw_feature_preprocessor")
        spec = spec or load_spec("criteo")
        check_state_matches(list(state.vocabularies), state.dense_names, spec, f"feature state {state.version}")
        self.spec = spec
        self.layout = packed_layout(spec)
        names = list(state.vocabularies)
        keys = [tf.strings.join([name + KEY_SEPARATOR, tf.constant(list(state.vocabularies[name].values), tf.string)])
                for name in names]
        rows = [tf.constant(list(state.vocabularies[name].rows), tf.int64) for name in names]
        # Mutable: a delta adds the values admitted since the full export (apply_delta).
        self.table = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=RARE_ROW)
        self.table.insert(tf.concat(keys, 0), tf.concat(rows, 0))
        self.key_prefixes = tf.constant([spec.table_of(f.name) + KEY_SEPARATOR for f in spec.categorical],
                                        tf.string)
        stats = state.dense_arrays()
        self.low, self.high, self.mean, self.std = (
            tf.constant(stats[key], tf.float64) for key in ("low", "high", "mean", "std")
        )
        self.log = tf.constant(stats["log"].astype(bool))
        self.flagged = tf.constant([i for i, flag in enumerate(stats["indicator"]) if flag], tf.int32)
        self.boundaries = {f.derived_from: state.boundaries(f.derived_from)
                           for f in spec.categorical if f.derivation == BUCKET_DERIVATION}

    def __call__(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        """From one tensor per raw input (raw_input_signature)."""
        return self.packed(*self.pack(features))

    def pack(self, features: dict[str, tf.Tensor]) -> list[tf.Tensor]:
        """One tensor per raw input -> packed_layout's arguments."""
        return [tf.stack([features[name] for name in argument["inputs"]], axis=1) if argument["stacked"]
                else features[argument["name"]] for argument in self.layout]

    def packed(self, *arguments: tf.Tensor) -> dict[str, tf.Tensor]:
        """From packed_layout's arguments."""
        given = {argument["name"]: tensor for argument, tensor in zip(self.layout, arguments, strict=True)}
        dense = given.get("dense")
        out = {DENSE_INPUT: self.dense(dense, next(iter(given.values()))), CATEGORICAL_INPUT: self.categorical(given)}
        for feature in self.spec.lists:
            out[feature.name] = self.id_list(given[feature.name], self.spec.table_of(feature.name))
        return out

    def dense_column(self, dense: tf.Tensor, name: str) -> tf.Tensor:
        return dense[:, self.spec.dense_names.index(name)]

    def dense(self, dense: tf.Tensor | None, any_input: tf.Tensor) -> tf.Tensor:
        """Same arithmetic as components.feature_state.transform_dense, in float64 like numpy."""
        names = [f.name for f in self.spec.scaled_dense]
        if not names:
            return tf.zeros([tf.shape(any_input)[0], 0], tf.float32)
        assert dense is not None
        if len(names) < len(self.spec.dense):  # bucketized ones are not values
            dense = tf.gather(dense, [self.spec.dense_names.index(name) for name in names], axis=1)
        values = tf.cast(dense, tf.float64)
        missing = tf.math.is_nan(values)
        filled = tf.where(missing, tf.zeros_like(values), values)
        logged = tf.where(self.log, tf.sign(filled) * tf.math.log1p(tf.abs(filled)), filled)
        clipped = tf.minimum(tf.maximum(logged, self.low), self.high)  # np.clip's order
        standardized = tf.where(missing, tf.zeros_like(values), (clipped - self.mean) / self.std)
        flags = tf.gather(tf.cast(missing, tf.float64), self.flagged, axis=1)
        return tf.cast(tf.concat([standardized, flags], axis=1), tf.float32)

    def raw_categorical(self, given: dict[str, tf.Tensor]) -> tf.Tensor:
        """[batch, F] strings: the categorical inputs, derived ones computed from the timestamp or a dense
        feature."""
        raw = given.get("categorical")
        if all(not f.derived_from for f in self.spec.categorical):
            assert raw is not None
            return raw
        raw_names = next((a["inputs"] for a in self.layout if a["name"] == "categorical"), [])
        columns = []
        for feature in self.spec.categorical:
            if feature.derivation == BUCKET_DERIVATION:
                values = self.dense_column(given["dense"], feature.derived_from)
                columns.append(self.bucket(values, feature.derived_from))
            elif feature.derived_from:
                seconds = given[feature.derived_from]
                columns.append(tf.strings.as_string(derive_time(seconds, feature.derivation)))
            else:
                assert raw is not None
                columns.append(raw[:, raw_names.index(feature.name)])
        return tf.stack(columns, axis=1)

    def bucket(self, values: tf.Tensor, name: str) -> tf.Tensor:
        """Same strings as components.feature_state.bucket_values: the bucket number, "" when NaN."""
        values = tf.cast(values, tf.float64)
        buckets = tf.searchsorted(tf.constant(self.boundaries[name], tf.float64), values, side="right")
        return tf.where(tf.math.is_nan(values), "", tf.strings.as_string(buckets))

    def categorical(self, given: dict[str, tf.Tensor]) -> tf.Tensor:
        """Same rows as components.feature_state.categorical_rows: "" -> MISSING_ROW, unknown -> RARE_ROW."""
        values = self.raw_categorical(given)
        keys = tf.strings.join([tf.broadcast_to(self.key_prefixes, tf.shape(values)), values])
        rows = tf.reshape(self.table.lookup(keys), tf.shape(values))  # a mutable table's lookup has no static shape
        return tf.where(tf.equal(values, ""), tf.constant(MISSING_ROW, tf.int64), rows)

    def id_list(self, values: tf.Tensor, table: str) -> tf.Tensor:
        """Same rows as components.feature_state.list_rows for a front-padded list ("" is padding)."""
        keys = tf.strings.join([table + KEY_SEPARATOR, values])
        rows = tf.reshape(self.table.lookup(keys), tf.shape(values))
        return tf.where(tf.equal(values, ""), tf.constant(MISSING_ROW, tf.int64), rows)


def delta_input_signature(model: keras.Model) -> dict[str, tf.TensorSpec]:
    """What `apply_delta` takes: new vocabulary keys (feature + KEY_SEPARATOR + value) and their rows, and for
    each weight the changed rows (along its first axis; a scalar weight has the one row 0) and their values."""
    signature = {
        "vocab_keys": tf.TensorSpec([None], tf.string, name="vocab_keys"),
        "vocab_rows": tf.TensorSpec([None], tf.int64, name="vocab_rows"),
    }
    for index, variable in enumerate(model.weights):
        signature[rows_name(index)] = tf.TensorSpec([None], tf.int64, name=rows_name(index))
        signature[values_name(index)] = tf.TensorSpec(
            [None, *variable.shape[1:]], variable.dtype, name=values_name(index)
        )
    return signature


def dense_rows_update(variable: tf.Variable, rows: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """The variable's value with `rows` (along the first axis) set to `values`: a new tensor, for a dense assign.

    A delta is written this way rather than with the variable's scatter_update because TensorFlow switches a
    resource variable that a sparse op (ResourceScatterUpdate) has written into copy-on-read mode for good:
    from then on every read of the whole variable copies it. Each serving call reads every weight, so a model
    that had taken one delta copied its embedding tables on every request (0.4 ms more per 100-candidate call
    for bench-serving's 50 K-row table, docs/serving.md; in proportion for larger ones). The dense assign costs one
    copy of each weight per delta instead, and leaves every later read free."""
    return tf.tensor_scatter_nd_update(variable, tf.expand_dims(rows, 1), values)


class RowSlots(tf.Module):
    """The served row cache of a model's tiered tables (trainer/tiered_tables.py): per tiered table a hash table
    row id -> slot of the model's HotTable, which the serving process fills (`load`) with the rows a request
    needs before the request runs (serving/row_cache.py). `slots` rewrites the categorical input's tiered
    columns from row ids to slots, and the items of the list inputs in `lists` (key -> table) that read a
    tiered table, their padding to -1 (as trainer/tiered_training.py does in training); a row not loaded reads
    slot 0 (the map answers -1 for it: `cached` tells whether a batch's rows are all loaded).

    `linear`: the linear part's CategoricalEmbedding of width 1 (trainer.tiered_training.linear_layer), whose
    HotTables read the same slots: a row loaded is its store record, the values then the linear weight, written
    into both caches."""

    def __init__(self, layer: Any, lists: Mapping[str, int] | None = None, linear: Any = None) -> None:
        super().__init__(name="row_slots")
        self.tables = list(layer.tiered_tables)
        self.lists = {key: self.tables.index(table) for key, table in (lists or {}).items()
                      if table in layer.tiered_tables}  # key -> the table's place in `tables`
        self.columns = [layer.tiered_columns(table) for table in self.tables]  # per table, in `tables` order
        self.maps = [tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=-1)
                     for _ in self.tables]
        self.caches = [layer.hot_table(table).embeddings.value for table in self.tables]  # the tf.Variables
        self.linear_caches = ([linear.hot_table(table).embeddings.value for table in self.tables]
                              if linear is not None else [])
        self.embedding_dim = layer.embedding_dim  # a loaded record's columns of `caches`; the rest: the linear's
        self.num_columns = layer.num_features

    def slots(self, inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        categorical = inputs[CATEGORICAL_INPUT]
        column_table = {column: index for index, columns in enumerate(self.columns) for column in columns}
        columns = [tf.maximum(self.maps[column_table[c]].lookup(categorical[:, c]), 0) if c in column_table
                   else categorical[:, c] for c in range(self.num_columns)]
        lists = {}
        for key, index in self.lists.items():
            ids = inputs[key]
            slots = tf.ensure_shape(tf.reshape(self.maps[index].lookup(ids), tf.shape(ids)), ids.shape)
            lists[key] = tf.where(valid_ids(ids), tf.maximum(slots, 0), tf.constant(-1, ids.dtype))
        return {**inputs, CATEGORICAL_INPUT: tf.reshape(tf.stack(columns, axis=1), tf.shape(categorical)), **lists}

    def rows(self, inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        """Per tiered table (`table_<index>`), the row ids the batch reads: [batch, its columns], or, where list
        inputs read it too, those ids flattened and then the lists' items."""
        categorical = inputs[CATEGORICAL_INPUT]
        out = {}
        for index, (table, columns) in enumerate(zip(self.tables, self.columns, strict=True)):
            ids = tf.gather(categorical, columns, axis=1)
            items = [tf.boolean_mask(inputs[key], valid_ids(inputs[key]))
                     for key, list_index in self.lists.items() if list_index == index]
            out[f"table_{table}"] = tf.concat([tf.reshape(ids, [-1]), *items], axis=0) if items else ids
        return out

    def cached(self, rows: dict[str, tf.Tensor]) -> tf.Tensor:
        """Whether every row of `rows` (as `rows` gives them) is loaded in its table's cache: a bool scalar."""
        loaded = [tf.reduce_all(self.maps[index].lookup(tf.reshape(rows[f"table_{table}"], [-1])) >= 0)
                  for index, table in enumerate(self.tables)]
        return tf.reduce_all(tf.stack(loaded))


def load_slots_signature(layer: Any, linear: Any = None) -> dict[str, tf.TensorSpec]:
    """LOAD_ALL_SLOTS_ENDPOINT's argument: per tiered table t, the rows to load (`rows_<t>`), the slots they go
    into (`slots_<t>`), their values (`values_<t>`, [rows, dim], or [rows, dim + 1] with a `linear` part: the
    store's records) and the rows that leave the cache first (`evicted_<t>`); empty for a table with nothing to
    load."""
    dim = layer.embedding_dim + (1 if linear is not None else 0)
    signature = {}
    for table in layer.tiered_tables:
        signature.update({f"slots_{table}": tf.TensorSpec([None], tf.int64, name=f"slots_{table}"),
                          f"rows_{table}": tf.TensorSpec([None], tf.int64, name=f"rows_{table}"),
                          f"values_{table}": tf.TensorSpec([None, dim], tf.float32, name=f"values_{table}"),
                          f"evicted_{table}": tf.TensorSpec([None], tf.int64, name=f"evicted_{table}")})
    return signature


def model_inputs_signature(preprocessor: RawFeaturePreprocessor, spec: FeatureSpec) -> dict[str, tf.TensorSpec]:
    """The model inputs `preprocessor.packed` gives (trainer.model_inputs), as specs: LOADED_ENDPOINTS' second
    argument."""
    traced = tf.function(preprocessor.packed).get_concrete_function(*packed_input_signature(spec))
    return {key: tf.TensorSpec(value.shape, value.dtype, name=f"{MODEL_INPUT_PREFIX}{key}")
            for key, value in traced.structured_outputs.items()}


def export_serving_model(model: keras.Model, state: FeatureState, directory: Path,
                         spec: FeatureSpec | None = None) -> list[str]:
    """Writes directory/saved_model (replacing an older one) and returns the paths of its files relative
    to `directory`, for the manifest. `spec`: the feature spec the model was trained under (criteo if None).

    A model with tiered tables (its CategoricalEmbedding holds HotTable slots) is exported with a RowSlots row
    cache: its serving endpoints map the tiered columns' row ids to slots, `CACHED_ENDPOINTS` answer a packed
    batch in one call when its rows are all cached (else they give the rows it reads), and
    `LOAD_ALL_SLOTS_ENDPOINT` writes rows into the slots of every tiered table in one call. The tables themselves
    are not in the SavedModel: the export step ships their stores beside it (serving/row_cache.py reads them)."""
    from trainer.tiered_tables import tiered_layer, tiered_lists
    from trainer.tiered_training import linear_layer

    directory = Path(directory)
    target = directory / SAVED_MODEL_DIR
    if target.exists():
        shutil.rmtree(target)
    spec = spec or load_spec("criteo")
    preprocessor = RawFeaturePreprocessor(state, spec)
    layer = tiered_layer(model)
    linear = linear_layer(model, layer) if layer is not None else None
    row_slots = RowSlots(layer, tiered_lists(model, layer), linear) if layer is not None else None

    def model_inputs_of(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return row_slots.slots(inputs) if row_slots is not None else inputs

    def serve(features: dict[str, tf.Tensor]) -> dict[str, Any]:
        probability = model(model_inputs_of(preprocessor(features)), training=False)
        return {OUTPUT_NAME: tf.reshape(tf.cast(probability, tf.float32), [-1])}

    weights = list(model.weights)

    def apply_delta(delta: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        preprocessor.table.insert(delta["vocab_keys"], delta["vocab_rows"])
        for index, variable in enumerate(weights):
            rows, values = delta[rows_name(index)], delta[values_name(index)]
            if variable.shape.rank == 0:
                if tf.size(values) > 0:
                    variable.value.assign(values[0])
            else:
                variable.value.assign(dense_rows_update(variable.value, rows, values))
        return {"num_vocabulary_entries": tf.size(delta["vocab_keys"])}

    def packed_endpoint(precision: str) -> Callable[..., tf.Tensor]:
        policies = _policies_of(model, precision)

        def serve_packed(*arguments: tf.Tensor) -> tf.Tensor:
            # The policies are set while the graph is traced, whenever that is (saving traces again).
            with _computing_in(policies):
                probability = model(model_inputs_of(preprocessor.packed(*arguments)), training=False)
            return tf.reshape(tf.cast(probability, tf.float32), [-1])

        return serve_packed

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.track(preprocessor)
    if row_slots is not None:
        archive.track(row_slots)

        def cached_endpoint(precision: str) -> Callable[..., dict[str, tf.Tensor]]:
            policies = _policies_of(model, precision)

            def serve_if_cached(*arguments: tf.Tensor) -> dict[str, tf.Tensor]:
                # One pass of the preprocessing gives the rows and the model's inputs; the model runs only when
                # the rows are all cached. (Finding the rows by the tiered columns' lookups alone, as an
                # earlier `tiered_rows` endpoint did, and preprocessing again for the answer made a cached
                # request 1.12-1.17x the in-memory p50 in bench-row-cache, row_cache_cached_columns.json; this
                # way 1.01-1.13x, row_cache_one_call.json and row_cache_one_call_run2.json.)
                with _computing_in(policies):
                    inputs = preprocessor.packed(*arguments)
                    rows = row_slots.rows(inputs)
                    cached = row_slots.cached(rows)

                    def answer() -> tf.Tensor:
                        probability = model(row_slots.slots(inputs), training=False)
                        return tf.reshape(tf.cast(probability, tf.float32), [-1])

                    probability = tf.cond(cached, answer,
                                          lambda: tf.zeros([tf.shape(arguments[0])[0]], tf.float32))
                return {"probability": probability, "cached": cached, **rows,
                        **{f"{MODEL_INPUT_PREFIX}{key}": value for key, value in inputs.items()}}

            return serve_if_cached

        def loaded_endpoint(precision: str) -> Callable[..., tf.Tensor]:
            policies = _policies_of(model, precision)

            def serve_loaded(request: dict[str, tf.Tensor], inputs: dict[str, tf.Tensor]) -> tf.Tensor:
                # The load's writes come first: TensorFlow orders the ops of one resource (the slot maps, the
                # caches) as written here, so the model reads the rows just loaded.
                load_all_slots(request)
                with _computing_in(policies):
                    probability = model(row_slots.slots(inputs), training=False)
                return tf.reshape(tf.cast(probability, tf.float32), [-1])

            return serve_loaded

        def load_all_slots(request: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
            loaded = []
            for index, table in enumerate(row_slots.tables):
                rows, slots = request[f"rows_{table}"], request[f"slots_{table}"]
                # Evicted rows leave the map first: a slot they free may be one `rows` takes.
                row_slots.maps[index].remove(request[f"evicted_{table}"])
                row_slots.maps[index].insert(rows, slots)
                # A gather reads the cache (trainer.layers.embedding_rows.take_rows), so a scatter costs no copies.
                values = request[f"values_{table}"]
                row_slots.caches[index].scatter_update(tf.IndexedSlices(values[:, :row_slots.embedding_dim], slots))
                if row_slots.linear_caches:  # each record's last column: the linear part's weight
                    row_slots.linear_caches[index].scatter_update(
                        tf.IndexedSlices(values[:, row_slots.embedding_dim:], slots))
                loaded.append(tf.size(rows))
            return {"loaded": tf.add_n(loaded)}

        archive.add_endpoint(LOAD_ALL_SLOTS_ENDPOINT, load_all_slots,
                             input_signature=[load_slots_signature(layer, linear)])
        for precision, endpoint in CACHED_ENDPOINTS.items():
            archive.add_endpoint(endpoint, cached_endpoint(precision), input_signature=packed_input_signature(spec))
        inputs_signature = model_inputs_signature(preprocessor, spec)
        for precision, endpoint in LOADED_ENDPOINTS.items():
            archive.add_endpoint(endpoint, loaded_endpoint(precision),
                                 input_signature=[load_slots_signature(layer, linear), inputs_signature])
    archive.add_endpoint(SIGNATURE_NAME, serve, input_signature=[raw_input_signature(spec)])
    archive.add_endpoint(APPLY_DELTA_ENDPOINT, apply_delta, input_signature=[delta_input_signature(model)])
    for precision, endpoint in PACKED_ENDPOINTS.items():
        archive.add_endpoint(endpoint, packed_endpoint(precision), input_signature=packed_input_signature(spec))
    archive.write_out(str(target), verbose=False)
    (directory / PACKED_LAYOUT_FILE).write_text(json.dumps({
        "endpoints": PACKED_ENDPOINTS, "arguments": packed_layout(spec),
        **({"cached_endpoints": CACHED_ENDPOINTS, "loaded_endpoints": LOADED_ENDPOINTS}
           if row_slots is not None else {})}, indent=1) + "\n")
    files = [path for path in target.rglob("*") if path.is_file()] + [directory / PACKED_LAYOUT_FILE]
    return sorted(str(path.relative_to(directory)) for path in files)


def _policies_of(model: keras.Model, precision: str) -> list[tuple[keras.layers.Layer, Any]]:
    """(layer, dtype policy) for each of the model's layers whose policy differs from the one that building it
    under the global policy of `precision` gives it ("float32": every layer float32; "bfloat16": as
    mixed_bfloat16 training has them, where layers built with an explicit float32, such as the sigmoid heads,
    stay float32). Called outside any traced function: the twin it builds from the config may make variables
    (a dropout layer's seed generator)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32" if precision == "float32" else f"mixed_{precision}")
    try:
        config = {key: value for key, value in model.get_config().items() if key != "dtype"}
        twin = model.__class__.from_config(config)  # unbuilt: no weights are allocated
    finally:
        keras.config.set_dtype_policy(previous)
    layers, twins = ([layer for layer in flatten_layers(m) if not isinstance(layer, keras.layers.InputLayer)]
                     for m in (model, twin))  # a built Sequential has an InputLayer, an unbuilt one not yet
    if [type(layer) for layer in layers] != [type(layer) for layer in twins]:
        raise RuntimeError(f"cannot export a {precision} endpoint of {model.name}: rebuilding it from its config "
                           "gave other layers; its sublayers must be made in __init__")
    return [(layer, other.dtype_policy) for layer, other in zip(layers, twins, strict=True)
            if layer.dtype_policy.name != other.dtype_policy.name]


@contextmanager
def _computing_in(policies: list[tuple[keras.layers.Layer, Any]]) -> Iterator[None]:
    """The layers under the given dtype policies (_policies_of) while the block runs. Variables stay float32
    either way: deltas write the same ones."""
    changed = [(layer, layer.dtype_policy) for layer, _ in policies]
    for layer, policy in policies:
        layer.dtype_policy = policy
    try:
        yield
    finally:
        for layer, policy in changed:
            layer.dtype_policy = policy
