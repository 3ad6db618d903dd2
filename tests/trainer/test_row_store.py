import errno
import os
import re
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from trainer.row_store import (
    AIO_BATCH,
    BATCHED_IO,
    BATCHED_MIN_RUNS,
    HEADER_BYTES,
    LOG_HEADER_OFFSET,
    RowOverlay,
    RowStore,
    StoreCounters,
    consecutive_runs,
    uniform_initializer,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def table(num_rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    values = np.arange(num_rows * dim, dtype=np.float32).reshape(num_rows, dim)
    return values, -values - 0.5


def test_rows_read_back_as_written_in_any_order_with_duplicates(tmp_path):
    values, accumulators = table(10, 3)
    with RowStore.from_arrays(tmp_path / "t.rows", values, accumulators, chunk_rows=4) as store:
        got_values, got_accumulators = store.read(np.array([7, 2, 7, 0, 9]))
        np.testing.assert_array_equal(got_values, values[[7, 2, 7, 0, 9]])
        np.testing.assert_array_equal(got_accumulators, accumulators[[7, 2, 7, 0, 9]])
        store.write(np.array([5, 1]), np.full((2, 3), 100.0), np.full((2, 3), 200.0))
        got_values, got_accumulators = store.read(np.arange(10))
    expected = values.copy()
    expected[[1, 5]] = 100.0
    np.testing.assert_array_equal(got_values, expected)
    with RowStore.open(tmp_path / "t.rows", writable=False) as reopened:
        assert (reopened.num_rows, reopened.embedding_dim) == (10, 3)
        np.testing.assert_array_equal(reopened.read(np.array([5]))[1], [[200.0, 200.0, 200.0]])
        np.testing.assert_array_equal(reopened.read(np.array([4]))[0], values[[4]])
    # The layout is the documented one: header, then records of values then accumulator, float32 little-endian;
    # then the log: a block of the write's row count and ids (int64, padded to whole records: 24 bytes here, one
    # record), then their records; its length in records (3) in the header.
    raw = (tmp_path / "t.rows").read_bytes()
    assert len(raw) == HEADER_BYTES + 10 * 6 * 4 + 3 * 6 * 4
    np.testing.assert_array_equal(np.frombuffer(raw[HEADER_BYTES + 4 * 24:HEADER_BYTES + 5 * 24], "<f4"),
                                  [12, 13, 14, -12.5, -13.5, -14.5])
    log = HEADER_BYTES + 10 * 24
    np.testing.assert_array_equal(np.frombuffer(raw[log:log + 24], "<i8"), [2, 1, 5])
    np.testing.assert_array_equal(np.frombuffer(raw[log + 24:], "<f4"), [100] * 3 + [200] * 3 + [100] * 3 + [200] * 3)
    assert raw[LOG_HEADER_OFFSET:LOG_HEADER_OFFSET + 16] == b"CTRLOG01" + (3).to_bytes(8, "little")


def test_create_calls_the_initializer_by_chunks_and_fills_the_accumulator(tmp_path):
    calls = []

    def rows(start, stop):
        calls.append((start, stop))
        return np.arange(start, stop, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)

    with RowStore.create(tmp_path / "t.rows", 10, 2, rows, initial_accumulator=0.25, chunk_rows=4) as store:
        values, accumulators = store.read(np.arange(10))
    assert calls == [(0, 4), (4, 8), (8, 10)]
    np.testing.assert_array_equal(values[:, 0], np.arange(10))
    assert np.all(accumulators == 0.25)


def test_the_uniform_initializer_gives_the_same_rows_whatever_the_chunks(tmp_path):
    initializer = uniform_initializer(4, seed=7)
    # Written at creation a chunk at a time (a plain function: the initializer called by ranges), and drawn when
    # read (the initializer itself: a store of format 2).
    big = RowStore.create(tmp_path / "a.rows", 9000, 4, lambda a, b: initializer(a, b), initial_accumulator=0.1,
                          chunk_rows=9000)
    small = RowStore.create(tmp_path / "b.rows", 9000, 4, lambda a, b: initializer(a, b), initial_accumulator=0.1,
                            chunk_rows=777)
    drawn = RowStore.create(tmp_path / "d.rows", 9000, 4, initializer, initial_accumulator=0.1)
    rows = np.array([0, 4095, 4096, 5000, 8999])
    np.testing.assert_array_equal(big.read(rows)[0], small.read(rows)[0])
    np.testing.assert_array_equal(drawn.read(rows[::-1])[0], big.read(rows[::-1])[0])
    np.testing.assert_array_equal(initializer.rows(rows), big.read(rows)[0])
    values = big.read(np.arange(9000))[0]
    np.testing.assert_array_equal(drawn.read(np.arange(9000))[0], values)
    # Uniform and independent: mean and spread of U(-0.05, 0.05), neighbouring columns and rows uncorrelated.
    assert abs(values.mean()) < 0.001 and abs(values.std() - 0.1 / 12 ** 0.5) < 0.001
    assert abs(np.corrcoef(values[:, 0], values[:, 1])[0, 1]) < 0.05
    assert abs(np.corrcoef(values[:-1, 0], values[1:, 0])[0, 1]) < 0.05
    assert -0.05 <= values.min() < -0.049 and 0.049 < values.max() < 0.05
    other_seed = RowStore.create(tmp_path / "c.rows", 10, 4, uniform_initializer(4, seed=8), initial_accumulator=0.1)
    assert not np.array_equal(other_seed.read(np.arange(10))[0], values[:10])


def test_a_store_from_the_uniform_initializer_draws_each_row_until_it_is_first_written(tmp_path):
    num_rows, dim = 4_000_000, 8  # 256 MB of records
    initializer = uniform_initializer(dim, seed=3)
    store = RowStore.create(tmp_path / "t.rows", num_rows, dim, initializer, initial_accumulator=0.1)
    assert os.path.getsize(tmp_path / "t.rows") == HEADER_BYTES + num_rows * dim * 8
    assert os.stat(tmp_path / "t.rows").st_blocks * 512 <= 64 << 10  # nothing written but the header
    rows = np.array([3_999_999, 0, 12, 13, 2_000_000])
    values, accumulators = store.read(rows)
    np.testing.assert_array_equal(values, initializer.rows(rows))
    assert (accumulators == np.float32(0.1)).all()
    assert store.counters.rows_fresh == 5
    store.write(np.array([12, 2_000_000]), np.full((2, dim), 7.0), np.full((2, dim), 0.5))
    values, accumulators = store.read(rows)
    np.testing.assert_array_equal(values[[2, 4]], np.full((2, dim), 7.0))
    np.testing.assert_array_equal(values[[0, 1, 3]], initializer.rows(rows[[0, 1, 3]]))  # 13 shares 12's page
    np.testing.assert_array_equal(accumulators[:, 0], np.float32([0.1, 0.1, 0.5, 0.1, 0.5]))
    assert store.counters.rows_fresh == 5 + 3
    # A snapshot keeps the holes and the header: the same rows, drawn or written, from a few pages of disk.
    store.snapshot(tmp_path / "snap.rows")
    assert os.stat(tmp_path / "snap.rows").st_blocks * 512 <= 64 << 10
    with RowStore.open(tmp_path / "snap.rows", writable=False) as snapshot:
        assert snapshot.fresh == initializer
        np.testing.assert_array_equal(snapshot.read(rows)[0], values)
        np.testing.assert_array_equal(snapshot.read(rows)[1], accumulators)
    # All-zero accumulators are what marks a row never written: such a write is refused, nothing written.
    with pytest.raises(ValueError, match="all-zero accumulators would read as never written"):
        store.write(np.array([13, 14]), np.ones((2, dim)), np.array([[0.2] * dim, [0.0] * dim]))
    np.testing.assert_array_equal(store.read(np.array([13]))[0], initializer.rows(np.array([13])))
    with pytest.raises(ValueError, match="needs initial_accumulator > 0"):
        RowStore.create(tmp_path / "u.rows", 10, dim, initializer, initial_accumulator=0.0)
    assert not list(tmp_path.glob("*u.rows*"))


def test_a_snapshot_is_independent_of_the_live_store(tmp_path):
    values, accumulators = table(50, 4)
    live = RowStore.from_arrays(tmp_path / "live.rows", values, accumulators)
    method = live.snapshot(tmp_path / "snap.rows")
    assert method in ("reflink", "copy_file_range", "copy")
    live.write(np.array([3, 40]), np.full((2, 4), 9.0), np.full((2, 4), 8.0))
    live.flush()
    assert os.stat(tmp_path / "live.rows").st_ino != os.stat(tmp_path / "snap.rows").st_ino  # not a hard link
    with RowStore.open(tmp_path / "snap.rows", writable=False) as snapshot:
        np.testing.assert_array_equal(snapshot.read(np.arange(50))[0], values)
        np.testing.assert_array_equal(snapshot.read(np.arange(50))[1], accumulators)
    np.testing.assert_array_equal(live.read(np.array([3]))[0], [[9.0] * 4])
    assert not list(tmp_path.glob(".*partial*"))
    assert live.counters.snapshots == 1 and live.counters.snapshot_bytes == HEADER_BYTES + 50 * 8 * 4


def test_counters_count_distinct_rows_bytes_and_one_call_per_run_of_consecutive_rows(tmp_path):
    values, accumulators = table(100, 4)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators, chunk_rows=64)
    store.log_writes = False  # writes in place, as creation and the log's merge do
    # Creation counts too: 100 rows of 32 bytes in two chunks of 64 rows, one call each.
    assert store.counters == StoreCounters(rows_written=100, bytes_written=3200, write_calls=2)
    store.read(np.array([5, 6, 7, 7, 20, 90, 91]))  # runs 5-7, 20, 90-91: 6 distinct rows, 3 calls
    store.write(np.array([11, 10, 50]), np.zeros((3, 4)), np.zeros((3, 4)))  # runs 10-11, 50: 2 calls
    store.flush()
    assert store.counters == StoreCounters(rows_read=6, bytes_read=6 * 32, read_calls=3, rows_written=103,
                                           bytes_written=3296, write_calls=4, fsyncs=1)
    assert consecutive_runs(np.array([1, 2, 3, 8, 10, 11])) == [(0, 3), (3, 4), (4, 6)]


def test_creation_writes_a_page_per_call(tmp_path):
    # 300 records of 32 bytes from byte 4096: pages of 4096, 4096 and 1408 bytes.
    store = RowStore.from_arrays(tmp_path / "t.rows", *table(300, 4))
    assert (store.counters.write_calls, store.counters.bytes_written) == (3, 9600)
    # Other writes are a call per run, however long.
    store.write(np.arange(300), *table(300, 4))
    assert store.counters.write_calls == 4


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("io_threads", [1, 8])
def test_many_scattered_rows_are_read_and_written_in_batches_or_a_call_each(tmp_path, monkeypatch, batched,
                                                                             io_threads):
    if not batched:
        monkeypatch.setattr(BATCHED_IO, "available", False)
    values, accumulators = table(3000, 4)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators, chunk_rows=4096)
    store.io_threads = io_threads
    store.log_writes = False  # writes in place, as creation and the log's merge do
    before = store.counters
    rows = np.random.default_rng(0).permutation(3000)[:2 * AIO_BATCH + 7]  # 519 rows, about 430 runs
    runs = len(consecutive_runs(np.sort(rows)))
    assert runs > AIO_BATCH and BATCHED_MIN_RUNS < runs
    got_values, got_accumulators = store.read(rows)
    np.testing.assert_array_equal(got_values, values[rows])
    np.testing.assert_array_equal(got_accumulators, accumulators[rows])
    store.write(rows, -values[rows], values[rows])
    values[rows], accumulators[rows] = -values[rows], values[rows]
    np.testing.assert_array_equal(store.read(np.arange(3000))[0], values)
    np.testing.assert_array_equal(store.read(np.arange(3000))[1], accumulators)
    counters = store.counters
    # A request per run; the two reads of the whole table are one run each.
    assert (counters.read_calls - before.read_calls, counters.write_calls - before.write_calls) == (runs + 2, runs)
    # Batches of AIO_BATCH runs or fewer: on one thread, one for the read and one for the write; with threads,
    # the rows just written are in the page cache, so the read is the non-blocking try, and the write is that
    # try (into scratch) and then the write on the calling thread; none where AIO is missing.
    batches = -(-runs // AIO_BATCH)
    expected = (2 * batches if io_threads == 1 else 3 * batches) if BATCHED_IO.available else 0
    assert counters.batched_calls - before.batched_calls == expected
    if BATCHED_IO.available and io_threads > 1:
        assert counters.cache_probes - before.cache_probes == 2 * runs
        assert counters.cache_hits - before.cache_hits == 2 * runs


@pytest.mark.skipif(not BATCHED_IO.available, reason="no Linux AIO here: the parts are seen through it")
def test_a_read_or_write_of_many_runs_is_cut_across_threads_and_moves_the_same_bytes(tmp_path, monkeypatch):
    values, accumulators = table(20_000, 4)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators)
    rows = np.random.default_rng(1).choice(20_000, 3000, replace=False)
    store.log_writes = False  # writes in place, as creation and the log's merge do
    threads = []
    transfer = BATCHED_IO.transfer

    def recorded(*args, **options):
        threads.append(threading.current_thread().name)
        return transfer(*args, **options)

    monkeypatch.setattr(BATCHED_IO, "transfer", recorded)
    store.io_threads = 8
    os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: every run waits for disk
    got_values, got_accumulators = store.read(rows)
    if store.counters.cache_hits:
        pytest.skip("this filesystem kept the file's pages in memory (tmpfs?): no read waits for the disk")
    # The non-blocking try on the calling thread (one batch: every run misses), then 8 parts, a batch each: the
    # last on the calling thread, the others on the pool's threads.
    me = threading.current_thread().name
    assert len(threads) == 1 + 8 and threads[0] == me and threads.count(me) == 2
    assert all(name.startswith("row-store-io") for name in threads if name != me)
    np.testing.assert_array_equal(got_values, values[rows])
    np.testing.assert_array_equal(got_accumulators, accumulators[rows])
    os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    store.write(rows, got_values + 1, got_accumulators * 2)  # pages not cached: the try, then 8 parts
    assert len(threads) == 18
    store.write(rows, got_values + 1, got_accumulators * 2)  # now cached: the try, then one batch on this thread
    assert threads[18:] == [me, me]
    monkeypatch.undo()
    store.io_threads = 1
    np.testing.assert_array_equal(store.read(np.arange(20_000))[0][rows], values[rows] + 1)
    np.testing.assert_array_equal(store.read(rows)[1], accumulators[rows] * 2)
    untouched = np.setdiff1d(np.arange(20_000), rows)
    np.testing.assert_array_equal(store.read(untouched)[0], values[untouched])


