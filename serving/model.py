"""One loaded model version: its `serving_default` signature and the conversion of JSON values to its inputs.

A model exported with an `apply_delta` endpoint (trainer.export) can be moved forward in place by deltas
(components.delta). Each `LoadedModel` is a snapshot of one version of one loaded replica: applying a delta
returns a new snapshot and makes the older ones stale. A prediction holds the replica's read lock and checks
that the replica still holds its snapshot's version, so it never runs on weights half-way through an update;
a stale snapshot raises StaleModel, and the caller asks for the current one again.

A model exported with packed endpoints (trainer.export PACKED_ENDPOINTS) is called through the one of the
precision asked for (PackedCall): the inputs of one dtype in one tensor. Others are called through the signature.

The signature takes raw features, one tensor per feature (trainer.export.raw_input_signature). The input
names, dtypes and shapes are read from the signature itself, so any model that follows the contract (and the
tiny fixture models in the tests) is served without a hard-coded feature list:
- float [batch] inputs take numbers, with null or a missing key meaning NaN (missing);
- string [batch] inputs take strings, with null or a missing key meaning "" (missing); integer ids (a feature
  spec's dtype int) take integers too;
- string [batch, L] inputs (multi-valued and sequence features) take a list of at most L values, newest last
  (null or a missing key: an empty list), front-padded with ""; a feature the spec declares with a separator
  also takes one string of its values joined by it, as the log holds it (empty values dropped and the newest L
  kept, as the Spark jobs read the log);
- int64 [batch] (the timestamp) takes the spec's raw format (epoch seconds, epoch milliseconds or its
  strptime text); null or a missing key means the time of the request.
- the spec's timestamp column, where the model does not take it (no feature is derived from it), is accepted
  and read by nothing: a row as the log holds it is a valid request.
The feature spec travels in the model's manifest ("feature_spec"); without one, integer inputs take integers.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import tensorflow as tf

from components.delta import DeltaError
from components.manifest import ManifestError, read_manifest
from serving.native_rows import NativeRows
from serving.row_cache import PROTECTED_SHARE, RowCacheTooSmall, TieredRows
from serving.tensorflow_internals import direct_call

SIGNATURE_NAME = "serving_default"
OUTPUT_NAME = "probability"
SAVED_MODEL_DIR = "saved_model"
MODEL_KIND = "full_model"
APPLY_DELTA_ENDPOINT = "apply_delta"
PACKED_LAYOUT_FILE = "packed_inputs.json"


# Batch sizes a new replica predicts once before it serves (LoadedModel.warm_up).
WARM_UP_SIZES = (1, 100, 1000)


class ModelLoadError(RuntimeError):
    """A version directory does not hold a model that serving can load."""


class InvalidInput(ValueError):
    """Request values that do not fit the model's input signature."""


class StaleModel(RuntimeError):
    """The snapshot's replica has been moved on to a newer version: ask for the current model again."""


class ReplicaGuard:
    """A readers-writer lock over one loaded replica, and the version its weights hold now. Writers (delta
    updates) wait for the readers in flight; readers arriving meanwhile wait for the writer."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False

    @contextmanager
    def reading(self, version: str) -> Iterator[None]:
        with self._condition:
            while self._writing:
                self._condition.wait()
            if self.version != version:
                raise StaleModel(f"replica moved from version {version} to {self.version}")
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                self._condition.notify_all()

    @contextmanager
    def writing(self, version: str | None = None) -> Iterator[None]:
        """Alone on the replica; with `version`, StaleModel if the replica no longer holds it."""
        with self._condition:
            while self._writing or self._readers:
                self._condition.wait()
            if version is not None and self.version != version:
                raise StaleModel(f"replica moved from version {version} to {self.version}")
            self._writing = True
        try:
            yield
        finally:
            with self._condition:
                self._writing = False
                self._condition.notify_all()


def bfloat16_native() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512_BF16 or AMX), as /proc/cpuinfo says."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _natural_key(name: str) -> tuple[Any, ...]:
    """Sorts I2 before I10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, eq=False)
