"""Block TFRecords (components.block_codec) read with numpy only: no TensorFlow, for JAX hosts.

Gives the arrays `trainer.input.block_dataset(..., shuffle=False, inputs=...)` gives, batch for batch, for the
inputs of any feature spec (trainer.model_inputs.ModelInputs; the criteo spec's by default): dense float32
[B, dense_dim], categorical int64 [B, F], and one int64 [B, max_length] per multi-valued or sequence feature,
with label float32 [B].

The framing is checked record by record (masked crc32c, google_crc32c). Each record is a tf.Example decoded by
a small protobuf walker that reads the block's features in any order, packed or not, so blocks written by
components.block_codec, tf.train.Example or tfx-bsl all decode; values are decoded with vectorized numpy
(packed floats are one `frombuffer`, packed varints one pass over the bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.block_codec import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_NUM_ROWS_KEY,
    masked_crc,
)
from trainer.arguments import require_integer
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs

_HEADER_BYTES = 12  # uint64 length + uint32 masked crc of the length
_FOOTER_BYTES = 4  # uint32 masked crc of the data

# Protobuf wire types.
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
# tf.train.Feature's oneof: bytes_list = 1, float_list = 2, int64_list = 3.
_FLOAT_LIST, _INT64_LIST = 2, 3

Batch = tuple[dict[str, np.ndarray], np.ndarray]


class BlockFormatError(ValueError):
    """A file is not a readable block TFRecord file: bad framing, checksum or block contents."""


@dataclass(frozen=True)
class Block:
    labels: np.ndarray  # float32 [n]
    # Per model input (block key): dense float32 [n, dense_dim], categorical int64 [n, F], each list feature
    # int64 [n, max_length].
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def dense(self) -> np.ndarray:
        return self.columns[DENSE_INPUT]

    @property
    def categorical(self) -> np.ndarray:
        return self.columns[CATEGORICAL_INPUT]


def block_widths(inputs: ModelInputs) -> dict[str, int]:
    """Values per row of each packed key of a block, by model input: what trainer.input's parser reads."""
    return {BLOCK_DENSE_KEY: inputs.dense_dim, BLOCK_CATEGORICAL_KEY: len(inputs.feature_tables),
            **{item.key: item.length for item in inputs.lists}}


def _block_kinds(inputs: ModelInputs) -> dict[bytes, int]:
    return {BLOCK_NUM_ROWS_KEY.encode(): _INT64_LIST, BLOCK_LABEL_KEY.encode(): _FLOAT_LIST,
            **{key.encode(): _FLOAT_LIST if key == BLOCK_DENSE_KEY else _INT64_LIST for key in block_widths(inputs)}}


def read_records(path: str | Path, verify: bool = True) -> Iterator[memoryview]:
    """The records of one uncompressed TFRecord file, each checked against its crc32c when `verify`."""
    data = memoryview(Path(path).read_bytes())
    offset, total = 0, len(data)
    while offset < total:
        if total - offset < _HEADER_BYTES:
            raise BlockFormatError(
                f"{path}: truncated TFRecord header at byte {offset} of {total}; the file was cut short "
                "(an interrupted copy or write): write it again"
            )
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + _HEADER_BYTES + length + _FOOTER_BYTES
        if end > total:
            raise BlockFormatError(
                f"{path}: TFRecord at byte {offset} says it holds {length} bytes, which runs past the end of "
                f"the file ({total} bytes); the file was cut short or is not a TFRecord file: write it again"
            )
        record = data[offset + _HEADER_BYTES : end - _FOOTER_BYTES]
        if verify:
            (length_crc,) = struct.unpack_from("<I", data, offset + 8)
            (data_crc,) = struct.unpack_from("<I", data, end - _FOOTER_BYTES)
            if length_crc != masked_crc(data[offset : offset + 8]) or data_crc != masked_crc(record):
                raise BlockFormatError(
                    f"{path}: TFRecord checksum mismatch in the record at byte {offset}; the file is corrupt "
                    "(or GZIP-compressed, which block files never are): write it again"
                )
        yield record
        offset = end