def test_a_part_that_fails_fails_the_call_after_every_part_is_done(tmp_path):
    store = RowStore.from_arrays(tmp_path / "t.rows", *table(20_000, 4))
    store.io_threads = 8
    write_only = os.open(tmp_path / "t.rows", os.O_WRONLY)
    readable, store.fd = store.fd, write_only  # every read of every part fails: EBADF
    try:
        with pytest.raises(OSError) as failure:
            store.read(np.arange(0, 20_000, 7))
        assert failure.value.errno == errno.EBADF
    finally:
        store.fd = readable
        os.close(write_only)
    np.testing.assert_array_equal(store.read(np.arange(0, 20_000, 7))[0], table(20_000, 4)[0][::7])


FORKED_READ = """
import os, select, signal, sys
import numpy as np
from trainer.row_store import RowStore

store = RowStore.open(sys.argv[1])
values = np.repeat(np.arange(20_000, dtype=np.float32)[:, None], 4, axis=1)
rows = np.arange(0, 20_000, 3)
# Two parts, one of them on the pool: the parent's pool starts a thread, which is idle once the read is done.
store.io_threads = 2
os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # so that the reads wait for the disk: in parts
assert np.array_equal(store.read(rows)[0], values[rows])
reader, writer = os.pipe()
pid = os.fork()
if pid == 0:  # the child: a read cut in two; the parent's idle thread is not in the child, so a pool carried
    # over (it counts that thread as idle) would queue the part for no thread, and the read would hang
    try:
        os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.write(writer, b"1" if np.array_equal(store.read(rows)[0], values[rows]) else b"0")
    finally:
        os._exit(0)
os.close(writer)
ready, _, _ = select.select([reader], [], [], 30)
answer = os.read(reader, 1) if ready else b"hung"
if not ready:
    os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
print(answer.decode())
"""