class LoadedModel:
    version: str
    manifest: Mapping[str, Any]
    directory: Path
    function: Any  # the signature's ConcreteFunction
    input_specs: Mapping[str, tf.TensorSpec]
    loaded_at: datetime
    # The loaded SavedModel object: the function's variables live only as long as it does.
    root: Any = field(repr=False)
    guard: ReplicaGuard | None = field(default=None, repr=False)
    # The fast path: the packed endpoint of the precision asked for; None for a model exported without one.
    packed: PackedCall | None = field(default=None, repr=False)
    # Whether row-form bodies may be read by native code (`predict_native`).
    native: bool = field(default=True, repr=False)
    # Tiered tables served from their stores through a row cache (serving/row_cache.py); None without.
    tiered: TieredRows | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.guard is None:
            object.__setattr__(self, "guard", ReplicaGuard(self.version))

    @property
    def parent(self) -> str | None:
        return self.manifest.get("parent")

    @property
    def chain_root(self) -> str | None:
        """The full version this one descends from through deltas (itself for a full model)."""
        root = self.manifest.get("chain_root")
        return str(root) if root else (self.version if self.parent is None else None)

    @property
    def takes_deltas(self) -> bool:
        return hasattr(self.root, APPLY_DELTA_ENDPOINT) and "weight_specs" in self.manifest

    def apply_delta(self, manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> LoadedModel:
        """Writes a delta whose parent is this version into the replica and returns the snapshot of the new
        version; this snapshot (and every other of the replica) is stale from then on. Waits for predictions in
        flight on the replica. Checks everything it can before touching the weights."""
        if not self.takes_deltas:
            raise DeltaError(f"version {self.version} was exported without the {APPLY_DELTA_ENDPOINT!r} endpoint or "
                             "its weight list; deltas need a full model exported by this code")
        if manifest.get("parent") != self.version:
            raise DeltaError(f"delta {manifest.get('version')} has parent {manifest.get('parent')}, the replica holds "
                             f"{self.version}; apply the chain in order or reload the full model")
        if [tuple(s["shape"]) for s in manifest["weight_specs"]] != [tuple(s["shape"]) for s in
                                                                       self.manifest["weight_specs"]]:
            raise DeltaError(f"delta {manifest.get('version')} was computed for other weights than version "
                             f"{self.version}'s; reload the full model of its chain")
        assert self.guard is not None
        specs = getattr(self.root, APPLY_DELTA_ENDPOINT).concrete_functions[0].structured_input_signature[0][0]
        feed = {name: tf.constant(arrays[name], dtype=spec.dtype) for name, spec in specs.items()}
        with self.guard.writing():
            if self.guard.version != self.version:
                raise StaleModel(f"replica moved from version {self.version} to {self.guard.version}")
            getattr(self.root, APPLY_DELTA_ENDPOINT)(feed)
            if self.tiered is not None:
                self.tiered.apply_delta(arrays)
            version = str(manifest["version"])
            self.guard.version = version
        full_manifest = {**manifest, "weight_specs": self.manifest["weight_specs"],
                         "feature_spec": self.manifest.get("feature_spec")}
        return LoadedModel(version=version, manifest=full_manifest, directory=self.directory, function=self.function,
                           input_specs=self.input_specs, loaded_at=datetime.now(UTC), root=self.root,
                           guard=self.guard, packed=self.packed, native=self.native, tiered=self.tiered)

    @property
    def precision(self) -> str:
        """What the model's layers compute in for this server: the packed endpoint's precision, else float32."""
        return self.packed.precision if self.packed is not None else "float32"

    @classmethod
    def load(cls, directory: str | Path, version: str | None = None, *, verify: bool = True,
             precision: str = "float32", native_rows: bool = True, scratch: Path | None = None,
             row_cache_protected_share: float = PROTECTED_SHARE) -> LoadedModel:
        """Loads `<directory>/saved_model` after reading (and, with `verify`, checksumming) its manifest.
        `precision`: the packed endpoint to answer with (serving.precision); a model exported without that
        endpoint answers with its float32 one, or without one with its signature (`precision` says which).
        `native_rows`: whether `predict_native` may read row-form bodies (serving.native_rows). `scratch`: a
        directory on local disk where a model with tiered tables keeps its deltas' rows (serving.row_cache
        DeltaRows); None keeps them in memory. `row_cache_protected_share`: the protected segment of a tiered
        table's row cache (serving.row_cache_protected_share)."""
        directory = Path(directory)
        try:
            manifest = read_manifest(directory, kind=MODEL_KIND, verify=verify)
        except ManifestError as err:
            raise ModelLoadError(f"cannot load the model in {directory}: {err}") from err
        saved_model = directory / SAVED_MODEL_DIR
        if not saved_model.is_dir():
            raise ModelLoadError(f"cannot load the model in {directory}: it has no {SAVED_MODEL_DIR}/ folder")
        root = tf.saved_model.load(str(saved_model))
        signature = root.signatures.get(SIGNATURE_NAME)
        if signature is None:
            raise ModelLoadError(
                f"the SavedModel in {saved_model} has no {SIGNATURE_NAME!r} signature; "
                f"it has {sorted(root.signatures)}; export it with signatures={{{SIGNATURE_NAME!r}: ...}}"
            )
        args, specs = signature.structured_input_signature
        if args or not specs:
            raise ModelLoadError(f"{SIGNATURE_NAME!r} in {saved_model} must take named inputs, got {args!r}")
        for name, spec in specs.items():
            one_value = spec.shape.rank == 1 and (spec.dtype.is_floating or spec.dtype in (tf.string, tf.int64))
            a_list = spec.shape.rank == 2 and spec.dtype == tf.string and spec.shape[1] is not None
            if not (one_value or a_list):
                raise ModelLoadError(
                    f"input {name!r} of {SIGNATURE_NAME!r} in {saved_model} is {spec}; serving expects 1-D float, "
                    "string or int64 inputs (one value per instance) or 2-D string inputs of a fixed width (a list "
                    "per instance)"
                )
        if OUTPUT_NAME not in signature.structured_outputs:
            raise ModelLoadError(
                f"{SIGNATURE_NAME!r} in {saved_model} returns {sorted(signature.structured_outputs)}, "
                f"expected an output named {OUTPUT_NAME!r}"
            )
        declared = manifest.get("feature_spec") or {}
        integer_ids = {name for name in specs if _declared(declared, name).get("dtype") == "int"}
        packed = PackedCall.load(root, directory, precision, dict(specs), integer_ids)
        tiered = None
        if manifest.get("tiered_serving"):
            if packed is None:
                raise ModelLoadError(f"the model in {directory} serves tiered tables and has no packed endpoint; "
                                     "export it again")
            tiered = TieredRows(root, directory, manifest["tiered_serving"], scratch=scratch,
                                protected_share=row_cache_protected_share)
        return cls(
            version=version or str(manifest["version"]),
            manifest=manifest,
            directory=directory,
            function=signature,
            input_specs=dict(specs),
            loaded_at=datetime.now(UTC),
            root=root,
            packed=packed,
            native=native_rows,
            tiered=tiered,
        )

    @property
    def input_names(self) -> list[str]:
        return sorted(self.input_specs, key=_natural_key)

    @functools.cached_property
    def column_converters(self) -> dict[str, Callable[[list[Any]], Any]]:
        """Per input, a function from its values (one per instance) to an array for its tensor; it raises
        InvalidInput on the first value that does not fit (the per-value converters say which and why)."""
        return {name: _column_converter(self.input_specs[name], convert) for name, convert in
                self._converters().items()}

    def predict(self, instances: Sequence[Any]) -> np.ndarray:
        """Predicts a list of instances in TF-Serving's row form: one {feature: value} object each.

        Values are converted a column at a time; a request with any value that does not fit is converted
        again instance by instance, so that the error names the first bad instance and feature."""
        known = self.accepted_names
        if all(type(instance) is dict and instance.keys() <= known for instance in instances):
            converters = self.column_converters
            try:
                if self.packed is not None:
                    return self.run_packed(self.packed.row_arguments(
                        instances, lambda name: converters[name]([instance.get(name) for instance in instances]),
                        self.input_specs), len(instances))
                columns = {name: convert([instance.get(name) for instance in instances])
                           for name, convert in converters.items()}
            except InvalidInput:
                pass
            else:
                return self._run(columns, len(instances))
        converters = self._converters()
        columns: dict[str, list[Any]] = {name: [] for name in converters}
        for index, instance in enumerate(instances):
            if not isinstance(instance, dict):
                raise InvalidInput(
                    f"instance {index} must be a JSON object of feature values, got {_show(instance)}"
                )
            self._check_names(instance, f"instance {index}")
            for name, convert in converters.items():
                try:
                    columns[name].append(convert(instance.get(name)))
                except InvalidInput as err:
                    raise InvalidInput(f"instance {index}: feature {name!r} {err}") from None
        return self._run(columns, len(instances))

    def warm_up(self) -> None:
        """Predicts WARM_UP_SIZES instances with no values, by the path requests take: the first call at a new
        batch size builds kernels (oneDNN's, for its shapes) and lazy state, about 25 ms at 100 candidates in a
        fresh process (docs/serving.md), which the first requests would otherwise wait for. A model with tiered
        tables first loads into its row caches the rows its export says training read most
        (`TieredRows.preload`)."""
        if self.tiered is not None:
            self.tiered.preload()
        self.predict([{}])
        for size in WARM_UP_SIZES:
            body = b'{"instances":[' + b",".join([b"{}"] * size) + b"]}"
            if self.predict_native(body, size) is not None:
                continue
            records = self.decode_rows(body)
            if records is None:
                self.predict([{}] * size)
            else:
                self.predict_records(records)

    def predict_native(self, body: bytes, max_instances: int) -> np.ndarray | None:
        """A row-form request body read by the native reader (serving.native_rows) and predicted, or None
        (nothing run) when there is no native reader for this model or it does not read this body (anything but
        strings and numbers that fit, more than `max_instances` instances, ...): the caller then goes the way of
        `decode_rows`, which reads what this one reads into the same tensors."""
        reader = self.native_rows
        if reader is None:
            return None
        read = reader.tensors(body, max_instances)
        if read is None:
            return None
        rows, arguments = read
        return self.run_packed(arguments, rows)

    @functools.cached_property
    def native_rows(self) -> NativeRows | None:
        if self.packed is None or not self.native:
            return None
        return NativeRows.build(self.packed.layout, self.packed.row_readers, SIGNATURE_NAME)

    def decode_rows(self, body: bytes) -> list[Any] | None:
        """A row-form request body ({"instances": [...]}) decoded in one pass into typed records (RowDecoder),
        or None when the model has no packed endpoint or the body is anything but such a request of values that
        fit: then the caller parses it as JSON and `predict` checks it value by value, saying what is wrong."""
        return None if self.row_decoder is None else self.row_decoder.decode(body)

    def predict_records(self, records: Sequence[Any]) -> np.ndarray | None:
        """`decode_rows`'s records predicted as `predict` predicts the same instances, or None (nothing run) when
        a value does not fit its input (a number outside float32, a bad timestamp, ...): the caller then goes the
        way of `predict`, which names it."""
        assert self.packed is not None and self.row_decoder is not None
        try:
            arguments = self.packed.record_arguments(records, self.row_decoder, self.column_converters,
                                                     self.input_specs)
        except InvalidInput:
            return None
        if arguments is None:
            return None
        return self.run_packed(arguments, len(records))

    @functools.cached_property
    def row_decoder(self) -> RowDecoder | None:
        return None if self.packed is None else RowDecoder.build(self.packed, tuple(sorted(self.ignored_names)))

    @functools.cached_property
    def ignored_names(self) -> frozenset[str]:
        """Columns of the log that the spec declares and the model does not take: the timestamp (its name and
        its column) when no feature is derived from it. A request may send them, as a row of the log holds them;
        nothing reads them."""
        spec = self.manifest.get("feature_spec") or {}
        names = {name for entry in spec.get("features", []) if entry.get("kind") == "timestamp"
                 for name in (entry.get("name"), entry.get("column")) if name}
        return frozenset(names - set(self.input_specs))

    @functools.cached_property
    def accepted_names(self) -> frozenset[str]:
        """The keys a request's instance may hold: the model's inputs and `ignored_names`."""
        return frozenset(self.input_specs) | self.ignored_names

    def predict_columns(self, inputs: Mapping[str, Any]) -> np.ndarray:
        """Predicts the columnar form {feature: [value per instance]}; absent features are missing.

        A column may also be a numpy array (gRPC's tensors): a float array for a float input and an array of
        bytes for a single-valued string input are used as they are (NaN: missing); any other array is
        checked value by value as a list is."""
        self._check_names(inputs, "inputs")
        lengths = {}
        for name, values in inputs.items():
            if isinstance(values, np.ndarray) and values.ndim > 0:
                lengths[name] = values.shape[0]
                continue
            if not isinstance(values, list):
                raise InvalidInput(
                    f"inputs[{name!r}] must be a list of one value per instance, got {_show(values)}"
                )
            lengths[name] = len(values)
        if len(set(lengths.values())) > 1:
            raise InvalidInput(f"inputs must all hold the same number of values, got lengths {lengths}")
        num_instances = next(iter(lengths.values()), 0)
        columns: dict[str, Any] = {}
        converters = self._converters()
        declared = self.declared_inputs
        for name, convert_column in self.column_converters.items():
            values = inputs.get(name, [None] * num_instances)
            if isinstance(values, np.ndarray):
                ready = _ready_array(values, self.input_specs[name], declared[name])
                if ready is not None:
                    columns[name] = ready
                    continue
                values = _array_values(name, values)
            try:
                columns[name] = convert_column(values)
            except InvalidInput:
                for index, value in enumerate(values):  # which value, and why
                    try:
                        converters[name](value)
                    except InvalidInput as err:
                        raise InvalidInput(f"inputs[{name!r}][{index}] {err}") from None
                raise
        return self._run(columns, num_instances)

    def _converters(self) -> dict[str, Callable[[Any], Any]]:
        """Per input, a function from one value to the tensor's value (InvalidInput says what is wrong)."""
        return self._value_converters

    @functools.cached_property
    def _value_converters(self) -> dict[str, Callable[[Any], Any]]:
        return {name: _converter(tensor, self.declared_inputs[name]) for name, tensor in self.input_specs.items()}

    @functools.cached_property
    def declared_inputs(self) -> dict[str, dict[str, Any]]:
        """Per input, the feature spec's entry of it (its kind, dtype, format; {} when the manifest has no spec),
        read once: a request reads it for every input."""
        spec = self.manifest.get("feature_spec") or {}
        return {name: _declared(spec, name) for name in self.input_specs}

    def signature_metadata(self) -> dict[str, Any]:
        """The serving signature in TF-Serving's GetModelMetadata form (signature_def), plus the feature spec
        the model was trained under when its manifest has it."""
        from tensorflow.core.framework import types_pb2

        def tensor_info(name: str, spec: tf.TensorSpec) -> dict[str, Any]:
            dims = [{"size": str(-1 if d is None else d), "name": ""} for d in spec.shape.as_list()]
            return {"dtype": types_pb2.DataType.Name(spec.dtype.as_datatype_enum),
                    "tensor_shape": {"dim": dims, "unknown_rank": False}, "name": f"serving_default_{name}:0"}

        outputs = {OUTPUT_NAME: {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [{"size": "-1", "name": ""}],
                                                                      "unknown_rank": False},
                                 "name": "StatefulPartitionedCall:0"}}
        signature = {"inputs": {name: tensor_info(name, self.input_specs[name]) for name in self.input_names},
                     "outputs": outputs, "method_name": "tensorflow/serving/predict", "defaults": {}}
        out: dict[str, Any] = {"signature_def": {"signature_def": {SIGNATURE_NAME: signature}}}
        if self.manifest.get("feature_spec"):
            out["feature_spec"] = self.manifest["feature_spec"]
        return out

    def _check_names(self, given: Mapping[str, Any], where: str) -> None:
        unknown = sorted(set(given) - self.accepted_names, key=lambda name: _natural_key(str(name)))
        if unknown:
            raise InvalidInput(f"{where} has unknown features {unknown}; the model takes {self.input_names}")

    @functools.cached_property
    def input_groups(self) -> tuple[tuple[tf.DType, tuple[int, ...], tuple[str, ...]], ...]:
        """The inputs grouped by dtype and shape per instance: each group becomes one tensor, split into its
        inputs by one op (`tensors`)."""
        groups: dict[tuple[tf.DType, tuple[int, ...]], list[str]] = {}
        for name, spec in self.input_specs.items():
            groups.setdefault((spec.dtype, tuple(spec.shape[1:])), []).append(name)
        return tuple((dtype, tail, tuple(names)) for (dtype, tail), names in groups.items())

    def tensors(self, columns: Mapping[str, Any], num_instances: int) -> dict[str, tf.Tensor]:
        """The signature's input tensors from per-input arrays or lists. Each call into TensorFlow costs about
        20 us whatever its size, so the inputs of one dtype and shape are stacked into one tensor and split by
        one unstack: 4 calls instead of 39 for the criteo spec, about 0.5-0.9 ms less per request (measured on
        100 instances). From numpy arrays: a list of Python strings takes tf.constant about ten times longer."""
        tensors: dict[str, tf.Tensor] = {}
        for dtype, tail, names in self.input_groups:
            arrays = [_array(columns[name], self.input_specs[name]).reshape([num_instances, *tail]) for name in names]
            if len(names) == 1:
                tensors[names[0]] = tf.constant(arrays[0], dtype=dtype)
                continue
            stacked = tf.constant(np.stack(arrays, axis=1), dtype=dtype)
            tensors.update(zip(names, tf.unstack(stacked, num=len(names), axis=1), strict=True))
        return tensors

    def _run(self, columns: Mapping[str, Any], num_instances: int) -> np.ndarray:
        if self.packed is not None:
            return self.run_packed(self.packed.arguments(columns, num_instances, self.input_specs), num_instances)
        tensors = self.tensors(columns, num_instances)
        assert self.guard is not None
        with self.guard.reading(self.version):
            outputs = self.function(**tensors)
        return self._checked(np.asarray(outputs[OUTPUT_NAME]).reshape(-1), num_instances)

    def run_packed(self, arguments: Sequence[tf.Tensor], num_instances: int) -> np.ndarray:
        assert self.guard is not None and self.packed is not None
        if self.tiered is not None:  # the rows the batch reads loaded into the row cache first
            guard, packed = self.guard, self.packed
            try:
                probability = self.tiered.run(arguments, lambda: guard.reading(self.version),
                                              lambda: guard.writing(self.version),
                                              lambda: packed.call(*arguments).numpy(), packed.cached_call,
                                              packed.loaded_call)
            except RowCacheTooSmall as err:  # the request's size: the client's to change (a 400)
                raise InvalidInput(str(err)) from err
            return self._checked(probability, num_instances)
        with self.guard.reading(self.version):
            probability = self.packed.call(*arguments).numpy()
        return self._checked(probability, num_instances)

    def _checked(self, probability: np.ndarray, num_instances: int) -> np.ndarray:
        if probability.shape != (num_instances,):
            raise RuntimeError(
                f"model version {self.version} returned {probability.size} values of {OUTPUT_NAME!r} "
                f"for {num_instances} instances"
            )
        return probability


