"""A day of minute checkpoints over a tiered table, with the spans the chain's binary counter places: the chain
read from minute p crosses one piece per set bit of p, and reads as the table does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from components.manifest import read_manifest, write_manifest
from trainer.row_store import RowStore
from trainer.tiered_tables import (
    ChainRows,
    chain_position,
    materialize,
    span_pieces,
    table_chain,
    write_minute_table,
    write_spans,
)

pytestmark = pytest.mark.unit

NUM_ROWS, DIM = 3_000, 4


def a_day(root: Path, minutes: int, rows_per_minute: int = 150, max_span_bytes: int = 2**30,
          spans_from: int = 0, span_from: str = "store", spans_after: bool = False
          ) -> tuple[list[Path], list[tuple[np.ndarray, np.ndarray]]]:
    """A daily checkpoint holding table C1's store, and `minutes` minute checkpoints after it written as a minute
    run writes them: each minute's rows (Zipf-like: low rows often) written into the live store, then its overlay
    and span (`write_minute_table`) and its manifest. Minutes before `spans_from` are written as a checkpoint
    without spans was (no parent given, so no position); `span_from` is `write_minute_table`'s. With
    `spans_after` each minute is written without its span, which `write_spans` then writes, as the minute run's
    step after its publish does. Returns the checkpoints (the day first) and the table (values, accumulators)
    each stands for."""
    rng = np.random.default_rng(5)
    values = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
    accumulators = rng.uniform(size=(NUM_ROWS, DIM)).astype(np.float32)
    day = root / "day"
    (day / "tables").mkdir(parents=True)
    (root / "live").mkdir()
    RowStore.write_new(day / "tables" / "C1.rows", NUM_ROWS, DIM,
                       iter([(values.copy(), accumulators.copy())])).close()
    write_manifest(day, kind="checkpoint", version="day", files=["tables/C1.rows"])
    live = RowStore.write_new(root / "live" / "C1.rows", NUM_ROWS, DIM, iter([(values.copy(), accumulators.copy())]))
    checkpoints, tables = [day], [(values.copy(), accumulators.copy())]
    try:
        for minute in range(1, minutes + 1):
            rows = np.unique(np.minimum(rng.zipf(1.3, rows_per_minute) - 1, NUM_ROWS - 1))
            values[rows] = rng.normal(size=(len(rows), DIM)).astype(np.float32)
            accumulators[rows] = rng.uniform(size=(len(rows), DIM)).astype(np.float32)
            live.write(rows, values[rows], accumulators[rows])
            live.flush()
            directory = root / f"m{minute:04d}"
            parent = checkpoints[-1] if minute >= spans_from else None
            chain = write_minute_table(directory / "tables", "C1", rows, live, parent,
                                       0 if spans_after else max_span_bytes, span_from)
            inputs, extra = chain.manifest()
            write_manifest(directory, kind="checkpoint", version=f"m{minute}", files=chain.files,
                           inputs={"parent_checkpoint": str(checkpoints[-1]), **inputs}, extra=extra)
            if spans_after:
                write_spans(directory, max_span_bytes)
            checkpoints.append(directory)
            tables.append((values.copy(), accumulators.copy()))
    finally:
        live.close()
    return checkpoints, tables


def read_chain(checkpoint: Path) -> tuple[np.ndarray, np.ndarray]:
    with ChainRows(checkpoint, "C1") as chain:
        return chain.read(np.arange(NUM_ROWS))


@pytest.mark.parametrize("span_from", ["store", "pieces"])
def test_the_chain_from_minute_p_crosses_one_piece_per_set_bit_and_reads_as_the_table(tmp_path, span_from):
    checkpoints, tables = a_day(tmp_path, minutes=40, span_from=span_from)
    for position, checkpoint in enumerate(checkpoints):
        assert chain_position(checkpoint, "C1") == position
        base, pieces = table_chain(checkpoint, "C1")
        assert base == checkpoints[0] / "tables" / "C1.rows"
        assert len(pieces) == bin(position).count("1"), (position, [p.parent.parent.name for p in pieces])
        values, accumulators = read_chain(checkpoint)
        np.testing.assert_array_equal(values, tables[position][0])
        np.testing.assert_array_equal(accumulators, tables[position][1])
    # Minute 40 (binary 101000): minutes 1-32 in minute 32's span, 33-40 in minute 40's.
    _, pieces = table_chain(checkpoints[40], "C1")
    assert [(p.parent.parent.name, p.name) for p in pieces] == [("m0032", "C1.span.npz"), ("m0040", "C1.span.npz")]
    manifest = read_manifest(checkpoints[40], kind="checkpoint")
    assert manifest["inputs"]["tables_span_parent"] == str(checkpoints[32])
    assert manifest["tables_chain_position"] == 40 and "tables/C1.span.npz" in manifest["files"]
    # An odd minute writes no span; its overlay (the minute's own rows, the delta's) is written either way.
    assert not (checkpoints[39] / "tables" / "C1.span.npz").exists()
    assert all((c / "tables" / "C1.overlay.npz").exists() for c in checkpoints[1:])

    # A store made from the chain (a minute run in a new process) is the table too.
    materialize(checkpoints[40], "C1", tmp_path / "made.rows")
    with RowStore.open(tmp_path / "made.rows", writable=False) as made:
        np.testing.assert_array_equal(made.read(np.arange(NUM_ROWS))[0], tables[40][0])


def test_a_span_holds_the_rows_of_the_minutes_it_replaces(tmp_path):
    checkpoints, _ = a_day(tmp_path, minutes=8)
    position, at, pieces = span_pieces(checkpoints[7], "C1")  # for minute 8, written on minute 7
    assert position == 8 and at == checkpoints[0]
    assert [(p.parent.parent.name, p.name) for p in pieces] == [
        ("m0007", "C1.overlay.npz"), ("m0006", "C1.span.npz"), ("m0004", "C1.span.npz")]
    with np.load(checkpoints[8] / "tables" / "C1.span.npz") as span:
        rows = span["rows"]
    minutes = []
    for checkpoint in checkpoints[1:9]:
        with np.load(checkpoint / "tables" / "C1.overlay.npz") as overlay:
            minutes.append(overlay["rows"])
    np.testing.assert_array_equal(rows, np.unique(np.concatenate(minutes)))


def test_spans_too_large_for_memory_are_left_out_and_the_chain_keeps_its_minutes(tmp_path):
    # A bound that fits a span of two minutes' rows, not of four: spans of 2 written, of 4 and more not.
    checkpoints, tables = a_day(tmp_path, minutes=12, max_span_bytes=3_800)
    lengths = [len(table_chain(c, "C1")[1]) for c in checkpoints]
    with_spans = [bin(p).count("1") for p in range(13)]
    assert all(length >= short for length, short in zip(lengths, with_spans, strict=True))
    assert lengths[12] > with_spans[12]  # minute 8's span left out: minutes 1-8 crossed in pieces
    assert (checkpoints[2] / "tables" / "C1.span.npz").exists()
    assert not (checkpoints[8] / "tables" / "C1.span.npz").exists()
    assert "tables_span_parent" not in read_manifest(checkpoints[8], kind="checkpoint")["inputs"]
    for position, checkpoint in enumerate(checkpoints):
        np.testing.assert_array_equal(read_chain(checkpoint)[0], tables[position][0])

    # No span at all: one piece a minute, as before spans.
    checkpoints, tables = a_day(tmp_path / "none", minutes=6, max_span_bytes=1)
    assert [len(table_chain(c, "C1")[1]) for c in checkpoints] == list(range(7))
    np.testing.assert_array_equal(read_chain(checkpoints[6])[1], tables[6][1])


def test_a_chain_begun_without_positions_gets_no_spans(tmp_path):
    # Minutes 1-3 written as before spans (no position in their manifests); the minutes after them on that chain
    # cannot place a span and write none; the chain still reads as the table.
    checkpoints, tables = a_day(tmp_path, minutes=6, spans_from=4)
    assert [chain_position(c, "C1") for c in checkpoints] == [0, None, None, None, None, None, None]
    assert not list(tmp_path.glob("m*/tables/C1.span.npz"))
    assert len(table_chain(checkpoints[6], "C1")[1]) == 6
    np.testing.assert_array_equal(read_chain(checkpoints[6])[0], tables[6][0])


def test_a_span_is_bounded_by_its_union_not_by_the_rows_its_pieces_repeat(tmp_path):
    from trainer.tiered_tables import write_overlay, write_span

    values = np.arange(NUM_ROWS * DIM, dtype=np.float32).reshape(NUM_ROWS, DIM)
    store = RowStore.write_new(tmp_path / "live.rows", NUM_ROWS, DIM, iter([(values, values + 0.5)]))
    try:
        pieces = []
        for index in range(3):  # three pieces of 100 rows, the same 100 rows in each
            path = tmp_path / f"piece-{index}.npz"
            write_overlay(path, np.arange(100), values[:100], values[:100])
            pieces.append(path)
        record = DIM * 4 * 2
        # 301 rows named, 101 distinct: under a bound of 120 rows, written.
        assert write_span(tmp_path / "span.npz", pieces, np.array([2_000]), store, max_bytes=120 * record) == 101
        with np.load(tmp_path / "span.npz") as span:
            np.testing.assert_array_equal(span["rows"], [*range(100), 2_000])
            np.testing.assert_array_equal(span["values"], values[[*range(100), 2_000]])
        # Under a bound of 100 rows: the union (101) is over it, and nothing is written.
        assert write_span(tmp_path / "over.npz", pieces, np.array([2_000]), store, max_bytes=100 * record) is None
        assert not (tmp_path / "over.npz").exists()
        # A single piece over the bound is enough to give up.
        assert write_span(tmp_path / "one.npz", pieces, np.array([], np.int64), store, max_bytes=99 * record) is None
    finally:
        store.close()


def test_a_span_merged_from_its_pieces_is_the_span_read_from_the_live_store(tmp_path):
    """Every span of 40 minutes, merged from the pieces it replaces (no live store), holds the same rows, values
    and accumulators as the one read from the live store: a row's newest piece holds its values as of the
    minute."""
    from trainer.tiered_tables import read_overlay

    from_store, _ = a_day(tmp_path / "store", minutes=40)
    from_pieces, _ = a_day(tmp_path / "pieces", minutes=40, span_from="pieces")
    spans = 0
    for left, right in zip(from_store[1:], from_pieces[1:], strict=True):
        span = Path("tables") / "C1.span.npz"
        assert (left / span).exists() == (right / span).exists()
        if (left / span).exists():
            spans += 1
            (rows, fields), (other_rows, other_fields) = read_overlay(left / span), read_overlay(right / span)
            np.testing.assert_array_equal(rows, other_rows)
            for name in ("values", "accumulators"):
                np.testing.assert_array_equal(fields[name], other_fields[name])
    assert spans == 20  # the even minutes


def test_a_span_merged_from_pieces_keeps_the_bound_and_the_newest_values(tmp_path):
    from trainer.tiered_tables import merge_span, read_overlay, write_overlay

    record = DIM * 4 * 2
    ones, twos = np.ones((3, DIM), np.float32), np.full((2, DIM), 2.0, np.float32)
    older = write_overlay(tmp_path / "older.npz", np.array([1, 5, 9]), ones, ones)
    newer = write_overlay(tmp_path / "newer.npz", np.array([5, 7]), twos, twos)
    pieces = [tmp_path / newer, tmp_path / older]  # newest first, as span_pieces gives them
    assert merge_span(tmp_path / "span.npz", pieces, max_bytes=4 * record) == 4
    rows, fields = read_overlay(tmp_path / "span.npz")
    np.testing.assert_array_equal(rows, [1, 5, 7, 9])
    np.testing.assert_array_equal(fields["values"][:, 0], [1.0, 2.0, 2.0, 1.0])  # row 5: the newer piece's
    assert merge_span(tmp_path / "over.npz", pieces, max_bytes=3 * record) is None  # a union of 4 over 3
    assert not (tmp_path / "over.npz").exists()
    with pytest.raises(ValueError, match="span_from must be one of store, pieces, got 'disk'"):
        write_minute_table(tmp_path / "tables", "C1", np.array([1]), None, None, span_from="disk")


def test_spans_written_after_the_minute_make_the_same_chain(tmp_path):
    """Each minute written without its span, then `write_spans` (the minute run's step after its publish): the
    chain from minute p crosses one piece per set bit of p and reads as the table, the spans under tables/spans/
    with their own manifest; and before a minute's spans are written, its chain crosses the overlays instead,
    the same table."""
    checkpoints, tables = a_day(tmp_path, minutes=24, spans_after=True)
    for position, checkpoint in enumerate(checkpoints):
        _, pieces = table_chain(checkpoint, "C1")
        assert len(pieces) == bin(position).count("1"), position
        values, accumulators = read_chain(checkpoint)
        np.testing.assert_array_equal(values, tables[position][0])
        np.testing.assert_array_equal(accumulators, tables[position][1])
    _, pieces = table_chain(checkpoints[24], "C1")  # 11000: minutes 1-16, then 17-24
    assert [(p.parent.parent.parent.name, p.parent.name, p.name) for p in pieces] == [
        ("m0016", "spans", "C1.span.npz"), ("m0024", "spans", "C1.span.npz")]
    spans = read_manifest(checkpoints[24] / "tables" / "spans", kind="spans")
    assert spans["inputs"]["tables_span_parent"] == str(checkpoints[16])
    assert list(spans["files"]) == ["C1.span.npz"] and spans["span_rows"]["C1"] > 0
    # The checkpoint's own manifest names no span: the spans have theirs.
    manifest = read_manifest(checkpoints[24], kind="checkpoint")
    assert "tables_span_parent" not in manifest["inputs"] and manifest["tables_chain_position"] == 24

    # Minute 24's spans taken away but for their file: without the manifest, written last, they do not count.
    (checkpoints[24] / "tables" / "spans" / "manifest.json").unlink()
    _, pieces = table_chain(checkpoints[24], "C1")
    # Minute 23's chain (the spans of 16, 20 and 22, minute 23's overlay), then minute 24's overlay.
    assert [(p.parent.parent.name if p.parent.name == "tables" else p.parent.parent.parent.name, p.name)
            for p in pieces] == [("m0016", "C1.span.npz"), ("m0020", "C1.span.npz"), ("m0022", "C1.span.npz"),
                                 ("m0023", "C1.overlay.npz"), ("m0024", "C1.overlay.npz")]
    np.testing.assert_array_equal(read_chain(checkpoints[24])[0], tables[24][0])
    # Written again (a retried step), the same span.
    assert write_spans(checkpoints[24]) == {"C1": spans["span_rows"]["C1"]}
    assert len(table_chain(checkpoints[24], "C1")[1]) == 2


def test_write_spans_writes_nothing_where_the_minute_places_no_span(tmp_path):
    checkpoints, _ = a_day(tmp_path, minutes=4, spans_after=True)
    assert write_spans(checkpoints[3]) == {}  # an odd position
    assert not (checkpoints[3] / "tables" / "spans").exists()
    assert write_spans(checkpoints[4], max_span_bytes=0) == {}  # spans off
    with_spans, _ = a_day(tmp_path / "in_train", minutes=2)
    assert write_spans(with_spans[2]) == {}  # written with its span already