def test_a_forked_child_reads_across_threads_of_its_own(tmp_path):
    # In an interpreter of its own: this one runs other libraries' threads (JAX, TensorFlow), and forking beside
    # them is what this test must not depend on.
    values = np.repeat(np.arange(20_000, dtype=np.float32)[:, None], 4, axis=1)
    RowStore.from_arrays(tmp_path / "t.rows", values, values + 1).close()
    done = subprocess.run([sys.executable, "-c", FORKED_READ, str(tmp_path / "t.rows")], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1"


@pytest.mark.skipif(not BATCHED_IO.available, reason="no Linux AIO here: every request is a call already")
def test_requests_a_batch_did_not_complete_are_done_again_a_call_each(tmp_path, monkeypatch):
    values, accumulators = table(1000, 2)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators)
    rows = np.arange(0, 1000, 5)  # 200 runs of one row
    store.log_writes = False  # writes in place, as creation and the log's merge do
    transfer = BATCHED_IO.transfer

    def half_done(fd, opcode, offsets, addresses, sizes, flags=0):  # the odd requests go through; the even fail
        done = np.full(len(offsets), -errno.EIO, dtype=np.int64)
        done[1::2] = transfer(fd, opcode, offsets[1::2], addresses[1::2], sizes[1::2], flags)
        return done

    monkeypatch.setattr(BATCHED_IO, "transfer", half_done)
    np.testing.assert_array_equal(store.read(rows)[0], values[rows])
    store.write(rows, np.full((200, 2), 7.0), np.full((200, 2), 8.0))
    monkeypatch.undo()
    assert (store.read(rows)[0] == 7.0).all() and (store.read(rows)[1] == 8.0).all()
    assert store.counters.read_calls == 3 * 200  # requests: the ones done twice are counted once