@dataclass(frozen=True)
class PackedCall:
    """A packed serving endpoint (trainer.export PACKED_ENDPOINTS): the same model and preprocessing as the
    signature, taking the inputs of one dtype stacked into one tensor, as the export's PACKED_LAYOUT_FILE lays
    them out. Fewer tensors to build and pass: 2 instead of 39 for the criteo spec."""

    function: Any  # a ConcreteFunction of the packed arguments, positional, -> probability [batch]
    layout: tuple[tuple[bool, tuple[str, ...]], ...]  # per argument: stacked?, the inputs in it
    # Per argument, how row-form instances become it without a pass per value: "floats", "strings" or "".
    row_readers: tuple[str, ...]
    precision: str
    # A model with tiered tables: the same packed call, answered only when every row it reads is cached, and the
    # rows it reads (trainer.export CACHED_ENDPOINTS; serving/row_cache.py). None in exports before it.
    cached_function: Any = None
    # With `cached_function`: a load written into the row caches and the model run on the model inputs the cached
    # function gave, in one call (trainer.export LOADED_ENDPOINTS). None in exports before it.
    loaded_function: Any = None

    @functools.cached_property
    def call(self) -> Callable[..., Any]:
        """`function` called as ConcreteFunction._call_flat calls it when no gradient tape records (never in a
        server): its graph's function on the arguments and the captured variables, without the Python binding of
        the arguments to the signature (about 0.07 ms a call, docs/serving.md). The arguments are built to the
        layout's specs by this class, so the signature's checks have nothing to find. Falls back to `function`
        where TensorFlow's internals differ."""
        return direct_call(self.function)

    @functools.cached_property
    def cached_call(self) -> Callable[..., Any] | None:
        """`cached_function` called as `call` calls `function`; None without it."""
        return direct_call(self.cached_function) if self.cached_function is not None else None

    @functools.cached_property
    def loaded_call(self) -> Callable[..., Any] | None:
        """`loaded_function` called as `call` calls `function` (its two dicts flattened); None without it."""
        return direct_call(self.loaded_function) if self.loaded_function is not None else None

    @classmethod
    def load(cls, root: Any, directory: Path, precision: str, specs: Mapping[str, tf.TensorSpec],
             integer_ids: set[str]) -> PackedCall | None:
        """None when the export has no packed endpoints. `integer_ids`: inputs whose feature has integer ids
        (they take JSON integers, which the string reader does not)."""
        path = directory / PACKED_LAYOUT_FILE
        if not path.is_file():
            return None
        layout = json.loads(path.read_text())
        endpoints = layout["endpoints"]
        answered = precision if precision in endpoints else "float32"
        endpoint = getattr(root, endpoints.get(answered, ""), None)
        if endpoint is None:
            return None
        arguments = tuple((bool(a["stacked"]), tuple(a["inputs"])) for a in layout["arguments"])
        laid_out = sorted(name for _, names in arguments for name in names)
        if laid_out != sorted(specs):
            raise ModelLoadError(f"{path} lays out the inputs {laid_out}, the signature takes {sorted(specs)}; "
                                 "export the model again")
        readers = []
        for stacked, names in arguments:
            dtype = specs[names[0]].dtype
            if stacked and dtype == tf.float32:
                readers.append("floats")
            elif stacked and dtype == tf.string and not integer_ids & set(names):
                readers.append("strings")
            else:
                readers.append("")
        cached = getattr(root, layout.get("cached_endpoints", {}).get(answered, ""), None)
        loaded = getattr(root, layout.get("loaded_endpoints", {}).get(answered, ""), None)
        return cls(function=endpoint.concrete_functions[0], layout=arguments, row_readers=tuple(readers),
                   precision=answered, cached_function=cached.concrete_functions[0] if cached is not None else None,
                   loaded_function=loaded.concrete_functions[0] if loaded is not None else None)

    def arguments(self, columns: Mapping[str, Any], num_instances: int, specs: Mapping[str, tf.TensorSpec]
                  ) -> list[tf.Tensor]:
        """The arguments from converted columns (one array or list per input)."""
        return [self._argument(columns, stacked, names, num_instances, specs) for stacked, names in self.layout]

    def row_arguments(self, instances: Sequence[dict[str, Any]], column: Callable[[str], Any],
                      specs: Mapping[str, tf.TensorSpec]) -> list[tf.Tensor]:
        """The arguments from row-form instances (dicts of known inputs). Stacked floats and strings are read
        a row at a time and checked by the set of their values' types; an argument whose values do not all
        pass that check, and every other argument, is built from `column(name)` (a column converter, which
        raises InvalidInput on a bad value)."""
        out = []
        for (stacked, names), reader in zip(self.layout, self.row_readers, strict=True):
            tensor = None
            if reader == "floats":
                tensor = _float_rows(instances, names)
            elif reader == "strings":
                tensor = _string_rows(instances, names)
            if tensor is None:
                tensor = self._argument({name: column(name) for name in names}, stacked, names, len(instances), specs)
            out.append(tensor)
        return out

    def record_arguments(self, records: Sequence[Any], decoder: RowDecoder,
                         converters: Mapping[str, Callable[[list[Any]], Any]], specs: Mapping[str, tf.TensorSpec]
                         ) -> list[tf.Tensor] | None:
        """The arguments from RowDecoder's records, whose stacked floats and strings are typed already: one
        C-level pass per argument reads them. None when a number is outside float32; the other arguments are
        built by their column converters (InvalidInput on a bad value)."""
        out = []
        for (stacked, names), reader, read in zip(self.layout, self.row_readers, decoder.readers, strict=True):
            rows = list(map(read, records))
            if reader == "floats":
                array = np.array(rows, dtype=np.float64).reshape(len(records), len(names))  # None -> NaN
                if np.any(np.abs(array) > _FLOAT32_MAX):  # NaN compares False
                    return None
                out.append(tf.constant(array.astype(np.float32)))
            elif reader == "strings":
                if any(None in row for row in rows):
                    rows = [tuple("" if value is None else value for value in row) for row in rows]
                out.append(tf.constant(np.array(rows, dtype=object).reshape(len(records), len(names)),
                                       dtype=tf.string))
            else:
                columns = list(zip(*rows, strict=True))
                out.append(self._argument({name: converters[name](list(values)) for name, values in
                                           zip(names, columns, strict=True)}, stacked, names, len(records), specs))
        return out

    @staticmethod
    def _argument(columns: Mapping[str, Any], stacked: bool, names: tuple[str, ...], num_instances: int,
                  specs: Mapping[str, tf.TensorSpec]) -> tf.Tensor:
        spec = specs[names[0]]
        if not stacked:
            return tf.constant(_array(columns[names[0]], spec), dtype=spec.dtype)
        matrix = np.empty((num_instances, len(names)), dtype=object if spec.dtype == tf.string else
                          spec.dtype.as_numpy_dtype)
        for index, name in enumerate(names):
            matrix[:, index] = columns[name]
        return tf.constant(matrix, dtype=spec.dtype)


