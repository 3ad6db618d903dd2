"""Bad raw data, delivered as minute partitions, each learned (or not) by a real minute run.

A daily run on generated minutes starts a chain; then each case delivers one minute after it (a generated minute
made bad in one way, built from the feature spec's columns) and runs that minute's steps exactly as Airflow's
ctr_incremental does (plan, validate, samples, train, export_delta, gate, publish, in-process). A case's
observed outcome is what the run did: trained on (a published delta learned the minute), quarantined with a
report, a clear failure, or nothing to learn. The raw bytes are hashed before and after, wherever validation
left them. At the end the chain is checked: every minute that should be learned is in exactly one published
delta, and no quarantined minute is in any.

    PYTHONPATH=. python bench/reliability/raw_data.py --out /tmp/raw.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.reliability.chain import FAILED, NOTHING, QUARANTINED, TRAINED, Chain, no_loss, sha256_files

EXPECTED_TEXT = {
    TRAINED: "trained on: a published delta learned the minute once",
    QUARANTINED: "quarantined with a report; the run fails, nothing trains on it",
    FAILED: "a clear failure naming the minute; nothing published",
    NOTHING: "a no-op: the chain already holds the minute; nothing learned twice",
}


@dataclass(frozen=True)
class RawCase:
    name: str
    expected: str
    # (good partition bytes, the spec) -> the bytes delivered; None delivers no data file at all.
    make: Callable[[bytes, Any], bytes | None]
    marker: bool = True  # whether the completion marker is written
    rows_factor: int = 1  # the generated minute's rows, times this
    learned_later: bool = False  # a failed minute whose data stays: the next minute's run learns it
    description: str = ""


def _lines(data: bytes) -> list[bytes]:
    return data.rstrip(b"\n").split(b"\n")


def _join(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def _column(spec, name: str) -> int:
    return list(spec.source.columns).index(name)


def _first(spec, kind: str) -> str:
    return next(f.column for f in spec.features if type(f).__name__ == kind)


def _set_field(data: bytes, spec, column: str, value: bytes, rows: slice = slice(0, 1)) -> bytes:
    lines, index = _lines(data), _column(spec, column)
    delimiter = spec.source.field_delimiter.encode()
    for i in range(*rows.indices(len(lines))):
        fields = lines[i].split(delimiter)
        fields[index] = value
        lines[i] = delimiter.join(fields)
    return _join(lines)


def _drop_field(data: bytes, spec) -> bytes:
    lines = _lines(data)
    delimiter = spec.source.field_delimiter.encode()
    lines[7] = delimiter.join(lines[7].split(delimiter)[:-1])
    return _join(lines)


def _extra_field(data: bytes, spec) -> bytes:
    lines = _lines(data)
    lines[7] = lines[7] + spec.source.field_delimiter.encode() + b"extra"
    return _join(lines)


def _binary_garbage(data: bytes, spec) -> bytes:
    return data + random.Random(1).randbytes(4096)


def _never_seen(data: bytes, spec) -> bytes:
    """Every categorical value replaced by one no earlier minute had (a burst of new ids)."""
    delimiter = spec.source.field_delimiter.encode()
    columns = [_column(spec, f.column) for f in spec.features if type(f).__name__ == "CategoricalFeature"]
    out = []
    for number, line in enumerate(_lines(data)):
        fields = line.split(delimiter)
        for index in columns:
            fields[index] = f"n{number:06d}{index:02d}".encode()
        out.append(delimiter.join(fields))
    return _join(out)


def _all_labels(value: bytes):
    def make(data: bytes, spec) -> bytes:
        return _set_field(data, spec, spec.label.column, value, slice(None))
    return make


def _only_label(data: bytes, spec) -> bytes:
    """Every feature empty: only the label is there (allowed: Criteo's fields may all be missing)."""
    delimiter = spec.source.field_delimiter.encode()
    label = _column(spec, spec.label.column)
    width = len(spec.source.columns)
    return _join([delimiter.join(line.split(delimiter)[label] if i == label else b"" for i in range(width))
                  for line in _lines(data)])


def raw_cases(spec) -> list[RawCase]:
    dense, categorical, label = _first(spec, "DenseFeature"), _first(spec, "CategoricalFeature"), spec.label.column
    return [
        RawCase("good_minute", TRAINED, lambda d, s: d, description="a generated minute as it comes"),
        RawCase("truncated_last_line", QUARANTINED, lambda d, s: d[:-len(_lines(d)[-1]) // 2 - 1],
                description="the last line cut in the middle, no newline (a writer killed mid-write)"),
        RawCase("missing_field", QUARANTINED, _drop_field, description="one line with a field too few"),
        RawCase("extra_field", QUARANTINED, _extra_field, description="one line with a field too many"),
        RawCase("non_numeric_dense", QUARANTINED, lambda d, s: _set_field(d, s, dense, b"twelve"),
                description=f"{dense} = 'twelve' on one line"),
        RawCase("label_outside_set", QUARANTINED, lambda d, s: _set_field(d, s, label, b"2"),
                description=f"{label} = 2 on one line"),
        RawCase("label_missing", QUARANTINED, lambda d, s: _set_field(d, s, label, b""),
                description=f"{label} empty on one line"),
        RawCase("binary_garbage", QUARANTINED, _binary_garbage, description="4 KB of random bytes appended"),
        RawCase("invalid_utf8", QUARANTINED, lambda d, s: _set_field(d, s, categorical, b"\xff\xfe\xfa"),
                description=f"{categorical} holds bytes that are not UTF-8"),
        RawCase("nul_byte", QUARANTINED, lambda d, s: _set_field(d, s, categorical, b"ab\x00cd"),
                description=f"{categorical} holds a NUL byte"),
        RawCase("one_megabyte_line", QUARANTINED, lambda d, s: _set_field(d, s, categorical, b"x" * 1_000_000),
                description=f"{categorical} is 1 MB long"),
        RawCase("crlf_line_ends", TRAINED, lambda d, s: d.replace(b"\n", b"\r\n"),
                description="Windows line ends (validation and Spark both read them as line ends)"),
        RawCase("header_line", QUARANTINED,
                lambda d, s: s.source.field_delimiter.join(s.source.columns).encode() + b"\n" + d,
                description="a header line in a layout without one"),
        RawCase("empty_file", QUARANTINED, lambda d, s: b"", description="a data file of 0 bytes, marker written"),
        RawCase("empty_partition", FAILED, lambda d, s: None,
                description="the completion marker without a data file"),
        RawCase("missing_marker", FAILED, lambda d, s: d, marker=False,
                description="the data file without its completion marker (a writer that never finished): never "
                            "learned, later runs record it as incomplete"),
        RawCase("never_seen_ids", TRAINED, _never_seen, description="every categorical value never seen before"),
        RawCase("hundred_times_rows", TRAINED, lambda d, s: d, rows_factor=100,
                description="100 times the usual rows in one minute"),
        RawCase("no_clicks", TRAINED, _all_labels(b"0"), description="a minute without a single click"),
        RawCase("only_clicks", TRAINED, _all_labels(b"1"), description="a minute of clicks only"),
        RawCase("only_labels", FAILED, _only_label, learned_later=True,
                description="every feature field empty: identical rows all fall in one split, so the run has no "
                            "held-out rows and fails; the next minute's run learns it with its own"),
        RawCase("huge_dense_value", TRAINED, lambda d, s: _set_field(d, s, dense, b"999999999999999999"),
                description=f"{dense} = 10^18 - 1 on one line"),
        RawCase("duplicated_rows", TRAINED, lambda d, s: d + d, description="every row delivered twice in the file"),
        RawCase("delivered_twice", NOTHING, lambda d, s: d,
                description="a minute the chain learned, delivered again with the same bytes and run again"),
    ]


def run_raw_cases(work: Path, *, rows_per_minute: int = 2000, only: list[str] | None = None,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    started = time.monotonic()
    from components.feature_spec import spec_for

    chain = Chain.start(work / "raw", rows_per_minute=rows_per_minute, progress=progress)
    spec = spec_for(chain.config)
    layout = chain.layout
    cases = [c for c in raw_cases(spec) if not only or c.name in only]
    results: list[dict[str, Any]] = []
    learned_minutes: list[datetime] = []
    cases_by_minute: dict[str, RawCase] = {}
    for case in cases:
        if case.expected == NOTHING and learned_minutes:
            target = learned_minutes[-1]  # a learned minute delivered again
            good = (layout.raw_minute_dir(target) / spec.source.file_name).read_bytes()
        else:
            index, target = chain.take_minute()
            good = chain.good_bytes(index, target, case.rows_factor)
        data = case.make(good, spec)
        raw_dir = chain.deliver(target, data, case.marker)
        before = sha256_files(raw_dir)
        observed, error, seconds = chain.run(target, run_id=f"reliability-{case.name}")
        quarantine_dir = layout.quarantine_minute_dir(target)
        kept = sha256_files(raw_dir) or sha256_files(quarantine_dir)
        bytes_kept = before == {name: kept.get(name) for name in before}
        learned = chain.learned().get(target.isoformat(), [])
        if observed == TRAINED:
            learned_minutes.append(target)
            if not learned:
                observed = f"{TRAINED}?: the run succeeded but no published delta holds the minute"
        if observed == QUARANTINED:
            report = quarantine_dir / "report.json"
            if report.is_file():  # what the quarantine report says broke, rather than the run's headline
                error = json.loads(report.read_text())["summary"].split(": ", 1)[-1]
            else:
                observed = f"{QUARANTINED}?: the run said so, but {quarantine_dir} has no report"
        rows = data.count(b"\n") if data else 0
        lost_rows = rows if case.expected == TRAINED and observed != TRAINED else 0
        cases_by_minute.setdefault(target.isoformat(), case)  # a redelivery keeps the first case
        results.append({
            "group": "raw_data", "case": case.name, "description": case.description,
            "expected": EXPECTED_TEXT[case.expected] + ("; the next minute's run learns it" if case.learned_later
                                                        else ""),
            "observed": observed if not error else f"{observed}: {error}",
            "as_expected": observed == case.expected and bytes_kept,
            "lost": no_loss(rows=lost_rows, minutes=int(lost_rows > 0)),
            "manual_recovery": False, "recover_s": None,
            "detail": {"minute": target.isoformat(), "learned_by": learned, "raw_sha256_unchanged": bytes_kept,
                       "rows_delivered": rows, "seconds": round(seconds, 1)},
        })
        progress(f"raw data: {case.name:22s} expected {case.expected:16s} observed {observed} ({seconds:.0f} s)")
    # The chain: each minute learned once; a minute learned exactly when its case says it should be, by its own
    # run or (learned_later) by the next one.
    learned = chain.learned()
    twice = {m: v for m, v in learned.items() if len(v) > 1}
    should = {m for m, c in cases_by_minute.items() if c.expected == TRAINED or c.learned_later}
    not_learned = sorted(should - set(learned))
    wrongly = sorted(m for m in cases_by_minute if m in learned and m not in should)
    for result in results:
        minute = result["detail"]["minute"]
        result["detail"]["learned_by_end"] = learned.get(minute, [])
        if minute in not_learned:
            result["as_expected"] = False
            result["lost"].update(rows=result["detail"]["rows_delivered"], minutes=1)
    results.append({
        "group": "raw_data", "case": "chain_after_all_cases", "description": "the published chain after every case",
        "expected": "every minute learned at most once; the good ones learned; no quarantined or incomplete one",
        "observed": f"{len(twice)} minute(s) learned twice {sorted(twice)[:3]}; {len(not_learned)} good minute(s) "
                    f"not learned {not_learned[:3]}; {len(wrongly)} learned that should not be {wrongly[:3]}",
        "as_expected": not twice and not not_learned and not wrongly,
        "lost": no_loss(), "manual_recovery": False, "recover_s": None,
        "detail": {"versions": chain.store.versions("ctr")},
    })
    return {"cases": results, "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the cases as JSON here")
    parser.add_argument("--rows-per-minute", type=int, default=2000)
    parser.add_argument("--only", action="append", help="run only this case (repeatable)")
    parser.add_argument("--keep", metavar="DIR", help="work here and keep it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="reliability-raw-"))
    work.mkdir(parents=True, exist_ok=True)
    result = run_raw_cases(work, rows_per_minute=args.rows_per_minute, only=args.only)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    bad = [c["case"] for c in result["cases"] if not c["as_expected"]]
    print(f"{len(result['cases'])} cases, {len(bad)} not as expected: {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