def test_creating_and_scanning_a_table_holds_a_chunk_not_the_table(tmp_path):
    num_rows, dim, chunk = 200_000, 8, 2_000  # 12.8 MB of table, chunks of 128 KB
    tracemalloc.start()
    store = RowStore.create(tmp_path / "t.rows", num_rows, dim, uniform_initializer(dim, seed=1),
                            initial_accumulator=0.1, chunk_rows=chunk)
    for start in range(0, num_rows, chunk):
        store.read(np.arange(start, start + chunk))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert os.path.getsize(tmp_path / "t.rows") == HEADER_BYTES + num_rows * dim * 8
    assert peak < 2 << 20, peak  # a few chunks' worth; the table is 12.8 MB


def test_bad_rows_and_files_are_refused_with_the_value(tmp_path):
    store = RowStore.from_arrays(tmp_path / "t.rows", *table(5, 2))
    with pytest.raises(ValueError, match=re.escape("Row ids must be in [0, 5)") + r".*\[-1, 5\]"):
        store.read(np.array([0, 5, -1]))
    with pytest.raises(ValueError, match=r"distinct.*Received duplicates: \[2\]"):
        store.write(np.array([2, 2]), np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match=re.escape("shape (1, 2). Received: (1, 3) and (1, 2)")):
        store.write(np.array([1]), np.zeros((1, 3)), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="opened read-only"):
        RowStore.open(tmp_path / "t.rows", writable=False).write(np.array([1]), np.zeros((1, 2)), np.zeros((1, 2)))
    (tmp_path / "other").write_bytes(b"not a store at all")
    with pytest.raises(ValueError, match=re.escape("is not a row store: its first bytes are b'not a st'")):
        RowStore.open(tmp_path / "other")
    with open(tmp_path / "t.rows", "r+b") as file:
        file.truncate(HEADER_BYTES + 10)
    with pytest.raises(ValueError, match=f"holds {HEADER_BYTES + 10} bytes; a store of 5 rows"):
        RowStore.open(tmp_path / "t.rows")
    with pytest.raises(ValueError, match=r"\[stop - start, embedding_dim\] = \[3, 2\].*shape \(3, 4\)"):
        RowStore.create(tmp_path / "u.rows", 3, 2, lambda a, b: np.zeros((b - a, 4)), initial_accumulator=0.1)
    assert not (tmp_path / "u.rows").exists() and not list(tmp_path.glob(".u.rows*"))  # nothing half made
    with pytest.raises(ValueError, match=re.escape("num_rows=0")):
        RowStore.create(tmp_path / "v.rows", 0, 2, lambda a, b: None, initial_accumulator=0.1)