@dataclass(frozen=True)
class RowDecoder:
    """Decodes a row-form predict body straight into typed records with msgspec, instead of JSON into dicts
    and then a Python pass per value: inputs of a stacked float argument are typed `float | null`, of a stacked
    string one `string | null`, the others any JSON value (their column converters check them). Unknown keys,
    a value of another type, non-strict JSON (NaN) or any other shape make `decode` answer None, and the
    request goes the general way, which says what is wrong. A missing key reads as null, as `dict.get` does."""

    decoder: msgspec.json.Decoder
    # Per packed argument, record -> its inputs' values, a tuple.
    readers: tuple[Callable[[Any], Any], ...]

    @classmethod
    def build(cls, packed: PackedCall, ignored: tuple[str, ...] = ()) -> RowDecoder:
        """`ignored`: keys an instance may hold that no argument reads (LoadedModel.ignored_names)."""
        fields, attributes, readers = [], {}, []
        for (_, names), reader in zip(packed.layout, packed.row_readers, strict=True):
            kind = {"floats": float | None, "strings": str | None}.get(reader, Any)
            for name in names:
                attributes[name] = f"f{len(attributes)}"  # any feature name, Python identifier or not
                fields.append((attributes[name], kind, None))
            named = [attributes[name] for name in names]
            readers.append(operator.attrgetter(*named) if len(named) > 1 else
                           lambda record, attribute=named[0]: (getattr(record, attribute),))
        for name in ignored:
            attributes[name] = f"f{len(attributes)}"
            fields.append((attributes[name], Any, None))
        instance = msgspec.defstruct("Instance", fields, rename={a: n for n, a in attributes.items()},
                                     forbid_unknown_fields=True)
        body = msgspec.defstruct("PredictBody", [("instances", list[instance]),
                                                 ("signature_name", str, SIGNATURE_NAME)],
                                 forbid_unknown_fields=True)
        return cls(decoder=msgspec.json.Decoder(body), readers=tuple(readers))

    def decode(self, body: bytes) -> list[Any] | None:
        try:
            decoded = self.decoder.decode(body)
        except (msgspec.MsgspecError, ValueError, RecursionError):  # ValueError: UnicodeDecodeError on bad UTF-8
            return None
        return decoded.instances if decoded.signature_name == SIGNATURE_NAME else None


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_NUMBER_TYPES = {float, int, type(None)}
_STRING_TYPES = {str, type(None)}


