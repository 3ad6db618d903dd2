"""A row-form predict body read into the packed endpoint's arguments in native code (serving/native/rows.c).

The general way from a body to the arguments is msgspec's typed records (serving.model.RowDecoder), then a
Python pass per argument: about 0.5 ms of a 100-candidate request of the criteo spec on one core, a quarter of
the model's own time (docs/serving.md). rows.c reads the body in one pass straight into a float32 matrix and the
strings' spans, which become the two tensors with no Python object per value.

It answers only requests it reads exactly as the general path reads them, and None for any other (an escape in
a key, a lone surrogate, a boolean, an unknown key, another shape, bad JSON, ...): the caller then takes the
general path, which says what is wrong. Strings with escapes are decoded into a buffer beside the body.
tests/serving/test_native_rows.py checks that every body it reads gives the typed records' tensors, bit for bit.

The C file is compiled on first use with the host's C compiler (`CC`, default `cc`) into
~/.cache/ctr-pipeline/native (`CTR_NATIVE_CACHE`), one library per source hash. Where there is no compiler the
server logs so once and uses the general path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from components import native_build

if TYPE_CHECKING:
    import tensorflow as tf

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "rows.c"
CACHE_ENV = native_build.CACHE_ENV
COMPILE_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
FLOAT, STRING = 0, 1
NOT_HANDLED, TOO_MANY = -1, -2  # rows.c's CTR_ROWS_NOT_HANDLED and CTR_ROWS_TOO_MANY
BYTES_PER_ROW_GUESS = 64


def library_path(source: Path = SOURCE) -> Path:
    """Where the library built from `source` lives (components.native_build)."""
    return native_build.library_path(source, COMPILE_FLAGS)


def build(source: Path = SOURCE) -> Path:
    """Compiles `source` if its library is not built yet; returns the library's path (components.native_build:
    RuntimeError with the compiler's output when it does not compile)."""
    return native_build.build(source, COMPILE_FLAGS)


@functools.cache
def library() -> ctypes.CDLL | None:
    """rows.c's library, built on first use; None (logged once) where it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as err:
        logger.warning("native row reader unavailable, row-form requests take the general path: %s", err)
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.ctr_read_instances.restype = i64
    lib.ctr_read_instances.argtypes = [ctypes.c_char_p, i64, pointer, pointer, i32, pointer, pointer, i32, i32,
                                       ctypes.c_char_p, i32, i64, pointer, pointer, pointer, pointer, pointer]
    lib.ctr_fill_cells.restype = None
    lib.ctr_fill_cells.argtypes = [ctypes.c_char_p, i64, pointer, pointer, i64, i64, pointer]
    return lib


@dataclass(frozen=True)
class NativeRows:
    """Reads row-form bodies into the arguments of a packed endpoint whose arguments are all stacked floats or
    stacked strings (PackedCall.row_readers "floats" and "strings"). `build` answers None for any other layout."""

    lib: ctypes.CDLL
    names: bytes  # the inputs' UTF-8 names back to back
    # Per input, in the order of `names`: its name's offset (one more at the end), its kind, its column.
    offsets: np.ndarray
    kinds: np.ndarray
    columns: np.ndarray
    num_floats: int
    num_strings: int
    signature: bytes
    # Per packed argument: its kind and its columns [start, stop) in that kind's matrix.
    arguments: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(cls, layout: Sequence[tuple[bool, tuple[str, ...]]], row_readers: Sequence[str],
              signature: str) -> NativeRows | None:
        if set(row_readers) - {"floats", "strings"}:
            return None
        lib = library()
        if lib is None:
            return None
        names, offsets, kinds, columns, arguments = [], [0], [], [], []
        counts = {FLOAT: 0, STRING: 0}
        for (_, inputs), reader in zip(layout, row_readers, strict=True):
            kind = FLOAT if reader == "floats" else STRING
            arguments.append((kind, counts[kind], counts[kind] + len(inputs)))
            for name in inputs:
                encoded = name.encode()
                names.append(encoded)
                offsets.append(offsets[-1] + len(encoded))
                kinds.append(kind)
                columns.append(counts[kind])
                counts[kind] += 1
        return cls(lib=lib, names=b"".join(names), offsets=np.array(offsets, dtype=np.int32),
                   kinds=np.array(kinds, dtype=np.int32), columns=np.array(columns, dtype=np.int32),
                   num_floats=counts[FLOAT], num_strings=counts[STRING], signature=signature.encode(),
                   arguments=tuple(arguments))

    def read(self, body: bytes, max_rows: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        """The body's instances as (rows, floats [rows, num_floats] float32, cells [rows, num_strings] "S<n>"),
        or None when rows.c does not read it, it holds no instances or more than `max_rows`."""
        # Room for the rows of instances of BYTES_PER_ROW_GUESS bytes or more; a body of smaller ones is read
        # again with room for as many rows as it has objects (an instance is one, and so is the body).
        capacity = min(max_rows, len(body) // BYTES_PER_ROW_GUESS + 16)
        found = self._read(body, capacity)
        if found == TOO_MANY and capacity < max_rows:
            capacity = min(max_rows, body.count(b"{") - 1)
            found = self._read(body, capacity)
        if isinstance(found, int):
            return None
        rows, floats, spans, text, longest = found
        cells = np.zeros((rows, self.num_strings), dtype=f"S{max(1, longest)}")
        if self.num_strings and longest:
            self.lib.ctr_fill_cells(body, len(body), text.ctypes.data, spans.ctypes.data, rows * self.num_strings,
                                    cells.itemsize, cells.ctypes.data)
        return rows, floats[:rows], cells

    def _read(self, body: bytes, capacity: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int] | int:
        """(rows, floats, spans, the strings with escapes decoded, longest string), or rows.c's code when it
        reads no rows."""
        if capacity <= 0:
            return NOT_HANDLED
        count = len(self.kinds)
        floats = np.empty((capacity, self.num_floats), dtype=np.float32)
        spans = np.empty((capacity, self.num_strings, 2), dtype=np.int64)
        stamps = np.zeros(count, dtype=np.int64)
        longest = ctypes.c_int64(0)
        text = np.empty(len(body), dtype=np.uint8)  # decoded strings are never longer than the body
        rows = self.lib.ctr_read_instances(
            body, len(body), self.names, self.offsets.ctypes.data, count, self.kinds.ctypes.data,
            self.columns.ctypes.data, self.num_floats, self.num_strings, self.signature, len(self.signature),
            capacity, floats.ctypes.data, spans.ctypes.data, stamps.ctypes.data, ctypes.byref(longest),
            text.ctypes.data)
        if rows <= 0:
            return rows or NOT_HANDLED
        return rows, floats, spans, text, longest.value

    def tensors(self, body: bytes, max_rows: int) -> tuple[int, list[tf.Tensor]] | None:
        """`read`'s matrices as the packed endpoint's arguments, in its order."""
        import tensorflow as tf

        read = self.read(body, max_rows)
        if read is None:
            return None
        rows, floats, cells = read
        out: list[Any] = []
        for kind, start, stop in self.arguments:
            if kind == FLOAT:
                whole = start == 0 and stop == self.num_floats
                out.append(tf.constant(floats if whole else floats[:, start:stop]))
            else:
                whole = start == 0 and stop == self.num_strings
                out.append(tf.constant(cells if whole else cells[:, start:stop], dtype=tf.string))
        return rows, out