def test_an_overlay_merged_in_one_sort_equals_one_updated_part_by_part():
    rng = np.random.default_rng(5)
    parts = []
    for size in (40, 0, 25, 60, 1):
        rows = np.sort(rng.choice(200, size, replace=False))
        parts.append((rows, {"values": rng.normal(size=(size, 3)).astype(np.float32),
                             "accumulators": rng.uniform(size=(size, 3)).astype(np.float32)}))
    stepwise = RowOverlay()
    for rows, fields in parts:
        stepwise.update(rows, **fields)
    merged = RowOverlay.merged(parts)
    np.testing.assert_array_equal(merged.rows, stepwise.rows)
    for name in ("values", "accumulators"):
        np.testing.assert_array_equal(merged.arrays[name], stepwise.arrays[name])
    # A row given again takes its newest values: the last part's row 0 over the first's.
    newest = RowOverlay.merged([(np.array([0, 5]), {"values": np.ones((2, 1))}),
                                (np.array([0]), {"values": np.full((1, 1), 7.0)})])
    assert newest.rows.tolist() == [0, 5] and newest.arrays["values"].ravel().tolist() == [7.0, 1.0]
    assert len(RowOverlay.merged([])) == 0


def test_writes_go_to_the_log_and_read_back_after_a_reopen_and_a_snapshot(tmp_path):
    # A table of 5,000 rows: 40 writes of 300 random rows each (rows written again and again), then reads of
    # random rows, against a table in memory; reopened, its log's index is rebuilt from the blocks.
    rng = np.random.default_rng(3)
    values, accumulators = table(5000, 4)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators, chunk_rows=1000)
    for step in range(40):
        rows = rng.choice(5000, 300, replace=False)
        new_values = rng.normal(size=(300, 4)).astype(np.float32)
        store.write(rows, new_values, np.full((300, 4), step + 1.0))
        values[rows], accumulators[rows] = new_values, step + 1.0
        probe = rng.integers(0, 5000, 700)
        got_values, got_accumulators = store.read(probe)
        np.testing.assert_array_equal(got_values, values[probe])
        np.testing.assert_array_equal(got_accumulators, accumulators[probe])
    assert store.counters.log_appends == 40 and store.counters.log_compactions == 0
    assert store.log_rows == len(np.unique(np.flatnonzero(accumulators[:, 0] > 0)))
    table_bytes = HEADER_BYTES + 5000 * 32
    assert os.path.getsize(tmp_path / "t.rows") == table_bytes + store.log_length * 32
    store.snapshot(tmp_path / "snap.rows")
    store.close()
    for path in ("t.rows", "snap.rows"):
        with RowStore.open(tmp_path / path, writable=False) as reopened:
            np.testing.assert_array_equal(reopened.read(np.arange(5000))[0], values)
            np.testing.assert_array_equal(reopened.read(np.arange(5000))[1], accumulators)