def _float_rows(instances: Sequence[dict[str, Any]], names: tuple[str, ...]) -> tf.Tensor | None:
    """[instances, names] float32 (null or a missing key: NaN), or None when a value is not a number (a bool
    or a string is not) or is outside float32."""
    rows = [[instance.get(name) for name in names] for instance in instances]
    if not set(map(type, itertools.chain.from_iterable(rows))) <= _NUMBER_TYPES:
        return None
    try:
        array = np.array(rows, dtype=np.float64)  # None -> NaN
    except OverflowError:  # an integer beyond float64
        return None
    if np.any(np.abs(array) > _FLOAT32_MAX):  # NaN compares False
        return None
    return tf.constant(array.astype(np.float32))


def _string_rows(instances: Sequence[dict[str, Any]], names: tuple[str, ...]) -> tf.Tensor | None:
    """[instances, names] strings (null or a missing key: ""), or None when a value is not a string."""
    rows = [[instance.get(name, "") for name in names] for instance in instances]
    types = set(map(type, itertools.chain.from_iterable(rows)))
    if not types <= _STRING_TYPES:
        return None
    if type(None) in types:
        rows = [["" if value is None else value for value in row] for row in rows]
    return tf.constant(rows, dtype=tf.string, shape=[len(instances), len(names)])