def decode_block(record: bytes | memoryview, inputs: ModelInputs = CRITEO_INPUTS) -> Block:
    """One serialized block tf.Example -> its rows, with the columns `inputs` names. Raises BlockFormatError
    when a feature is missing, has the wrong type, or does not hold num_rows rows."""
    view = memoryview(record)
    kinds = _block_kinds(inputs)
    found: dict[bytes, np.ndarray] = {}
    for number, wire_type, start, end in _fields(view, 0, len(view)):
        if number != 1 or wire_type != _LENGTH_DELIMITED:  # Example.features
            continue
        for entry_number, entry_type, entry_start, entry_end in _fields(view, start, end):
            if entry_number == 1 and entry_type == _LENGTH_DELIMITED:  # Features.feature map entry
                key, values = _map_entry(view, entry_start, entry_end, kinds)
                if key is not None:
                    found[key] = values
    missing = [key.decode() for key in kinds if key not in found]
    if missing:
        raise BlockFormatError(
            f"block Example has no {missing} feature (found {sorted(k.decode() for k in found)}); the feature "
            f"spec's block files hold {sorted(k.decode() for k in kinds)}: read them with the spec they were "
            "written under, or write them with components.block_codec.encode_blocks"
        )
    num_rows_values = found[BLOCK_NUM_ROWS_KEY.encode()]
    if len(num_rows_values) != 1 or num_rows_values[0] < 0:
        raise BlockFormatError(f"block num_rows must be one value >= 0, got {num_rows_values.tolist()}")
    num_rows = int(num_rows_values[0])
    labels = found[BLOCK_LABEL_KEY.encode()]
    columns = {}
    for name, values, width in ((BLOCK_LABEL_KEY, labels, 1),
                                *((key, found[key.encode()], width) for key, width in block_widths(inputs).items())):
        if len(values) != num_rows * width:
            raise BlockFormatError(
                f"block feature {name!r} holds {len(values)} values, expected num_rows x {width} = "
                f"{num_rows * width}; the block is corrupt or was written for another feature spec"
            )
        if name != BLOCK_LABEL_KEY:
            columns[name] = values.reshape(num_rows, width)
    return Block(labels, columns)


def iter_blocks(files: Iterable[str | Path], verify: bool = True,
                inputs: ModelInputs = CRITEO_INPUTS) -> Iterator[Block]:
    """Every block of `files`, in file order and record order."""
    for path in files:
        for index, record in enumerate(read_records(path, verify)):
            try:
                yield decode_block(record, inputs)
            except BlockFormatError as err:
                raise BlockFormatError(f"{path}: record {index}: {err}") from None


def block_batches(
    files: Sequence[str | Path],
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    shuffle_buffer_blocks: int = 64,
    drop_remainder: bool = False,
    verify: bool = True,
    inputs: ModelInputs = CRITEO_INPUTS,
) -> Iterator[Batch]:
    """Batches of ({"dense": float32 [B, dense_dim], "categorical": int64 [B, F], one int64 [B, max_length]
    per list feature}, label float32 [B]) as `inputs` (the feature spec's, trainer.model_inputs) describes
    them: blocks re-cut to `batch_size` rows, the last batch short unless `drop_remainder`.

    shuffle=False: files in the given order, rows in file order (batch for batch what block_dataset gives).
    shuffle=True: file order and block order (in a buffer of `shuffle_buffer_blocks`) are shuffled, with
    `seed`; rows keep their order inside a block. Each call is one pass: pass another seed for another order.
    """
    if not files:
        raise ValueError("block_batches needs at least one file; received an empty list")
    require_integer("batch_size", batch_size)
    require_integer("shuffle_buffer_blocks", shuffle_buffer_blocks)
    blocks = iter_blocks(files, verify, inputs)
    if shuffle:
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(files))
        blocks = _shuffled(iter_blocks([files[i] for i in order], verify, inputs), shuffle_buffer_blocks, rng)
    return _rebatched(blocks, batch_size, drop_remainder)


def _rebatched(blocks: Iterator[Block], batch_size: int, drop_remainder: bool) -> Iterator[Batch]:
    pending: list[Block] = []
    num_pending = 0
    for block in blocks:
        if not len(block):
            continue
        pending.append(block)
        num_pending += len(block)
        if num_pending < batch_size:
            continue
        joined = _concatenate(pending)
        num_full = num_pending // batch_size * batch_size
        for start in range(0, num_full, batch_size):
            stop = start + batch_size
            yield {name: values[start:stop] for name, values in joined.columns.items()}, joined.labels[start:stop]
        pending = [Block(joined.labels[num_full:], {name: values[num_full:] for name, values in joined.columns.items()})
                   ] if num_full < num_pending else []
        num_pending -= num_full
    if num_pending and not drop_remainder:
        joined = _concatenate(pending)
        yield joined.columns, joined.labels


def _concatenate(blocks: list[Block]) -> Block:
    if len(blocks) == 1:
        return blocks[0]
    return Block(np.concatenate([b.labels for b in blocks]),
                 {name: np.concatenate([b.columns[name] for b in blocks]) for name in blocks[0].columns})