def test_appends_no_flush_made_durable_are_not_part_of_the_store(tmp_path):
    values, accumulators = table(100, 2)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators)
    store.write(np.array([3, 4]), np.full((2, 2), 1.0), np.full((2, 2), 2.0))
    store.flush()
    store.write(np.array([4, 5]), np.full((2, 2), 9.0), np.full((2, 2), 9.0))
    os.close(store.fd)  # the process dies: no flush, no close
    with RowStore.open(tmp_path / "t.rows") as reopened:  # the store as of the flush
        np.testing.assert_array_equal(reopened.read(np.array([3, 4, 5]))[0], [[1, 1], [1, 1], values[5]])
        reopened.write(np.array([5]), np.full((1, 2), 7.0), np.full((1, 2), 7.0))  # over the dead tail
    with RowStore.open(tmp_path / "t.rows", writable=False) as reopened:
        np.testing.assert_array_equal(reopened.read(np.array([3, 4, 5]))[0], [[1, 1], [1, 1], [7, 7]])


def test_a_long_log_is_merged_into_the_table_and_a_merge_cut_short_loses_nothing(tmp_path, monkeypatch):
    import trainer.row_store as row_store

    rng = np.random.default_rng(4)
    values, accumulators = table(2000, 4)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators)
    store.log_max_rows = 500  # a merge once the log holds more than 500 distinct rows
    for step in range(6):
        rows = rng.choice(2000, 200, replace=False)
        store.write(rows, np.full((200, 4), float(step)), np.full((200, 4), step + 1.0))
        values[rows], accumulators[rows] = step, step + 1.0
    assert store.counters.log_compactions >= 1 and store.counters.rows_compacted > 500
    np.testing.assert_array_equal(store.read(np.arange(2000))[0], values)
    # A merge killed after writing the table and before emptying the log: the log still holds every row's latest
    # values, and the table's rows it wrote are those same values.
    store.log_max_rows = 10**9
    rows = rng.choice(2000, 300, replace=False)
    store.write(rows, np.full((300, 4), 42.0), np.full((300, 4), 43.0))
    values[rows], accumulators[rows] = 42.0, 43.0
    store.flush()
    real_write_all = row_store.write_all

    def killed_at_the_header(fd, data, offset):
        if offset == LOG_HEADER_OFFSET:
            raise KeyboardInterrupt("killed")
        real_write_all(fd, data, offset)

    monkeypatch.setattr(row_store, "write_all", killed_at_the_header)
    with pytest.raises(KeyboardInterrupt):
        store.compact()
    monkeypatch.undo()
    os.close(store.fd)
    with RowStore.open(tmp_path / "t.rows") as reopened:
        assert reopened.log_rows == 300
        np.testing.assert_array_equal(reopened.read(np.arange(2000))[0], values)
        np.testing.assert_array_equal(reopened.read(np.arange(2000))[1], accumulators)
        assert reopened.compact() == 300
        assert os.path.getsize(tmp_path / "t.rows") == HEADER_BYTES + 2000 * 32  # the log cut off
    with RowStore.open(tmp_path / "t.rows", writable=False) as reopened:
        assert reopened.log_rows == 0
        np.testing.assert_array_equal(reopened.read(np.arange(2000))[0], values)