def _ready_array(array: np.ndarray, spec: tf.TensorSpec, declared: Mapping[str, Any]) -> np.ndarray | None:
    """`array` as the input's tensor when it needs no value-by-value check, else None."""
    if array.ndim != spec.shape.rank:
        return None
    if spec.dtype.is_floating and array.dtype.kind == "f":
        if np.any(np.abs(array) > float(np.finfo(spec.dtype.as_numpy_dtype).max)):  # NaN compares False
            return None
        return array.astype(spec.dtype.as_numpy_dtype, copy=False)
    if spec.dtype == tf.string and spec.shape.rank == 1 and array.dtype == object and declared.get("dtype") != "int":
        return array if set(map(type, array.tolist())) <= {bytes} else None
    return None


def _array_values(name: str, array: np.ndarray) -> list[Any]:
    """An array's values as JSON would give them: bytes decoded as UTF-8, one value (or list) per instance."""
    if array.dtype != object:
        return array.tolist()
    try:
        return np.vectorize(lambda v: v.decode("utf-8") if isinstance(v, bytes) else v, otypes=[object])(
            array).tolist()
    except UnicodeDecodeError as err:
        raise InvalidInput(f"inputs[{name!r}] holds a string that is not UTF-8: {err}") from None


def _array(values: Any, spec: tf.TensorSpec) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    return np.array(values, dtype=object if spec.dtype == tf.string else spec.dtype.as_numpy_dtype)