def _shuffled(blocks: Iterator[Block], buffer_size: int, rng: np.random.Generator) -> Iterator[Block]:
    """tf.data-style buffered shuffle: each output is a random pick from the next `buffer_size` blocks."""
    buffer: list[Block] = []
    for block in blocks:
        if len(buffer) < buffer_size:
            buffer.append(block)
            continue
        index = int(rng.integers(len(buffer)))
        yield buffer[index]
        buffer[index] = block
    rng.shuffle(buffer)  # type: ignore[arg-type]
    yield from buffer


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    result, shift = 0, 0
    while pos < end:
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise BlockFormatError(f"truncated protobuf varint ending at byte {pos}; the block is corrupt")


def _fields(view: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each field in view[pos:end]; a varint or fixed
    field's value spans its bytes."""
    while pos < end:
        tag, pos = _varint(view, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(view, pos, end)
            start, pos = pos, pos + length
        elif wire_type == _VARINT:
            start = pos
            _, pos = _varint(view, pos, end)
        elif wire_type in (_FIXED32, _FIXED64):
            start, pos = pos, pos + (4 if wire_type == _FIXED32 else 8)
        else:
            raise BlockFormatError(f"protobuf wire type {wire_type} at byte {pos} is not valid in a tf.Example")
        if pos > end:
            raise BlockFormatError(f"protobuf field {number} runs past the end of its message (byte {end})")
        yield number, wire_type, start, pos


def _map_entry(view: memoryview, pos: int, end: int, kinds: dict[bytes, int]) -> tuple[bytes | None, np.ndarray]:
    """One Features.feature entry -> (key, values), or (None, _) for a key `kinds` (the spec's block keys and
    their list type) does not name."""
    key: bytes | None = None
    feature: tuple[int, int] | None = None
    for number, wire_type, start, stop in _fields(view, pos, end):
        if number == 1 and wire_type == _LENGTH_DELIMITED:
            key = bytes(view[start:stop])
        elif number == 2 and wire_type == _LENGTH_DELIMITED:
            feature = (start, stop)
    if key not in kinds:
        return None, np.empty(0)
    expected = kinds[key]
    kind = None
    values = np.empty(0, dtype=np.float32 if expected == _FLOAT_LIST else np.int64)
    for number, wire_type, start, stop in _fields(view, *feature) if feature else ():
        if wire_type != _LENGTH_DELIMITED:
            continue
        kind = number
        if number == expected:
            values = _float_list(view, start, stop) if expected == _FLOAT_LIST else _int64_list(view, start, stop)
    if kind not in (None, expected):
        names = {1: "bytes_list", _FLOAT_LIST: "float_list", _INT64_LIST: "int64_list"}
        raise BlockFormatError(
            f"block feature {key.decode()!r} is a {names.get(kind, kind)}, expected a {names[expected]}; "
            "the file was written for another schema"
        )
    return key, values


def _float_list(view: memoryview, pos: int, end: int) -> np.ndarray:
    parts = []
    for number, wire_type, start, stop in _fields(view, pos, end):
        if number == 1 and wire_type in (_LENGTH_DELIMITED, _FIXED32):  # packed, or one unpacked value
            parts.append(np.frombuffer(view[start:stop], dtype="<f4"))
    return _joined(parts, np.float32)


def _int64_list(view: memoryview, pos: int, end: int) -> np.ndarray:
    parts = []
    for number, wire_type, start, stop in _fields(view, pos, end):
        if number == 1 and wire_type in (_LENGTH_DELIMITED, _VARINT):  # packed, or one unpacked value
            parts.append(_decode_varints(np.frombuffer(view[start:stop], dtype=np.uint8)))
    return _joined(parts, np.int64)


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    if len(parts) == 1:
        return parts[0].astype(dtype, copy=False)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype=dtype)


def _decode_varints(data: np.ndarray) -> np.ndarray:
    """Packed protobuf varints -> int64 (two's complement, as int64 fields are), one numpy pass per byte
    position (ids below 2**21 take at most 3) instead of a loop over values."""
    if not data.size:
        return np.empty(0, dtype=np.int64)
    if data[-1] >= 0x80:
        raise BlockFormatError("packed varints end in the middle of a value; the block is corrupt")
    ends = np.flatnonzero(data < 0x80)
    if len(ends) == len(data):  # every value below 128: one byte each
        return data.astype(np.int64)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    max_length = int(lengths.max())
    if max_length > 10:
        raise BlockFormatError(f"a varint of {max_length} bytes (at most 10); the block is corrupt")
    low_bits = data & np.uint8(0x7F)
    values = low_bits[starts].astype(np.uint64)
    for k in range(1, max_length):
        longer = np.flatnonzero(lengths > k)
        values[longer] |= low_bits[starts[longer] + k].astype(np.uint64) << np.uint64(7 * k)
    return values.view(np.int64)