def test_a_store_that_draws_its_rows_logs_the_rows_written(tmp_path):
    initializer = uniform_initializer(4, seed=5)
    store = RowStore.create(tmp_path / "t.rows", 1_000_000, 4, initializer, initial_accumulator=0.1)
    rows = np.array([7, 999_999, 123_456])
    store.write(rows, np.ones((3, 4)), np.full((3, 4), 0.5))
    store.flush()
    # Only the log takes disk: the table stays a hole.
    assert os.stat(tmp_path / "t.rows").st_blocks * 512 <= 64 << 10
    with RowStore.open(tmp_path / "t.rows", writable=False) as reopened:
        got_values, got_accumulators, written = reopened.read_marked(np.array([7, 8, 123_456]))
        np.testing.assert_array_equal(written, [True, False, True])
        np.testing.assert_array_equal(got_values[[0, 2]], np.ones((2, 4)))
        np.testing.assert_array_equal(got_values[1], initializer.rows(np.array([8]))[0])
        np.testing.assert_allclose(got_accumulators[1], 0.1)


def test_a_flush_merges_a_long_log_a_part_at_a_time_until_it_is_cut_off(tmp_path):
    # A log past its bound (here 1,000 records and four times its rows) is merged a part per flush: at least
    # log_merge_min_rows rows and twice the rows appended since the flush before, the oldest records first, so
    # no flush pays for the whole log; parts keep up with the writes, and the log is cut once none is left.
    rng = np.random.default_rng(6)
    values, accumulators = table(3000, 4)
    store = RowStore.from_arrays(tmp_path / "t.rows", values, accumulators)
    store.log_compact_min_records, store.log_merge_min_rows = 1000, 100
    merged, lengths = [], []
    for step in range(60):
        rows = rng.choice(300, 60, replace=False)  # 300 rows written again and again: garbage accumulates
        store.write(rows, np.full((60, 4), float(step)), np.full((60, 4), step + 1.0))
        values[rows], accumulators[rows] = step, step + 1.0
        before = store.counters.rows_compacted
        store.flush()
        merged.append(store.counters.rows_compacted - before)
        lengths.append(store.log_length)
        np.testing.assert_array_equal(store.read(np.arange(3000))[0], values)
        np.testing.assert_array_equal(store.read(np.arange(3000))[1], accumulators)
    assert max(merged) <= 120 and sum(merged) > 500  # parts of at most max(100, 2 x 60) rows
    assert store.counters.log_merges > store.counters.log_compactions >= 1
    assert min(lengths) == 0 and max(lengths) < 2000  # cut off, and never far past its bound
    store.close()
    with RowStore.open(tmp_path / "t.rows", writable=False) as reopened:  # a part merged, the log kept: the same
        np.testing.assert_array_equal(reopened.read(np.arange(3000))[0], values)
        np.testing.assert_array_equal(reopened.read(np.arange(3000))[1], accumulators)