def _column_converter(tensor: tf.TensorSpec, convert: Callable[[Any], Any]) -> Callable[[list[Any]], Any]:
    """One input's values -> an array: float inputs vectorized (the common case: numbers and nulls), strings
    checked by the set of their types, the others value by value with `convert`."""
    if convert is _to_string:
        def strings(values: list[Any]) -> list[str]:
            types = set(map(type, values))
            if types <= _STRING_TYPES:
                return ["" if value is None else value for value in values] if type(None) in types else values
            return [convert(value) for value in values]  # raises on the bad one

        return strings
    if not tensor.dtype.is_floating:
        return lambda values: [convert(value) for value in values]
    numpy_dtype = tensor.dtype.as_numpy_dtype
    largest = float(np.finfo(numpy_dtype).max)

    def floats(values: list[Any]) -> np.ndarray:
        if not all(value is None or type(value) is float or type(value) is int for value in values):
            return np.array([convert(value) for value in values], dtype=numpy_dtype)  # raises on the bad one
        try:
            array = np.array([math.nan if value is None else value for value in values], dtype=np.float64)
        except OverflowError:  # an integer beyond float64
            return np.array([convert(value) for value in values], dtype=numpy_dtype)
        if np.any(np.abs(array) > largest):
            return np.array([convert(value) for value in values], dtype=numpy_dtype)
        return array.astype(numpy_dtype)

    return floats


