"""`make bench-reliability`: what the pipeline survives, as a table (bench/results/reliability.json).

Three groups of cases, each run against real parts started here:
- raw_data (bench/reliability/raw_data.py): bad minute partitions, each learned (or not) by a real minute run;
- requests (bench/reliability/bad_requests.py): bad REST and gRPC requests while good traffic runs;
- faults (bench/reliability/faults.py): the tracking server away, a SIGKILLed training, a corrupt checkpoint,
  a full disk during a samples write, S3 answering 500s and refusing connections during a publish;
- live (bench/reliability/live.py): Airflow's scheduler, Spark Connect (mid-job), a training task and the model
  server SIGKILLed under live minute runs and load; every live minute learned once; memory over the run.

Every case has its documented (expected) outcome, the observed one, what was lost (rows, minutes, versions,
good requests), whether a person had to recover and how long recovery took. The totals: `cases`, `lost`,
`unexpected` (cases whose outcome was not the documented one) and `manual_recoveries`.

    make bench-reliability                                   every group
    make bench-reliability BENCH_RELIABILITY_ARGS='--group raw_data'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.provenance import provenance

GROUPS = ("raw_data", "requests", "faults", "live")
RESULTS = Path(__file__).resolve().parent / "results" / "reliability.json"


def run_group(name: str, work: Path, soak_minutes: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    if name == "raw_data":
        from bench.reliability.raw_data import run_raw_cases

        return run_raw_cases(work)
    if name == "requests":
        from bench.reliability.bad_requests import run_request_cases

        started = time.monotonic()
        result = run_request_cases(work)
        return {**result, "seconds": round(time.monotonic() - started, 1)}
    if name == "faults":
        from bench.reliability.faults import run_fault_cases

        return run_fault_cases(work)
    from bench.reliability.live import run_live_cases

    return run_live_cases(work, soak_minutes=soak_minutes)


def totals(cases: list[dict[str, Any]]) -> dict[str, Any]:
    lost: dict[str, int] = {"rows": 0, "minutes": 0, "versions": 0, "requests": 0}
    for case in cases:
        for key, value in case["lost"].items():
            lost[key] = lost.get(key, 0) + int(value)
    return {"cases": len(cases), "lost": lost, "unexpected": sum(not c["as_expected"] for c in cases),
            "manual_recoveries": sum(bool(c["manual_recovery"]) for c in cases)}


def print_table(cases: list[dict[str, Any]]) -> None:
    print(f"\n{'group':9s} {'case':48s} {'ok':3s} observed")
    for case in cases:
        mark = "yes" if case["as_expected"] else "NO"
        print(f"{case['group']:9s} {case['case'][:48]:48s} {mark:3s} {case['observed'][:110]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", action="append", choices=GROUPS, help="run only this group (repeatable)")
    parser.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temporary directory)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--soak-minutes", type=float, default=2.0,
                        help="live: minutes of steady minute runs and load after the faults (the issue's soak: 30)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-reliability-"))
    started = time.monotonic()
    cases: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    try:
        for group in args.group or GROUPS:
            print(f"== {group}", flush=True)
            result = run_group(group, work / group, args.soak_minutes)
            cases.extend(result["cases"])
            seconds[group] = result.get("seconds")
            extra.update({f"{group}_{k}": v for k, v in result.items() if k not in ("cases", "seconds")})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = totals(cases)
    document = {
        "benchmark": "reliability",
        "command": "make bench-reliability" + (f" BENCH_RELIABILITY_ARGS='{' '.join(sys.argv[1:])}'"
                                               if sys.argv[1:] else ""),
        "machine": f"{platform.node() or 'host'} ({os.cpu_count()} cores), no GPU",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        **summary,
        "seconds": round(time.monotonic() - started, 1),
        "group_seconds": seconds,
        **extra,
        "case_list": cases,
    }
    document = {**provenance(document["command"]), **document}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print_table(cases)
    print(f"\n{summary['cases']} cases, {summary['unexpected']} not as documented, lost {summary['lost']}, "
          f"{summary['manual_recoveries']} needed a person; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