def test_rows_on_pages_that_hold_no_data_are_drawn_without_a_read(tmp_path):
    # A store that draws its rows: 100,000 rows of 32 bytes, 128 to a page. Rows written in place (creation's
    # warm-start rows) make their pages data; rows in the log are read from it; every other row is on a hole
    # and is drawn without a call, however many of them a read asks for. (The table's last page shares its block
    # with the log's first records: data, so its rows are read, as zeros, and drawn the same.)
    initializer = uniform_initializer(4, seed=9)
    written = np.array([5, 300, 90_000])
    store = RowStore.create_fresh(tmp_path / "t.rows", 100_000, initializer, 0.1,
                                  written=[(written, np.full((3, 4), 2.0), np.full((3, 4), 3.0))])
    store.write(np.array([50_000]), np.full((1, 4), 7.0), np.full((1, 4), 8.0))  # to the log
    store.flush()
    rows = np.array([0, 5, 6, 300, 20_000, 50_000, 89_999, 90_000, 99_000])
    for reader in (store, RowStore.open(tmp_path / "t.rows", writable=False)):
        before = reader.counters
        values, accumulators, marked = reader.read_marked(rows)
        # Pages 0 (rows 0-127: row 5), 2 (256-383: row 300) and 703 (89,984-90,111: row 90,000) hold data; row
        # 50,000 is in the log (of the store that wrote it) or read back from it (a flushed store reopened).
        assert reader.counters.rows_in_holes - before.rows_in_holes == 2  # rows 20,000 and 99,000
        np.testing.assert_array_equal(marked, [False, True, False, True, False, True, False, True, False])
        np.testing.assert_array_equal(values[[1, 3, 5, 7], 0], [2.0, 2.0, 7.0, 2.0])
        np.testing.assert_array_equal(values[~marked], initializer.rows(rows[~marked]))
        np.testing.assert_allclose(accumulators[~marked], 0.1)