def _declared(spec: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The spec's entry of feature `name` (its kind, dtype, format), or {} when the manifest has no spec."""
    entries = {entry.get("name"): entry for entry in spec.get("features", [])}
    entry = entries.get(name, {})
    if entry.get("kind") == "sequence":  # its ids are those of the feature whose table it shares
        entry = {**entry, "dtype": entries.get(entry.get("shares"), {}).get("dtype", "string")}
    return entry


def _converter(tensor: tf.TensorSpec, declared: Mapping[str, Any]) -> Callable[[Any], Any]:
    """Turns one JSON value into a value of the input `tensor`, or raises InvalidInput saying what is wrong.
    `declared`: the feature spec's entry of the input, if the manifest has one."""
    dtype = tensor.dtype
    integer_ids = declared.get("dtype") == "int"
    if dtype == tf.string and tensor.shape.rank == 2:
        return _list_converter(int(tensor.shape[1]), integer_ids, str(declared.get("separator") or ""))
    if dtype == tf.string:
        return _to_id if integer_ids else _to_string
    if dtype == tf.int64:
        return _timestamp_converter(declared)
    largest = float(np.finfo(dtype.as_numpy_dtype).max)

    def to_float(value: Any) -> float:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return math.nan
        # bool is an int in Python, but true/false is not a count or a measurement.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput(f"must be a number or null (missing), got {_show(value)}")
        if abs(value) > largest:
            raise InvalidInput(f"is {_show(value)}, outside the range of {dtype.name}; send a finite number")
        return float(value)

    return to_float


def _to_id(value: Any) -> str:
    """An integer id: a JSON integer or its decimal text, as the Spark jobs write it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if value is None or isinstance(value, str):
        return _to_string(value)
    raise InvalidInput(f"must be an integer id, its text, or null (missing), got {_show(value)}")


def _list_converter(length: int, integer_ids: bool, separator: str = "") -> Callable[[Any], list[str]]:
    """`separator`: the spec's, for a feature the log holds as one string of joined values (empty: a list only)."""
    convert = _to_id if integer_ids else _to_string
    joined = f" or one string of values joined by {separator!r}" if separator else ""

    def to_list(value: Any) -> list[str]:
        if value is None:
            value = []
        if separator and isinstance(value, str):  # as the log holds it: read as the Spark jobs read it
            value = [item for item in value.split(separator) if item.strip()][-length:]
        if not isinstance(value, list):
            raise InvalidInput(f"must be a list of at most {length} values, newest last{joined}, got {_show(value)}")
        if len(value) > length:
            raise InvalidInput(f"has {len(value)} values, over its max_length of {length}; send the newest {length}")
        items = []
        for item in value:
            if item is None or isinstance(item, list | dict):
                raise InvalidInput(f"must hold {'integer ids' if integer_ids else 'strings'}, got {_show(item)}")
            items.append(convert(item))
        return [""] * (length - len(items)) + items

    return to_list


def _timestamp_converter(declared: Mapping[str, Any]) -> Callable[[Any], int]:
    from components.feature_spec import TimestampFeature

    feature = TimestampFeature(name=declared.get("name", "ts"), column=declared.get("column", "ts"),
                               format=declared.get("format", "unix_seconds"))

    def to_seconds(value: Any) -> int:
        if value is None:
            return int(time.time())
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise InvalidInput(f"must be a timestamp in format {feature.format!r}, got {_show(value)}")
        try:
            return feature.epoch_seconds(value)
        except (ValueError, OverflowError, OSError):
            raise InvalidInput(f"is {_show(value)}, not a timestamp in format {feature.format!r}") from None

    return to_seconds


def _to_string(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"must be a string or null (missing), got {_show(value)}")
    return value
