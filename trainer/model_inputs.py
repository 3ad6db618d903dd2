"""Names and shapes of the model inputs, from the feature spec; shared by the input pipeline, the models and the
export.

A model reads:
- "dense": float32 [batch, spec.dense_input_dim]: standardized dense values, then their missing flags;
- "categorical": int64 [batch, F]: the embedding rows of the spec's F single-valued categorical features, each
  in its table (`feature_tables`);
- one int64 [batch, max_length] input per multi-valued or sequence feature, named after it: row ids of its
  table, newest last, the front padded with MISSING_ROW (1). The models mask MISSING_ROW and any negative id
  wherever it sits (HISTORY_PADDING, -1, pads synthetic tensors).

`ModelInputs` is that description as plain data: the models keep it in their config, so a saved model knows
what it reads without the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from components.feature_spec import MISSING_ROW, FeatureSpec, SequenceFeature, load_spec

DENSE_INPUT = "dense"
CATEGORICAL_INPUT = "categorical"
# The behaviour sequence's input name when a model is built without a spec (synthetic tensors, benchmarks):
# int64 [batch, sequence_length] row ids of the item feature's table, most recent last.
HISTORY_INPUT = "history"
HISTORY_PADDING = -1
PADDING_ROW = MISSING_ROW


@dataclass(frozen=True)
class ListInput:
    """One multi-valued or sequence input: its key, the index of its table, its width and its pooling."""

    key: str
    table: int
    length: int
    pooling: str = "mean"  # sum | mean: how models without attention pool it
    sequence: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "table": self.table, "length": self.length, "pooling": self.pooling}


@dataclass(frozen=True)
class ModelInputs:
    dense_dim: int
    tables: tuple[str, ...]
    feature_tables: tuple[int, ...]  # per categorical column, its table's index
    categorical_names: tuple[str, ...]
    lists: tuple[ListInput, ...] = ()
    # The attention models' target and behaviour sequence: the first sequence feature and the categorical
    # column it shares a table with.
    sequence: str | None = None
    target_column: int | None = None

    @property
    def shapes(self) -> dict[str, tuple[int | None, ...]]:
        return {DENSE_INPUT: (None, self.dense_dim), CATEGORICAL_INPUT: (None, len(self.feature_tables)),
                **{item.key: (None, item.length) for item in self.lists}}

    def bags(self, *, attended: bool) -> list[dict[str, Any]]:
        """The list inputs a model pools into one vector each: all of them, or (`attended`: DIN, DIEN) all but
        the behaviour sequence their attention reads."""
        return [item.as_dict() for item in self.lists if not (attended and item.key == self.sequence)]

    def embedding_options(self, spec: FeatureSpec) -> dict[str, Any]:
        """CategoricalEmbedding arguments from the spec: shared tables, multi-hash compression of the tables that
        ask for it (one hashing setting for all of them), and the tiered tables with their hot rows."""
        options: dict[str, Any] = {}
        if list(self.feature_tables) != list(range(len(self.tables))):
            options["feature_tables"] = list(self.feature_tables)
        tiered = {i: table.hot_rows for i, table in enumerate(spec.tables().values()) if table.tiered}
        if tiered:  # on disk with a hot tier in memory (trainer/tiered_tables.py)
            options["tiered_tables"] = tiered
        hashed = [(i, table.hashing) for i, table in enumerate(spec.tables().values()) if table.hashing]
        if hashed:
            settings = {h for _, h in hashed}
            if len(settings) > 1:
                raise ValueError(f"feature spec {spec.name!r}: hashed tables must share one hashing setting, got "
                                 f"{sorted(map(str, settings))}")
            hashing = hashed[0][1]
            options.update(hashed_features=[i for i, _ in hashed], num_hash_buckets=hashing.buckets,
                           num_hash_functions=hashing.functions, hash_combiner=hashing.combiner)
        return options


def model_inputs(spec: FeatureSpec) -> ModelInputs:
    tables = list(spec.tables())
    lists = tuple(
        ListInput(f.name, tables.index(spec.table_of(f.name)), f.max_length,
                  getattr(f, "pooling", "mean"), isinstance(f, SequenceFeature))
        for f in spec.lists
    )
    sequences = spec.sequences
    target = spec.categorical_names.index(sequences[0].shares) if sequences else None
    return ModelInputs(
        dense_dim=spec.dense_input_dim, tables=tuple(tables),
        feature_tables=tuple(tables.index(spec.table_of(f.name)) for f in spec.categorical),
        categorical_names=spec.categorical_names, lists=lists,
        sequence=sequences[0].name if sequences else None, target_column=target,
    )


CRITEO_INPUTS = model_inputs(load_spec("criteo"))
INPUT_SHAPES: Mapping[str, tuple[int | None, ...]] = CRITEO_INPUTS.shapes


def sequence_input_shapes(sequence_length: int) -> dict[str, tuple[int | None, ...]]:
    """The criteo inputs plus a synthetic behaviour sequence (HISTORY_INPUT)."""
    return {**INPUT_SHAPES, HISTORY_INPUT: (None, sequence_length)}
