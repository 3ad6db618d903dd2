"""An embedding table and its Adagrad accumulator on local disk: fixed-size records addressed by row id.

Layout: one file, a header of HEADER_BYTES (magic, format version, embedding_dim, num_rows), then num_rows
records of 2 * embedding_dim little-endian float32: the row's embedding values, then its accumulator values;
then the log of rows written since (below, "The log").
Row r lives at byte HEADER_BYTES + r * record_bytes, so a row is read or written without an index; the header
is a whole page so that records start page-aligned (an O_DIRECT reader needs that, and a page holds whole
records for the usual power-of-two dimensions).

Why pread/pwrite and not a memmap: a memmap's pages count as the process's resident memory until the kernel
reclaims them, so scanning a 100 M-row table (a flush, a snapshot, an export) would look like, and under a
memory limit (cgroup, Kubernetes) be charged as, a 12.8 GB process; its writes reach the file whenever the
kernel chooses; and an I/O error arrives as SIGBUS inside numpy instead of an OSError at the call. With
pread/pwrite the process holds only the rows it asked for (memory does not grow with the table), every byte
read or written is counted here, and errors are exceptions. The cost is a request per run of consecutive
rows: `read` and `write` sort the rows and read or write each run of consecutive ids with one pread or pwrite,
so sequential scans are a request per chunk and random rows a request per row (1-3 us each from the page cache).
From BATCHED_MIN_RUNS runs on, the requests go to the kernel AIO_BATCH at a time in one io_submit (BatchedIO):
the kernel's work is the same, but Python releases and retakes the GIL once instead of once per row, which is
what a prefetching thread beside a training loop pays for (it waits for the GIL at every retake).

On a buffered file the kernel performs those requests one after another inside io_submit, so a read of rows
that are not in the page cache waits for the disk once per row, a queue depth of one. So the runs of a read or
write are first tried from the page cache alone (one batch of RWF_NOWAIT reads), and those that would wait for
the disk are cut into up to `io_threads` parts (IO_THREADS, 8) done at once by a pool of threads, each with its
own io_submit: the disk sees that many requests at a time. Measured here (a virtio disk, random 4 KiB O_DIRECT
reads of a 2 GiB file): one thread 4,900-18,900 reads/s, 16 threads 62,000-66,000.

Two more things keep the requests cheap. The file is advised POSIX_FADV_RANDOM: rows are read at random, and
readahead would read (and cache) neighbours nobody asked for. And a new store is written a page per call: a
large write puts large folios in the page cache on recent kernels (ext4 since Linux 6.16), and a small write
into a large folio costs the kernel a walk over all of its blocks, 5-9 us per row written back instead of
1-3 (measured here: a random 128-byte pwrite into a file written in 8 MiB calls, and in 4 KiB calls).

The log. A row written back by training touches one record of 128 bytes (dimension 16) somewhere in the table:
written in place, it dirties a page of the store, and the kernel writes 4 KiB to disk for it (1.26 GB for 50.6 MB
of rows in bench-tiers, where the step then waited for those pages). So a write (`write`, once the store is
made) appends its rows to a log after the table instead, as one block in one call: the count of its rows and
their ids (int64, padded to whole records), then their records. A map in memory (`log_index`, trainer.row_map's
new_row_map: 32-64 bytes a row) says which record holds each logged row's latest values, as a row id past the
table's (num_rows + k for the log's record k), so reads find them with the same runs, threads and batched calls as
the table's rows.
`flush` makes the log durable and then records its length in the header (LOG_HEADER at LOG_HEADER_OFFSET); `open`
rebuilds the map from the blocks up to that length, so records appended after the last flush are not part of
the store. Once the log holds more than LOG_COMPACT_MIN_RECORDS records and LOG_GARBAGE_FACTOR times its rows,
each flush merges a part of it into the table (`merge_part`: the rows with the oldest records, at least twice
as many as were appended since the flush before), until no row is left in it and it is cut off; a log of more
than LOG_MAX_ROWS distinct rows (the map's memory) is merged whole at once (`compact`). Creation, the merge
and stores with `log_writes` off (serving's scratch stores, `materialize`) write in place. The file stays one
file: a snapshot, a hard link, a checksum or a copy takes the log with the table.

A store is not safe against a crash on its own: a write in place that is killed half-way leaves a record half
old and half new, and an append not yet flushed is dropped by the next open. Consistency comes from
checkpoints: `snapshot` copies the file (after a flush) into an immutable file, and a resumed run starts from
the snapshot, not from the live store. A merge of the log is safe on its own: the table's rows are written and
made durable before the header lets the log go, and until then the log names the same values. See
docs/tiers.md.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from trainer.arguments import require_integer
from trainer.row_map import new_row_map

MAGIC = b"CTRROWS1"
FORMAT_VERSION = 1
# Format 2: a store that draws the rows it has never written (`RowStore.create` with a UniformRows initializer).
FRESH_FORMAT_VERSION = 2
HEADER_BYTES = 4096
HEADER = struct.Struct("<8sIIQ")  # magic, version, embedding_dim, num_rows
# Format 2's header: format 1's, then the initializer's seed, minval and maxval, the initial accumulator, and the
# columns drawn as zeros at the end of each record (a linear part's weight; 0 in stores written before it, whose
# header page is zeros there).
FRESH_HEADER = struct.Struct("<8sIIQQddfI")
RECORD_DTYPE = np.dtype("<f4")
# The log's descriptor in the header page: its magic and the log's length in records as of the last flush.
LOG_HEADER_OFFSET = 1024
LOG_HEADER = struct.Struct("<8sQ")
LOG_MAGIC = b"CTRLOG01"
# A log that holds more than this many records (128 MiB at dimension 16) and four times the rows it holds is
# merged into the table a part at a time, one part per flush (at least LOG_MERGE_MIN_ROWS rows, and twice the
# rows appended since the flush before, oldest records first), until none of its rows is left and it is cut off:
# a flush never pays for the whole log at once (a minute run's flush, among others). A log of more than
# LOG_MAX_ROWS distinct rows (RowStore.log_max_rows: its index's memory, 32-64 bytes a row) or of more than
# LOG_RECORDS_LIMIT_FACTOR times its rows (and of LOG_COMPACT_MIN_RECORDS) is merged whole at the write that
# passes it: the bound on memory and disk between flushes.
LOG_COMPACT_MIN_RECORDS = 1 << 20
LOG_GARBAGE_FACTOR = 4
LOG_MERGE_MIN_ROWS = 1 << 16
LOG_RECORDS_LIMIT_FACTOR = 16
LOG_MAX_ROWS = 1 << 22
# Rows written per call when a store is created: bounds the memory creation needs (8 MiB at dimension 16).
CREATE_CHUNK_ROWS = 65_536
# Bytes per call when a snapshot falls back to copying through the process.
COPY_CHUNK_BYTES = 8 << 20
# Creation writes at most a page per call (see the module's docstring).
PAGE_BYTES = 4096
# Linux's native AIO system calls (io_setup, io_destroy, io_getevents, io_submit) by machine: the numbers of
# arch/x86/entry/syscalls/syscall_64.tbl and of include/uapi/asm-generic/unistd.h.
AIO_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
AIO_READ, AIO_WRITE = 0, 1  # IOCB_CMD_PREAD, IOCB_CMD_PWRITE
# struct iocb and struct io_event of linux/aio_abi.h, little-endian.
IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                 ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                 ("flags", "<u4"), ("resfd", "<u4")])
IO_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
# Requests per io_submit (and events an AIO context holds).
AIO_BATCH = 256
# A read or write of at least this many runs goes through one io_submit per AIO_BATCH runs; fewer, a call each.
BATCHED_MIN_RUNS = 16
# Threads a store's read or write of many runs is cut across by default (RowStore.io_threads), and the runs
# that wait for the disk each part holds at least (a read from the disk takes 50-200 us here; handing a part
# to a thread, tens).
IO_THREADS = 8
PARALLEL_MIN_MISSES = 4
# Linux's FICLONE ioctl (_IOW(0x94, 9, int), linux/fs.h): a reflink, the whole file shared copy-on-write.
# Python's fcntl names it only from 3.12.
FICLONE = 0x40049409
# splitmix64's constants (Steele, Lea and Flood, 2014): the counter-based hash behind UniformRows.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
UINT64_MASK = (1 << 64) - 1

RowInitializer = Callable[[int, int], np.ndarray]


@dataclass(frozen=True)
class StoreCounters:
    """What a store has read and written since it was opened: rows asked for, bytes moved, system calls."""

    rows_read: int = 0
    bytes_read: int = 0
    read_calls: int = 0
    rows_written: int = 0
    bytes_written: int = 0
    write_calls: int = 0
    fsyncs: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0
    batched_calls: int = 0  # io_submit calls; each carries up to AIO_BATCH of the read and write calls above
    rows_fresh: int = 0  # rows read that were never written, drawn from the store's initializer (format 2)
    cache_probes: int = 0  # runs first tried from the page cache alone (RWF_NOWAIT), before threads
    cache_hits: int = 0  # ...of which were there (or in holes): read then, or written on the calling thread
    rows_in_holes: int = 0  # rows read with no I/O: on pages of the table that hold no data (format 2)
    log_appends: int = 0  # writes appended to the log, one call each
    log_merges: int = 0  # merges of (part of) the log into the table
    log_compactions: int = 0  # ...of which left no row in the log, which was then cut off
    rows_compacted: int = 0  # rows those merges wrote into the table


class RowStore:
    """A table of `num_rows` rows of `embedding_dim` values and as many accumulator values, in one file.

    Make one with `create` (rows from an initializer) or `from_arrays`, or open one with `open`. Reads and
    writes may come from two threads (a prefetching producer and the training loop): pread/pwrite take their
    offset as an argument, and the counters are updated under a lock. `io_threads` (IO_THREADS unless set) is
    how many parts, done at once, a read or write of many rows is cut into; 1 does every request on the
    calling thread.
    """

    def __init__(self, path: Path, fd: int, embedding_dim: int, num_rows: int, writable: bool,
                 fresh: UniformRows | None = None, fresh_accumulator: float = 0.0, log_length: int = 0,
                 log_writes: bool = False) -> None:
        self.path = Path(path)
        # Format 2: a row whose accumulator is all zeros was never written; it reads as `fresh`'s row with
        # accumulators of `fresh_accumulator` (> 0, and accumulators only grow, so a written row is never zeros).
        self.fresh = fresh
        self.fresh_accumulator = fresh_accumulator
        self.fd = fd
        self.embedding_dim = embedding_dim
        self.num_rows = num_rows
        self.writable = writable
        self.record_floats = 2 * embedding_dim
        self.record_bytes = self.record_floats * RECORD_DTYPE.itemsize
        self._lock = threading.Lock()
        self._counters = StoreCounters()
        self.io_threads = IO_THREADS
        # The log (see "The log" in the module's docstring): records after the table, in record units, and the
        # map row -> the record holding the row's latest values, as a row id past the table's (num_rows + k for
        # the log's record k), so that the log's records are read and written as the table's rows are.
        self.log_writes = log_writes
        self.log_max_rows = LOG_MAX_ROWS
        self.log_compact_min_records = LOG_COMPACT_MIN_RECORDS
        self.log_merge_min_rows = LOG_MERGE_MIN_ROWS
        self.rows_appended = 0  # since the last flush: the flush's part of the log merges at least twice as many
        self.log_length = self.log_committed = 0
        self.native_index = True  # the index in C where trainer/native/hot_tier.c builds (`use_numpy_index`)
        self.log_index = new_row_map(0)
        self.log_lock = threading.Lock()  # the index, and the records a read is reading (a merge moves them)
        if log_length:
            self.load_log(log_length)
        # A store that draws its rows (format 2): which pages of the table hold data. A row whose pages are holes
        # (and that the log does not hold) was never written, so it is drawn without a read: most rows a
        # training reads for the first time. One byte per page of the table (1/4,096 of its size).
        self.data_pages = (self.table_data_pages() if fresh is not None and self.record_bytes <= PAGE_BYTES
                           else None)
        if hasattr(os, "posix_fadvise"):  # not on macOS; there the kernel's readahead stays on
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    # --- making and opening ---------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: Path | str,
        num_rows: int,
        embedding_dim: int,
        initializer: RowInitializer,
        *,
        initial_accumulator: float,
        chunk_rows: int = CREATE_CHUNK_ROWS,
    ) -> RowStore:
        """A new store at `path` whose row r holds `initializer(start, stop)[r - start]` and whose accumulator
        values are all `initial_accumulator` (the optimizer's initial accumulator value). The initializer is
        called once per chunk of `chunk_rows` rows and must return float32-convertible [stop - start,
        embedding_dim]: the table is never whole in memory.

        With a UniformRows initializer (`uniform_initializer`) nothing is written but the header: the file is
        sized with ftruncate (sparse where the filesystem has holes), and a row reads as the initializer's until
        it is first written (format 2). Creation is then instant whatever the table's size, only rows written
        take disk, and a row read for the first time costs no disk read (a hole reads as zeros from memory),
        nor does the first write of a row into a page still a hole."""
        require_integer("num_rows", num_rows)
        require_integer("embedding_dim", embedding_dim)
        require_integer("chunk_rows", chunk_rows)
        if isinstance(initializer, UniformRows) and initializer.embedding_dim == embedding_dim:
            return cls.create_fresh(path, num_rows, initializer, initial_accumulator)

        def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for start in range(0, num_rows, chunk_rows):
                stop = min(num_rows, start + chunk_rows)
                values = np.asarray(initializer(start, stop), dtype=np.float32)
                if values.shape != (stop - start, embedding_dim):
                    raise ValueError(
                        f"The initializer must return [stop - start, embedding_dim] = [{stop - start}, "
                        f"{embedding_dim}] for rows {start}..{stop - 1}. Received: shape {values.shape}; fix the "
                        "initializer to return one row of embedding_dim values per row id in [start, stop)")
                yield values, np.full_like(values, initial_accumulator)

        return cls.write_new(path, num_rows, embedding_dim, chunks())

    @classmethod
    def from_arrays(
        cls,
        path: Path | str,
        values: np.ndarray,
        accumulators: np.ndarray | None = None,
        *,
        initial_accumulator: float | None = None,
        chunk_rows: int = CREATE_CHUNK_ROWS,
    ) -> RowStore:
        """A new store at `path` holding `values` [num_rows, embedding_dim] and `accumulators` (same shape), or,
        without accumulators, `initial_accumulator` everywhere. The arrays are copied a chunk at a time, so a
        memmap of any size can be the source."""
        if getattr(values, "ndim", 0) != 2 or not values.shape[0] or not values.shape[1]:
            raise ValueError(f"`values` must be a non-empty [num_rows, embedding_dim] array. Received: shape "
                             f"{getattr(values, 'shape', type(values).__name__)}")
        if accumulators is not None and getattr(accumulators, "shape", None) != values.shape:
            raise ValueError(f"`accumulators` must have the shape of `values`, {values.shape}. Received: shape "
                             f"{getattr(accumulators, 'shape', type(accumulators).__name__)}")
        if (accumulators is None) == (initial_accumulator is None):
            raise ValueError("Give exactly one of `accumulators` and `initial_accumulator`. Received: "
                             f"accumulators={'an array' if accumulators is not None else None}, "
                             f"initial_accumulator={initial_accumulator!r}")
        require_integer("chunk_rows", chunk_rows)
        num_rows, embedding_dim = values.shape

        def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for start in range(0, num_rows, chunk_rows):
                part = np.asarray(values[start:start + chunk_rows], dtype=np.float32)
                if accumulators is None:
                    yield part, np.full_like(part, initial_accumulator)
                else:
                    yield part, np.asarray(accumulators[start:start + chunk_rows], dtype=np.float32)

        return cls.write_new(path, num_rows, embedding_dim, chunks())

    @classmethod
    def write_new(
        cls, path: Path | str, num_rows: int, embedding_dim: int, chunks: Iterator[tuple[np.ndarray, np.ndarray]]
    ) -> RowStore:
        """Writes a store from (values, accumulators) chunks in row order under a temporary name, fsyncs it and
        renames it to `path`: a crash during creation never leaves a partial store under the final name."""

        def fill(store: RowStore) -> None:
            start = 0
            for values, accumulators in chunks:
                store.write(np.arange(start, start + len(values)), values, accumulators, page_by_page=True)
                start += len(values)
            if start != num_rows:
                raise ValueError(f"The chunks held {start} rows for a store of num_rows={num_rows}; give rows for "
                                 "every row id")

        return cls.made_in_place(path, num_rows, embedding_dim,
                                 HEADER.pack(MAGIC, FORMAT_VERSION, embedding_dim, num_rows), fill)

    @classmethod
    def made_in_place(cls, path: Path | str, num_rows: int, embedding_dim: int, header: bytes,
                      fill: Callable[[RowStore], None], fresh: UniformRows | None = None,
                      fresh_accumulator: float = 0.0) -> RowStore:
        """A new store at `path`, made under a temporary name: sized, `header` written, `fill(store)` run, fsynced,
        and only then renamed to `path`, so a crash never leaves a partial store under the final name."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, HEADER_BYTES + num_rows * 2 * embedding_dim * RECORD_DTYPE.itemsize)
            write_all(fd, header, 0)
            store = cls(partial, fd, embedding_dim, num_rows, writable=True, fresh=fresh,
                        fresh_accumulator=fresh_accumulator)
            fill(store)  # in place: rows in order, a chunk a call
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, path)
        fsync_directory(path.parent)
        store.path = path
        store.log_writes = True
        return store

    @classmethod
    def create_fresh(cls, path: Path | str, num_rows: int, initializer: UniformRows, initial_accumulator: float,
                     written: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]] = ()) -> RowStore:
        """`create` with a UniformRows initializer: the header, and the (rows, values, accumulators) of `written`
        (a warm start's trained rows), written and fsynced before the store takes its name; every other row is
        drawn when first read."""
        if not initial_accumulator > 0:
            raise ValueError(f"A store that draws its fresh rows needs initial_accumulator > 0 (zeros mark a row "
                             f"never written). Received: {initial_accumulator}")
        dim = initializer.embedding_dim

        def fill(store: RowStore) -> None:
            for rows, values, accumulators in written:
                store.write(rows, values, accumulators)

        header = FRESH_HEADER.pack(MAGIC, FRESH_FORMAT_VERSION, dim, num_rows, initializer.seed, initializer.minval,
                                   initializer.maxval, initial_accumulator, initializer.zero_columns)
        return cls.made_in_place(path, num_rows, dim, header, fill, fresh=initializer,
                                 fresh_accumulator=float(np.float32(initial_accumulator)))  # as the header holds it

    @classmethod
    def sparse(cls, path: Path | str, num_rows: int, embedding_dim: int) -> RowStore:
        """A new writable store at `path` whose rows read as zeros until written: the file is sized with
        ftruncate, so only the pages of rows written take disk (a sparse file where the filesystem has them).
        For scratch use (serving's delta rows): not fsynced, not renamed into place."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + num_rows * 2 * embedding_dim * RECORD_DTYPE.itemsize)
            write_all(fd, HEADER.pack(MAGIC, FORMAT_VERSION, embedding_dim, num_rows), 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, embedding_dim, num_rows, writable=True)

    @classmethod
    def open(cls, path: Path | str, writable: bool = True) -> RowStore:
        """The store at `path`, after checking its header and its size."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            header = os.pread(fd, HEADER.size, 0)
            if len(header) != HEADER.size or header[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{path} is not a row store: its first bytes are {header[:len(MAGIC)]!r}, a "
                                 f"store's are {MAGIC!r}. Open the file RowStore.create or .snapshot wrote")
            _, version, embedding_dim, num_rows = HEADER.unpack(header)
            fresh, fresh_accumulator = None, 0.0
            if version == FRESH_FORMAT_VERSION:
                *_, seed, minval, maxval, fresh_accumulator, zero_columns = FRESH_HEADER.unpack(
                    os.pread(fd, FRESH_HEADER.size, 0))
                fresh = UniformRows(embedding_dim, seed, minval, maxval, zero_columns)
            elif version != FORMAT_VERSION:
                raise ValueError(f"{path} is a row store of format version {version}; this code reads versions "
                                 f"{FORMAT_VERSION} and {FRESH_FORMAT_VERSION}. Rewrite the store with this "
                                 "version's RowStore")
            log_magic, log_length = LOG_HEADER.unpack(os.pread(fd, LOG_HEADER.size, LOG_HEADER_OFFSET))
            if log_magic != LOG_MAGIC:
                log_length = 0  # a store from before the log: zeros there
            record_bytes = 2 * embedding_dim * RECORD_DTYPE.itemsize
            expected = HEADER_BYTES + (num_rows + log_length) * record_bytes
            size = os.fstat(fd).st_size
            # Past the log's flushed length there may be records appended after the last flush: not part of the
            # store (a flush had not made them durable), and overwritten by the next append.
            if size < expected:
                log = f" and a log of {log_length} records" if log_length else ""
                raise ValueError(f"{path} holds {size} bytes; a store of {num_rows} rows of dimension "
                                 f"{embedding_dim}{log} holds {expected}. The file is truncated or was written by "
                                 "something else: restore it from its last snapshot")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, embedding_dim, num_rows, writable, fresh, fresh_accumulator, log_length,
                   log_writes=writable)

    def close(self) -> None:
        """Closes the file, after a flush where the log holds records no flush made durable."""
        if self.fd >= 0:
            try:
                if self.writable and self.log_length != self.log_committed:
                    self.flush()
            finally:
                os.close(self.fd)
                self.fd = -1

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- rows ------------------------------------------------------------------------------------------------

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, accumulators) of `rows` (ids in any order, duplicates allowed), each float32
        [len(rows), embedding_dim]. Each distinct row is read once."""
        values, accumulators, _ = self.read_marked(rows)
        return values, accumulators

    def read_marked(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`read`, and whether each row was ever written (bool [len(rows)]): False for a row a store of format 2
        drew from its initializer, True for every row of a store of format 1."""
        rows = self.check_rows(rows)
        if strictly_increasing(rows):  # a plan's loads: sorted and distinct already
            unique, inverse = rows, None
        else:
            unique, inverse = np.unique(rows, return_inverse=True)
        records = np.empty((len(unique), self.record_floats), dtype=RECORD_DTYPE)
        holes = 0
        with self.log_lock:  # held while reading: a merge of the log may not move the records meanwhile
            where = self.log_index.lookup(unique) if len(self.log_index) else None
            # The rows the log holds are read from their latest records, in file order with the others.
            located = unique if where is None else np.where(where >= 0, where, unique)
            needed = None if self.data_pages is None else self.has_data(unique)
            if needed is not None and where is not None:
                needed |= where >= 0
            if needed is None or needed.all():
                calls = self.read_located(located, records)
            else:  # rows on pages that hold no data were never written: zeros, drawn below, with no read
                holes = len(needed) - int(np.count_nonzero(needed))
                part = np.empty((len(needed) - holes, self.record_floats), dtype=RECORD_DTYPE)
                calls = self.read_located(located[needed], part)
                records[needed] = part
                records[~needed] = 0
        fresh = 0
        written = np.ones(len(unique), dtype=bool)
        if self.fresh is not None:
            written = records[:, self.embedding_dim:].any(axis=1)
            fresh = len(unique) - int(np.count_nonzero(written))
            if fresh:
                records[~written, :self.embedding_dim] = self.fresh.rows(unique[~written])
                records[~written, self.embedding_dim:] = self.fresh_accumulator
        self.count(rows_read=len(unique), bytes_read=records.nbytes, read_calls=calls, rows_fresh=fresh,
                   rows_in_holes=holes)
        if inverse is not None:
            records, written = records[inverse], written[inverse]
        return records[:, :self.embedding_dim], records[:, self.embedding_dim:], written

    def read_located(self, located: np.ndarray, records: np.ndarray) -> int:
        """Reads the records at `located` (row ids, or past the table the log's records; distinct) into
        `records`, in file order. Returns the calls made."""
        if strictly_increasing(located):
            return self.transfer(located, records, reading=True)
        order = np.argsort(located)
        ordered = np.empty_like(records)
        calls = self.transfer(located[order], ordered, reading=True)
        records[order] = ordered
        return calls

    def table_data_pages(self) -> np.ndarray:
        """Per page of the table's records (PAGE_BYTES from HEADER_BYTES on), whether the file holds data there
        (SEEK_DATA / SEEK_HOLE; every page where the system cannot tell)."""
        table_bytes = self.num_rows * self.record_bytes
        pages = np.zeros(-(-table_bytes // PAGE_BYTES), dtype=bool)
        for begin, end in data_segments(self.fd, HEADER_BYTES + table_bytes):
            begin, end = max(begin, HEADER_BYTES) - HEADER_BYTES, end - HEADER_BYTES
            if end > begin:
                pages[begin // PAGE_BYTES:-(-end // PAGE_BYTES)] = True
        return pages

    def has_data(self, rows: np.ndarray) -> np.ndarray:
        """Whether a page each of `rows`' records touches holds data (a record spans at most two pages)."""
        first = rows * self.record_bytes // PAGE_BYTES
        last = ((rows + 1) * self.record_bytes - 1) // PAGE_BYTES
        return self.data_pages[first] | self.data_pages[last]  # type: ignore[index]

    def mark_data(self, rows: np.ndarray) -> None:
        """Records that `rows` are about to be written in place: their pages hold data from now on."""
        if self.data_pages is not None:
            self.data_pages[rows * self.record_bytes // PAGE_BYTES] = True
            self.data_pages[((rows + 1) * self.record_bytes - 1) // PAGE_BYTES] = True

    def write(self, rows: np.ndarray, values: np.ndarray, accumulators: np.ndarray, *,
              page_by_page: bool = False) -> None:
        """Writes `values` and `accumulators` ([len(rows), embedding_dim]) to distinct `rows`, in place. With
        `page_by_page`, no call writes across a page boundary (for pages not in the page cache yet: creation)."""
        if not self.writable:
            raise ValueError(f"{self.path} was opened read-only; open it with RowStore.open(path, writable=True) "
                             "to write rows")
        rows = self.check_rows(rows)
        shape = (len(rows), self.embedding_dim)
        if np.shape(values) != shape or np.shape(accumulators) != shape:
            raise ValueError(f"Writing {len(rows)} rows needs values and accumulators of shape {shape}. Received: "
                             f"{np.shape(values)} and {np.shape(accumulators)}")
        order = None if strictly_increasing(rows) else np.argsort(rows, kind="stable")
        if order is not None:
            rows = rows[order]
            if not strictly_increasing(rows):
                duplicates = np.unique(rows[1:][np.diff(rows) == 0])
                raise ValueError(f"Rows written in one call must be distinct (which value would win is undefined). "
                                 f"Received duplicates: {duplicates[:10].tolist()}; write each row once")
        records = np.empty((len(rows), self.record_floats), dtype=RECORD_DTYPE)
        values, accumulators = np.asarray(values, dtype=np.float32), np.asarray(accumulators, dtype=np.float32)
        if self.fresh is not None and len(accumulators) and not accumulators.any(axis=1).all():
            raise ValueError(f"{self.path} draws the rows it has never written, which it tells by accumulators of "
                             "all zeros; a row written with all-zero accumulators would read as never written. "
                             "Accumulators start at the optimizer's initial value (> 0) and only grow: check "
                             "what is written")
        records[:, :self.embedding_dim] = values if order is None else values[order]
        records[:, self.embedding_dim:] = accumulators if order is None else accumulators[order]
        if self.log_writes and not page_by_page:
            self.append(rows, records)
            return
        if self.log_length:  # the log would still name older records of these rows: merged first
            self.compact()
        self.mark_data(rows)
        calls = self.transfer(rows, records, reading=False, page_by_page=page_by_page)
        self.count(rows_written=len(rows), bytes_written=records.nbytes, write_calls=calls)

    # --- the log ---------------------------------------------------------------------------------------------

    def append(self, sorted_rows: np.ndarray, records: np.ndarray) -> None:
        """Appends `records` of distinct `sorted_rows` to the log as one block, in one call, and points the rows
        at them. A block: the count of its rows and their ids (int64, zero-padded to whole records), then the
        rows' records in the same order."""
        count = len(sorted_rows)
        if not count:
            return
        id_records = -(-(count + 1) * 8 // self.record_bytes)
        block = np.zeros((id_records + count) * self.record_bytes, dtype=np.uint8)
        block[:(count + 1) * 8].view("<i8")[:] = np.concatenate([[count], sorted_rows])
        block[id_records * self.record_bytes:] = records.view(np.uint8).reshape(-1)
        with self.log_lock:  # one writer at a time takes the next part of the log
            start = self.log_length
            self.log_length += id_records + count
        write_all(self.fd, memoryview(block), HEADER_BYTES + (self.num_rows + start) * self.record_bytes)
        first = self.num_rows + start + id_records
        with self.log_lock:
            self.log_index.set(sorted_rows, np.arange(first, first + count, dtype=np.int64))
            self.rows_appended += count
        self.count(rows_written=count, bytes_written=records.nbytes, write_calls=1, log_appends=1)
        live = len(self.log_index)
        if live > self.log_max_rows or self.log_length > LOG_RECORDS_LIMIT_FACTOR * max(
                live, self.log_compact_min_records):
            self.compact()

    def merge_part(self) -> int:
        """At a flush: once the log holds more than log_compact_min_records records and LOG_GARBAGE_FACTOR times
        its rows, merges the next part of it (`compact` with a budget). Returns the rows merged."""
        if self.log_length <= max(self.log_compact_min_records, LOG_GARBAGE_FACTOR * len(self.log_index)):
            return 0
        return self.compact(max(self.log_merge_min_rows, 2 * self.rows_appended))

    def compact(self, max_rows: int | None = None) -> int:
        """Merges the log into the table: the rows the log holds are written in place from their latest records
        (CREATE_CHUNK_ROWS rows at a time, in row order), made durable, and leave the log's index; once no row
        is left, the log is emptied (its length in the header set to 0 and the file cut back to the table).
        With `max_rows`, at most that many rows are merged, those whose records are oldest. A crash at any point
        leaves a log whose every record still holds its row's values as of its write, and the table agreeing
        with the rows merged, so a reopened store reads the same. Returns the rows merged. Not beside a write."""
        with self.log_lock:
            rows, located = self.log_index.items()
            if not self.log_length:
                return 0
            if max_rows is not None and len(rows) > max_rows:
                oldest = np.argpartition(located, max_rows - 1)[:max_rows]
                rows, located = rows[oldest], located[oldest]
            order = np.argsort(rows)
            rows, located = rows[order], located[order]
            for start in range(0, len(rows), CREATE_CHUNK_ROWS):
                part = slice(start, start + CREATE_CHUNK_ROWS)
                by_record = np.argsort(located[part])
                records = np.empty((len(by_record), self.record_floats), dtype=RECORD_DTYPE)
                ordered = np.empty_like(records)
                self.transfer(located[part][by_record], ordered, reading=True)
                records[by_record] = ordered
                self.mark_data(rows[part])
                self.transfer(rows[part], records, reading=False)
            os.fsync(self.fd)
            self.log_index.remove(rows)
            emptied = not len(self.log_index)
            if emptied:
                write_all(self.fd, LOG_HEADER.pack(LOG_MAGIC, 0), LOG_HEADER_OFFSET)
                os.fsync(self.fd)
                os.ftruncate(self.fd, HEADER_BYTES + self.num_rows * self.record_bytes)
                self.log_length = self.log_committed = 0
                self.log_index = new_row_map(0, native=self.native_index)
        self.count(log_merges=1, log_compactions=int(emptied), rows_compacted=len(rows), fsyncs=1 + int(emptied))
        return len(rows)

    def load_log(self, log_length: int) -> None:
        """Rebuilds the log's index from its blocks' row ids (on open)."""
        record_bytes, position = self.record_bytes, 0
        while position < log_length:
            offset = HEADER_BYTES + (self.num_rows + position) * record_bytes
            count = int(np.frombuffer(os.pread(self.fd, 8, offset), "<i8")[0])
            id_records = -(-(count + 1) * 8 // record_bytes)
            if count <= 0 or position + id_records + count > log_length:
                raise ValueError(f"{self.path}: the log's block at record {position} holds {count} rows, past the "
                                 f"log's {log_length} records. The file was damaged: restore it from its last "
                                 "snapshot")
            ids = np.frombuffer(os.pread(self.fd, count * 8, offset + 8), "<i8")
            first = self.num_rows + position + id_records
            self.log_index.set(ids, np.arange(first, first + count, dtype=np.int64))
            position += id_records + count
        self.log_length = self.log_committed = log_length

    def use_numpy_index(self) -> None:
        """Indexes the log with trainer.row_map.RowMap (numpy) from now on, as on a host where hot_tier.c does not
        build: for comparisons (bench/bench_tier_step.py)."""
        with self.log_lock:
            index = new_row_map(len(self.log_index), native=False)
            if len(self.log_index):
                index.set(*self.log_index.items())
            self.native_index, self.log_index = False, index

    @property
    def log_rows(self) -> int:
        """Rows whose latest values are in the log."""
        return len(self.log_index)

    def transfer(self, sorted_rows: np.ndarray, records: np.ndarray, reading: bool,
                 page_by_page: bool = False) -> int:
        """Reads `sorted_rows` (distinct, ascending) into `records`, or writes `records` to them: one call per run
        of consecutive rows (per page of a run with `page_by_page`), and from BATCHED_MIN_RUNS runs on those calls
        are requests of one io_submit per AIO_BATCH (see BatchedIO).

        With `io_threads` > 1 and from BATCHED_MIN_RUNS runs on, the runs whose pages are in the page cache
        are found first, on this thread, with one batch of non-blocking reads (RWF_NOWAIT: a read that would
        wait for the disk fails at once instead): a read is then done for them, and a write of them is done on
        this thread. The rest, which wait for the disk (a write into a page not cached reads it first), are cut
        into up to `io_threads` parts moved at once, PARALLEL_MIN_MISSES runs a part at least, the last on this
        thread; the call returns once every part is done. Returns the calls (requests) made, each run once."""
        if not len(sorted_rows):
            return 0
        breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
        firsts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(sorted_rows)]])
        if page_by_page or self.io_threads <= 1 or len(firsts) < BATCHED_MIN_RUNS:
            return self.transfer_runs(sorted_rows, firsts, stops, records, reading, page_by_page)
        calls = len(firsts)
        cached = self.cached_runs(sorted_rows, firsts, stops, records if reading else None)
        if cached is None:  # not known: every run is cut across the threads
            cached = np.zeros(len(firsts), dtype=bool)
        if not reading and cached.any():
            self.transfer_runs(sorted_rows, firsts[cached], stops[cached], records, reading=False)
        firsts, stops = firsts[~cached], stops[~cached]
        parts = min(int(self.io_threads), len(firsts) // PARALLEL_MIN_MISSES)
        if parts <= 1:
            if len(firsts):
                self.transfer_runs(sorted_rows, firsts, stops, records, reading)
            return calls
        bounds = np.linspace(0, len(firsts), parts + 1).astype(np.int64).tolist()
        futures: list[Future[int]] = [
            IO_POOL.submit(self.transfer_runs, sorted_rows, firsts[low:high], stops[low:high], records, reading)
            for low, high in zip(bounds[:-2], bounds[1:-1], strict=True)]
        try:
            self.transfer_runs(sorted_rows, firsts[bounds[-2]:], stops[bounds[-2]:], records, reading)
        finally:
            wait(futures)  # no part may still be moving bytes of `records` once this returns, even on an error
        for future in futures:
            future.result()
        return calls

    def cached_runs(self, sorted_rows: np.ndarray, firsts: np.ndarray, stops: np.ndarray,
                    records: np.ndarray | None) -> np.ndarray | None:
        """Which runs are in the page cache (or in holes of the file), by one batch of non-blocking reads on this
        thread: into `records` (those runs are then read), or into a scratch buffer where None. None where the
        system cannot tell (no AIO, or no RWF_NOWAIT)."""
        if not hasattr(os, "RWF_NOWAIT"):
            return None
        target = records if records is not None else np.empty((int(stops[-1]), self.record_floats), RECORD_DTYPE)
        offsets = HEADER_BYTES + sorted_rows[firsts] * self.record_bytes
        sizes = (stops - firsts) * self.record_bytes
        done = BATCHED_IO.transfer(self.fd, AIO_READ, offsets, target.ctypes.data + firsts * self.record_bytes,
                                   sizes, flags=os.RWF_NOWAIT)
        if done is None:
            return None
        cached = done == sizes
        self.count(batched_calls=-(-len(firsts) // AIO_BATCH), cache_probes=len(firsts),
                   cache_hits=int(np.count_nonzero(cached)))
        return cached

    def transfer_runs(self, sorted_rows: np.ndarray, firsts: np.ndarray, stops: np.ndarray, records: np.ndarray,
                      reading: bool, page_by_page: bool = False) -> int:
        """`transfer` of the runs sorted_rows[firsts[k]:stops[k]] (records[firsts[k]:stops[k]]), on this thread."""
        offsets = HEADER_BYTES + sorted_rows[firsts] * self.record_bytes
        buffer = memoryview(records).cast("B")
        begins, ends = (firsts * self.record_bytes).tolist(), (stops * self.record_bytes).tolist()
        pieces: Iterable[int] = range(len(begins))
        if len(firsts) >= BATCHED_MIN_RUNS and not page_by_page:
            sizes = (stops - firsts) * self.record_bytes
            done = BATCHED_IO.transfer(self.fd, AIO_READ if reading else AIO_WRITE, offsets,
                                       records.ctypes.data + firsts * self.record_bytes, sizes)
            if done is not None:
                self.count(batched_calls=-(-len(firsts) // AIO_BATCH))
                pieces = np.flatnonzero(done != sizes).tolist()  # short or failed: again, one call each below
        offsets, calls = offsets.tolist(), len(firsts)
        for piece in pieces:
            begin, end, offset = begins[piece], ends[piece], offsets[piece]
            if reading:
                # The common case, a whole run in one call, without read_all's loop.
                if os.preadv(self.fd, [buffer[begin:end]], offset) != end - begin:
                    read_all(self.fd, buffer[begin:end], offset)
            elif page_by_page:
                calls += write_pages(self.fd, buffer[begin:end], offset) - 1
            elif os.pwritev(self.fd, [buffer[begin:end]], offset) != end - begin:
                write_all(self.fd, buffer[begin:end], offset)
        return calls

    def flush(self) -> None:
        """Makes every write so far durable (fsync): the log's records first, then its length in the header."""
        os.fsync(self.fd)
        self.count(fsyncs=1)
        if self.log_length != self.log_committed:
            length = self.log_length
            write_all(self.fd, LOG_HEADER.pack(LOG_MAGIC, length), LOG_HEADER_OFFSET)
            os.fsync(self.fd)
            self.log_committed = length
            self.count(fsyncs=1)
        if self.writable and self.log_writes:
            self.merge_part()
        self.rows_appended = 0

    def snapshot(self, destination: Path | str) -> str:
        """Flushes, then copies the store to `destination` (renamed into place once complete and fsynced), and
        returns how: "reflink", "copy_file_range" or "copy".

        A reflink (FICLONE: btrfs, XFS, bcachefs) shares the file's blocks copy-on-write, so a snapshot of a
        100 GB table is instant and costs no space until the live store is written; elsewhere (ext4)
        copy_file_range copies inside the kernel, and without it the copy goes through a buffer of
        COPY_CHUNK_BYTES. None of them holds the table in memory. A hard link would cost nothing, and be wrong:
        both names would be one inode, and the live store's next in-place write would change the snapshot too.
        Call it between steps: a write during the copy could land in the snapshot or not.
        """
        self.flush()
        destination = Path(destination)
        partial = destination.with_name(f".{destination.name}.{uuid.uuid4().hex}.partial")
        target = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        size = os.fstat(self.fd).st_size
        try:
            method = copy_file(self.fd, target, size)
            os.fsync(target)
        except BaseException:
            os.close(target)
            partial.unlink(missing_ok=True)
            raise
        os.close(target)
        os.replace(partial, destination)
        fsync_directory(destination.parent)
        self.count(snapshots=1, snapshot_bytes=size)
        return method

    # --- bookkeeping -----------------------------------------------------------------------------------------

    @property
    def counters(self) -> StoreCounters:
        with self._lock:
            return self._counters

    def count(self, **increments: int) -> None:
        with self._lock:
            self._counters = replace(self._counters, **{name: getattr(self._counters, name) + value
                                                        for name, value in increments.items()})

    def offset(self, row: int) -> int:
        return HEADER_BYTES + row * self.record_bytes

    def check_rows(self, rows: np.ndarray) -> np.ndarray:
        """`rows` as a flat int64 array, after checking every id is in [0, num_rows)."""
        rows = np.asarray(rows)
        if rows.size and not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"Row ids must be integers. Received: dtype {rows.dtype}")
        rows = rows.astype(np.int64, copy=False).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            outside = rows[(rows < 0) | (rows >= self.num_rows)]
            raise ValueError(f"Row ids must be in [0, {self.num_rows}) for {self.path}. Received: "
                             f"{np.unique(outside)[:10].tolist()}; check the ids against the table's size")
        return rows


class BatchedIO:
    """Many preads or pwrites at scattered offsets in one system call: Linux's native AIO (io_setup, io_submit,
    io_getevents) through ctypes.

    On a file opened without O_DIRECT, as a store is, the kernel performs each request inside io_submit,
    synchronously, exactly as pread or pwrite would: the work per row is the same. What a batch saves is the
    system call per row and, above all, releasing and retaking Python's GIL per row: a thread that retakes it
    while another (the training loop) holds it waits, so a prefetching thread issuing a call per row ran at
    the pace of the training thread's Python. ctypes releases the GIL once around each io_submit.

    Contexts are pooled (one per thread doing I/O at once, created as needed, kept for the process: the kernel
    frees them at exit). Where AIO is missing (not Linux, another machine, a sandbox that forbids it) `transfer`
    returns None and the store makes a call per run.
    """

    def __init__(self) -> None:
        self.syscalls = AIO_SYSCALLS.get(platform.machine()) if sys.platform == "linux" else None
        self.available = self.syscalls is not None and sys.byteorder == "little"
        self.free_contexts: list[int] = []
        self.lock = threading.Lock()
        self.syscall: Any = None  # libc's syscall(2), a ctypes function
        if self.available:
            self.syscall = ctypes.CDLL(None, use_errno=True).syscall
            self.syscall.restype = ctypes.c_long

    def context(self) -> int | None:
        with self.lock:
            if self.free_contexts:
                return self.free_contexts.pop()
        context = ctypes.c_ulong(0)
        if self.syscall(ctypes.c_long(self.syscalls[0]), ctypes.c_uint(AIO_BATCH), ctypes.byref(context)) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EINVAL):  # for good, not for now (EAGAIN)
                self.available = False
            return None
        return context.value

    def transfer(self, fd: int, opcode: int, offsets: np.ndarray, addresses: np.ndarray,
                 sizes: np.ndarray, flags: int = 0) -> np.ndarray | None:
        """Reads (AIO_READ) `sizes[k]` bytes at `offsets[k]` of `fd` into memory at `addresses[k]`, or writes
        them (AIO_WRITE), for every k, with `flags` (RWF_NOWAIT: fail with EAGAIN where it would wait for the
        disk). Returns the bytes each request moved (a negative errno where it failed, -1 where it was not
        submitted; the caller does those again with a call each), or None without AIO."""
        if not self.available:
            return None
        context = self.context()
        if context is None:
            return None
        count, usable = len(offsets), True
        iocbs = np.zeros(count, dtype=IOCB)
        iocbs["data"] = np.arange(count)
        iocbs["opcode"], iocbs["fildes"], iocbs["rw_flags"] = opcode, fd, flags  # flags: RWF_*, per request
        iocbs["buf"], iocbs["nbytes"], iocbs["offset"] = addresses, sizes, offsets
        pointers = (iocbs.ctypes.data + np.arange(count, dtype=np.uint64) * IOCB.itemsize).astype(np.uint64)
        events = np.zeros(AIO_BATCH, dtype=IO_EVENT)
        done = np.full(count, -1, dtype=np.int64)
        try:
            for start in range(0, count, AIO_BATCH):
                batch = min(AIO_BATCH, count - start)
                submitted = self.syscall(ctypes.c_long(self.syscalls[3]), ctypes.c_ulong(context),
                                         ctypes.c_long(batch), ctypes.c_void_p(pointers.ctypes.data + 8 * start))
                if submitted < 0 and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                    usable = False  # e.g. a context inherited through fork: not this process's; drop it
                reaped = 0
                while reaped < max(submitted, 0):
                    got = self.syscall(ctypes.c_long(self.syscalls[2]), ctypes.c_ulong(context),
                                       ctypes.c_long(submitted - reaped), ctypes.c_long(submitted - reaped),
                                       ctypes.c_void_p(events.ctypes.data), None)
                    if got < 0:
                        if ctypes.get_errno() == errno.EINTR:
                            continue
                        usable = False
                        raise OSError(ctypes.get_errno(), "io_getevents failed after io_submit; the store's state "
                                      "is unknown: restore it from its last snapshot")
                    done[events["data"][:got].astype(np.intp)] = events["res"][:got]
                    reaped += got
                if submitted < batch:  # the rest were not submitted: they are done a call each
                    break
        finally:
            if usable:
                with self.lock:
                    self.free_contexts.append(context)
            else:
                self.syscall(ctypes.c_long(self.syscalls[1]), ctypes.c_ulong(context))
        return done


BATCHED_IO = BatchedIO()


class IOPool:
    """The threads stores cut their large reads and writes across (RowStore.transfer), and a hot tier writes
    behind on (trainer/hot_tier.py): one pool per process, started on first use and made anew in a forked child
    (a pool's threads do not survive a fork)."""

    def __init__(self, max_workers: int = 64) -> None:
        self.max_workers = max_workers
        self.lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None

    def submit(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        with self.lock:
            if self.executor is None:
                self.executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="row-store-io")
            return self.executor.submit(function, *args)

    def after_fork(self) -> None:
        self.lock = threading.Lock()
        self.executor = None


IO_POOL = IOPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=IO_POOL.after_fork)


class RowOverlay:
    """Newer values of some rows of a table than its store holds: the rows ascending, with an array per field
    (`values`, and `accumulators` where kept). `update` merges newer rows in (a row given again takes the newer
    values); `apply` writes them over what was read from the store. A minute's overlays read over the daily
    store (trainer/tiered_tables.py ChainRows), and a served model's delta rows (serving/row_cache.py)."""

    def __init__(self) -> None:
        self.rows = np.zeros(0, np.int64)
        self.arrays: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def update(self, rows: np.ndarray, **arrays: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        if not self.arrays:
            self.arrays = {name: np.asarray(value, np.float32)[:0] for name, value in arrays.items()}
        keep = ~np.isin(self.rows, rows)
        merged_rows = np.concatenate([self.rows[keep], rows])
        order = np.argsort(merged_rows, kind="stable")
        self.rows = merged_rows[order]
        self.arrays = {name: np.concatenate([self.arrays[name][keep], np.asarray(arrays[name], np.float32)])[order]
                       for name in self.arrays}

    @classmethod
    def merged(cls, parts: Iterable[tuple[np.ndarray, Mapping[str, np.ndarray]]]) -> RowOverlay:
        """The overlay of `parts` ((rows, {field: array}), oldest first; a later part's row wins), merged in one
        sort: `update` part by part re-sorts everything kept so far each time, which over a day of minutes'
        overlays is quadratic."""
        parts = list(parts)
        overlay = cls()
        if not parts:
            return overlay
        rows = np.concatenate([np.asarray(part_rows, np.int64) for part_rows, _ in parts])
        names = list(parts[0][1])
        arrays = {name: np.concatenate([np.asarray(fields[name], np.float32) for _, fields in parts])
                  for name in names}
        # By row, then by position: the last of each row's run is its newest value.
        order = np.lexsort((np.arange(len(rows)), rows))
        sorted_rows = rows[order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = sorted_rows[1:] != sorted_rows[:-1]
        overlay.rows = sorted_rows[last]
        overlay.arrays = {name: array[order[last]] for name, array in arrays.items()}
        return overlay

    def apply(self, rows: np.ndarray, **arrays: np.ndarray) -> None:
        """Writes the overlay's rows among `rows` into `arrays` (each [len(rows), ...], read from the store)."""
        if not len(self.rows) or not len(rows):
            return
        found = np.searchsorted(self.rows, rows).clip(0, len(self.rows) - 1)
        hit = self.rows[found] == rows
        for name, target in arrays.items():
            target[hit] = self.arrays[name][found[hit]]


@dataclass(frozen=True)
class UniformRows:
    """Rows uniform in [minval, maxval) (Keras' "uniform" default range), each value a function of (seed, row id,
    column) alone: a counter-based hash (splitmix64's mix of seed and position), so any rows are drawn without
    their neighbours, the table is the same whatever chunks ask for it, and a store can draw a row when it is
    first read instead of writing it when it is made (`RowStore.create`). Called as (start, stop) for a range
    of rows, or `rows(ids)` for any.

    `zero_columns`: the last columns of each row are zeros (a linear part's weight, trainer/tiered_tables.py);
    the others are drawn as the rows of a table of `embedding_dim - zero_columns` columns would be."""

    embedding_dim: int
    seed: int
    minval: float = -0.05
    maxval: float = 0.05
    zero_columns: int = 0

    def __call__(self, start: int, stop: int) -> np.ndarray:
        return self.rows(np.arange(start, stop, dtype=np.int64))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), embedding_dim]: the rows `ids`."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        key = np.uint64(mix64((self.seed * GOLDEN_GAMMA) & UINT64_MASK))
        drawn = self.embedding_dim - self.zero_columns
        positions = ids.astype(np.uint64)[:, None] * np.uint64(drawn) + np.arange(drawn, dtype=np.uint64)
        bits = mix64_array((positions + np.uint64(1)) * np.uint64(GOLDEN_GAMMA) ^ key)
        unit = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)  # [0, 1), 24 bits: exact
        values = (np.float32(self.minval) + unit * np.float32(self.maxval - self.minval)).astype(np.float32)
        if self.zero_columns:
            values = np.concatenate([values, np.zeros((len(ids), self.zero_columns), np.float32)], axis=1)
        return values


def mix64(value: int) -> int:
    """splitmix64's finaliser on one 64-bit integer."""
    value ^= value >> 30
    value = (value * MIX_MULTIPLIERS[0]) & UINT64_MASK
    value ^= value >> 27
    value = (value * MIX_MULTIPLIERS[1]) & UINT64_MASK
    return value ^ (value >> 31)


def mix64_array(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (products wrap modulo 2**64, as the hash means them to)."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(MIX_MULTIPLIERS[0])
    values ^= values >> np.uint64(27)
    values *= np.uint64(MIX_MULTIPLIERS[1])
    values ^= values >> np.uint64(31)
    return values


def uniform_initializer(embedding_dim: int, seed: int, minval: float = -0.05,
                        maxval: float = 0.05, zero_columns: int = 0) -> UniformRows:
    """Rows uniform in [minval, maxval), each a function of (seed, row id) alone (UniformRows); the last
    `zero_columns` columns zeros."""
    if not 0 <= zero_columns < embedding_dim:
        raise ValueError(f"`zero_columns` must be in [0, embedding_dim={embedding_dim}). Received: {zero_columns}")
    return UniformRows(int(embedding_dim), int(seed), float(minval), float(maxval), int(zero_columns))


def strictly_increasing(rows: np.ndarray) -> bool:
    return len(rows) < 2 or bool(np.all(rows[1:] > rows[:-1]))


def consecutive_runs(sorted_rows: np.ndarray) -> list[tuple[int, int]]:
    """[begin, end) positions of the runs of consecutive ids in sorted, distinct `sorted_rows`."""
    if not len(sorted_rows):
        return []
    breaks = (np.flatnonzero(np.diff(sorted_rows) != 1) + 1).tolist()
    return list(zip([0, *breaks], [*breaks, len(sorted_rows)], strict=True))


def read_all(fd: int, buffer: memoryview, offset: int) -> None:
    """Fills `buffer` from `offset`, looping over short reads."""
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count == 0:
            raise OSError(errno.EIO, f"The store ended at byte {offset + done} while reading {len(buffer)} bytes "
                                     f"from {offset}: it is truncated; restore it from its last snapshot")
        done += count


def write_pages(fd: int, data: memoryview, offset: int) -> int:
    """Writes `data` at `offset` a page (PAGE_BYTES, aligned in the file) per call; returns the calls."""
    done, calls = 0, 0
    while done < len(data):
        end = min(len(data), done + PAGE_BYTES - (offset + done) % PAGE_BYTES)
        write_all(fd, data[done:end], offset + done)
        done, calls = end, calls + 1
    return calls


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Writes all of `data` at `offset`, looping over short writes."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)


def copy_file(source: int, target: int, size: int) -> str:
    """Copies `size` bytes of `source` into the empty `target`: a reflink where the filesystem can, else
    copy_file_range, else through a bounded buffer. Returns which."""
    try:
        fcntl.ioctl(target, FICLONE, source)
        return "reflink"
    except OSError as error:  # EOPNOTSUPP, EXDEV, EINVAL or ENOTTY: this filesystem (or pair) cannot reflink
        if error.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS):
            raise
    os.ftruncate(target, size)  # the holes of `source` (rows never written) stay holes: only data is copied
    segments = data_segments(source, size)
    try:
        for begin, end in segments:
            done = begin
            while done < end:
                count = os.copy_file_range(source, target, end - done, done, done)
                if count == 0:
                    raise OSError(errno.EIO, f"copy_file_range stopped at byte {done} of {size}")
                done += count
        return "copy_file_range"
    except OSError as error:  # EXDEV across filesystems on old kernels, ENOSYS/EINVAL where unsupported
        if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    for begin, end in segments:
        done = begin
        while done < end:
            chunk = os.pread(source, min(COPY_CHUNK_BYTES, end - done), done)
            write_all(target, chunk, done)
            done += len(chunk)
    return "copy"


def data_segments(fd: int, size: int) -> list[tuple[int, int]]:
    """The [begin, end) byte ranges of `fd`'s first `size` bytes that hold data (SEEK_DATA / SEEK_HOLE); the whole
    file where the system cannot tell."""
    if not hasattr(os, "SEEK_DATA"):
        return [(0, size)]
    segments, position = [], 0
    try:
        while position < size:
            try:
                begin = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as error:
                if error.errno == errno.ENXIO:  # no data after `position`
                    break
                raise
            end = min(size, os.lseek(fd, begin, os.SEEK_HOLE))
            if begin >= size:
                break
            segments.append((begin, end))
            position = end
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return [(0, size)]
        raise
    return segments


def fsync_directory(directory: Path) -> None:
    """Makes a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

