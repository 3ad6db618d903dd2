"""Row id -> int64 value, a batch of rows at a time: the hash table behind the hot tier's numpy planner (row ->
slot, `trainer.hot_tier.RowSlotMap`) and a row store's log (row -> where its latest record is,
`trainer.row_store`, through `new_row_map`: NativeRowMap where trainer/native/hot_tier.c builds, else RowMap).

RowMap, in numpy:

A table of buckets of BUCKET_WIDTH entries. A row lives in the less full of its two buckets (two hash functions,
"two choices"), so a bucket is at most half full on average and almost never full; a lookup compares each row
with the entries of its two buckets, with no probing loop, and a removal empties the row's entry (no
tombstones). Should both of a row's buckets be full, the table doubles. Its memory is 32 to 64 bytes per row held
(two int64 per entry, at least twice the rows' entries) and does not grow with the table the rows belong to (an
array indexed by row id would: 8 bytes per row of the table).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer import native_tier
from trainer.arguments import require_integer

# Entries per bucket: 16 int64 row ids, two cache lines.
BUCKET_WIDTH = 16
# Odd 64-bit multipliers (Fibonacci hashing, and the one of xxHash64's finaliser): a row's two buckets.
HASH_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
EMPTY = -1
# Rows placed at a time: bounds an insert's scratch memory (about 40 MB at 65,536 rows).
INSERT_CHUNK_ROWS = 1 << 16


class RowMap:
    """Row id (>= 0) -> int64 value, sized for `expected_rows` rows and doubling as more are added."""

    def __init__(self, expected_rows: int) -> None:
        require_integer("expected_rows", expected_rows, minimum=0)
        num_buckets = 2
        while num_buckets * BUCKET_WIDTH < 2 * max(int(expected_rows), 1):
            num_buckets *= 2
        self.allocate(num_buckets)

    def allocate(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets
        self.shift = np.uint64(64 - (num_buckets.bit_length() - 1))
        self.rows = np.full((num_buckets, BUCKET_WIDTH), EMPTY, dtype=np.int64)
        self.values = np.zeros((num_buckets, BUCKET_WIDTH), dtype=np.int64)
        self.fill = np.zeros(num_buckets, dtype=np.int64)  # rows per bucket
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def buckets(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's two buckets, distinct."""
        keys = rows.astype(np.uint64)
        first = ((keys * np.uint64(HASH_MULTIPLIERS[0])) >> self.shift).astype(np.intp)
        second = ((keys * np.uint64(HASH_MULTIPLIERS[1])) >> self.shift).astype(np.intp)
        return first, np.where(second == first, first ^ 1, second)

    def entries(self, rows: np.ndarray) -> np.ndarray:
        """Each row's entry (a flat position in the buckets), -1 where the row is absent."""
        rows = np.asarray(rows, dtype=np.int64)
        first, second = self.buckets(rows)
        entries = np.full(len(rows), -1, dtype=np.intp)
        matches = np.flatnonzero(self.rows[first] == rows[:, None])  # at most one per row
        found = matches // BUCKET_WIDTH
        entries[found] = first[found] * BUCKET_WIDTH + matches % BUCKET_WIDTH
        rest = np.flatnonzero(entries < 0)
        matches = np.flatnonzero(self.rows[second[rest]] == rows[rest, None])
        found = rest[matches // BUCKET_WIDTH]
        entries[found] = second[found] * BUCKET_WIDTH + matches % BUCKET_WIDTH
        return entries

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """The value of each of `rows` (int64), -1 where a row is absent."""
        entries = self.entries(rows)
        return np.where(entries >= 0, self.values.reshape(-1)[entries], -1)

    def set(self, rows: np.ndarray, values: np.ndarray) -> int:
        """Sets distinct `rows` to `values`, adding the absent ones; returns how many were present."""
        rows, values = np.asarray(rows, dtype=np.int64), np.asarray(values, dtype=np.int64)
        entries = self.entries(rows)
        present = entries >= 0
        self.values.reshape(-1)[entries[present]] = values[present]
        self.insert(rows[~present], values[~present])
        return int(np.count_nonzero(present))

    def insert(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Adds distinct `rows`, none of them present, with their `values`, INSERT_CHUNK_ROWS at a time (placing a
        row takes scratch arrays of BUCKET_WIDTH entries a row: 400 MB for the 1 M rows a doubling may put back)."""
        rows, values = np.asarray(rows, dtype=np.int64), np.asarray(values, dtype=np.int64)
        for start in range(0, len(rows), INSERT_CHUNK_ROWS):
            self.place(rows[start:start + INSERT_CHUNK_ROWS], values[start:start + INSERT_CHUNK_ROWS])

    def place(self, rows: np.ndarray, values: np.ndarray) -> None:
        while len(rows):
            first, second = self.buckets(rows)
            free_first, free_second = BUCKET_WIDTH - self.fill[first], BUCKET_WIDTH - self.fill[second]
            chosen = np.where(free_second > free_first, second, first)
            free = np.maximum(free_first, free_second)
            if not free.all():
                self.grow()
                continue
            # Rows that chose one bucket take its empty entries in turn; the ones that do not fit choose again.
            order = np.argsort(chosen, kind="stable")
            ordered = chosen[order]
            group_start = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
            rank = np.arange(len(order)) - np.repeat(group_start, np.diff(np.append(group_start, len(order))))
            fits = rank < free[order]
            placed, bucket, rank = order[fits], ordered[fits], rank[fits]
            empty = self.rows[bucket] == EMPTY
            column = empty.argmax(axis=1)  # rank 0: the first empty entry; rank k: the (k + 1)-th
            later = np.flatnonzero(rank)
            column[later] = (np.cumsum(empty[later], axis=1) <= rank[later, None]).sum(axis=1)
            self.rows[bucket, column] = rows[placed]
            self.values[bucket, column] = values[placed]
            self.placed(values[placed], bucket * BUCKET_WIDTH + column)
            np.add.at(self.fill, bucket, 1)
            self.size += len(placed)
            left = np.sort(order[~fits])
            rows, values = rows[left], values[left]

    def placed(self, values: np.ndarray, entries: np.ndarray) -> None:
        """Called with the values just added and their entries (for subclasses that index them)."""

    def remove(self, rows: np.ndarray) -> None:
        """Removes distinct `rows`, all present."""
        self.remove_entries(self.entries(np.asarray(rows, dtype=np.int64)))

    def remove_entries(self, entries: np.ndarray) -> None:
        """Empties distinct `entries`, all in use."""
        self.rows.reshape(-1)[entries] = EMPTY
        np.subtract.at(self.fill, entries // BUCKET_WIDTH, 1)
        self.size -= len(entries)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values) of every row held, in no particular order."""
        present = self.rows != EMPTY
        return self.rows[present], self.values[present]

    def grow(self) -> None:
        """Doubles the buckets and puts every row back."""
        if self.num_buckets * BUCKET_WIDTH >= 64 * max(len(self), BUCKET_WIDTH):
            # Two choices make this all but impossible.
            raise RuntimeError(f"A row map of {len(self)} rows filled both buckets of a row at {self.num_buckets} "
                               "buckets; its rows were not distinct (a bug)")
        rows, values = self.items()
        self.allocate(2 * self.num_buckets)
        self.insert(rows, values)


class NativeRowMap:
    """RowMap's map in C (trainer/native/hot_tier.c, one call per batch of rows instead of numpy's dozens): an
    open-addressing table of (row, value) entries, linear probing, at most half full (32 to 64 bytes per row
    held, as RowMap), doubling as rows are added. `library` is trainer.native_tier.library()'s."""

    def __init__(self, expected_rows: int, library: Any) -> None:
        require_integer("expected_rows", expected_rows, minimum=0)
        self.library = library
        capacity = 1 << max(4, (2 * max(int(expected_rows), 1) - 1).bit_length())
        self.table = np.full((capacity, 2), EMPTY, dtype=np.int64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """The value of each of `rows` (int64), -1 where a row is absent."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        values = np.empty(len(rows), dtype=np.int64)
        self.library.ctr_map_lookup(self.table.ctypes.data, len(self.table), rows.ctypes.data, len(rows),
                                    values.ctypes.data)
        return values

    def set(self, rows: np.ndarray, values: np.ndarray) -> int:
        """Sets distinct `rows` (>= 0) to `values`, adding the absent ones; returns how many were present."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        values = np.ascontiguousarray(values, dtype=np.int64)
        if len(rows) != len(values):
            raise ValueError(f"Setting {len(rows)} rows needs as many values. Received: {len(values)}")
        capacity = len(self.table)
        while 2 * (self.size + len(rows)) > capacity:
            capacity *= 2
        if capacity > len(self.table):
            bigger = np.full((capacity, 2), EMPTY, dtype=np.int64)
            self.library.ctr_map_rehash(self.table.ctypes.data, len(self.table), bigger.ctypes.data, capacity)
            self.table = bigger
        present = int(self.library.ctr_map_set(self.table.ctypes.data, len(self.table), rows.ctypes.data,
                                               values.ctypes.data, len(rows)))
        self.size += len(rows) - present
        return present

    def remove(self, rows: np.ndarray) -> None:
        """Removes distinct `rows`, all present."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        removed = int(self.library.ctr_map_remove(self.table.ctypes.data, len(self.table), rows.ctypes.data,
                                                  len(rows)))
        self.size -= removed
        if removed != len(rows):
            raise ValueError(f"{len(rows) - removed} of the {len(rows)} rows to remove were not in the map (the "
                             "others were removed); remove only rows present")

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values) of every row held, in no particular order."""
        held = self.table[:, 0] != EMPTY
        return self.table[held, 0], self.table[held, 1]


def new_row_map(expected_rows: int, native: bool = True) -> RowMap | NativeRowMap:
    """NativeRowMap where trainer/native/hot_tier.c builds here (and `native`), else RowMap: the same map either
    way."""
    library = native_tier.library() if native else None
    return RowMap(expected_rows) if library is None else NativeRowMap(expected_rows, library)
