"""A first training over months of sparse minute partitions: what validation and the daily run cost.

Writes a MovieLens-100K-shaped click log (users with attributes, items with pipe-joined genres, unix-second
timestamps, label = rating >= 4): `--rows` ratings on `--minutes` distinct minutes spread over `--days` days,
as MovieLens's 80,000 training ratings fall on 23,159 of 241,877 minutes. The same rows are also written
squeezed into one day (same order, same minute boundaries folded onto the day's 1,440 minutes), the cost a
run should follow. Each is ingested with `ctr ingest` into its own data root, then `ctr run daily --steps ...`
runs on it, timed from outside. Results: bench/results/history.json.

    python bench/bench_history.py                            # data + validate + features + samples
    python bench/bench_history.py --steps validate --only spread
    python bench/bench_history.py --repo /tmp/base           # the same, with another checkout's code
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/bench_history.py` as well as make bench-history

from bench.provenance import provenance  # noqa: E402

START = datetime(2026, 1, 1, tzinfo=UTC)
GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
OCCUPATIONS = ("administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
               "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer",
               "retired", "salesman", "scientist", "student", "technician", "writer")
SPEC = """\
# MovieLens-100K shaped: ratings joined with user and item attributes; label = rating >= 4.
name: movielens_like
description: "ratings with user and item attributes (bench/bench_history.py)"
source:
  format: csv
  header: true
label: {column: liked}
features:
  - name: timestamp
    kind: timestamp
    format: unix_seconds
    derive: [hour_of_day, day_of_week]
  - names: [user_id, item_id]
    kind: categorical
    dtype: int
  - names: [gender, occupation, zip_prefix]
    kind: categorical
  - name: age
    kind: dense
  - name: release_year
    kind: dense
  - name: genres
    kind: multi_categorical
    separator: "|"
    max_length: 6
"""


def write_log(path: Path, rows: int, minutes: int, days: int, seed: int, one_day: bool) -> dict:
    """The log as CSV; returns its shape."""
    rng = np.random.default_rng(seed)
    span = days * 1440
    chosen = np.sort(rng.choice(span, size=minutes, replace=False))
    # Every chosen minute gets a row, the rest go to minutes drawn with a heavy tail (sessions of ratings).
    weights = rng.pareto(1.2, size=minutes) + 1
    extra = rng.choice(minutes, size=rows - minutes, p=weights / weights.sum())
    minute_of_row = np.sort(np.concatenate([np.arange(minutes), extra]))
    offsets = chosen[minute_of_row]
    if one_day:
        offsets = offsets * 1440 // span
    seconds = int(START.timestamp()) + offsets * 60 + rng.integers(0, 60, size=rows)
    num_users, num_items = 943, 1682
    users = rng.zipf(1.3, size=rows) % num_users + 1
    items = rng.zipf(1.2, size=rows) % num_items + 1
    user_age = rng.integers(7, 74, size=num_users + 1)
    user_gender = rng.choice(["M", "F"], size=num_users + 1, p=[0.71, 0.29])
    user_occupation = rng.choice(OCCUPATIONS, size=num_users + 1)
    user_zip = np.char.zfill(rng.integers(0, 1000, size=num_users + 1).astype(str), 3)
    item_year = rng.integers(1922, 1999, size=num_items + 1)
    item_genres = ["|".join(rng.choice(GENRES, size=rng.integers(1, 4), replace=False)) for _ in range(num_items + 1)]
    logit = 0.2 + 0.8 * np.sin(users * 0.37) + 0.6 * np.cos(items * 0.11) - 0.01 * (item_year[items] - 1980)
    liked = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    with path.open("w") as out:
        out.write("user_id,item_id,liked,timestamp,age,gender,occupation,zip_prefix,release_year,genres\n")
        for r in range(rows):
            u, i = users[r], items[r]
            out.write(f"{u},{i},{liked[r]},{seconds[r]},{user_age[u]},{user_gender[u]},{user_occupation[u]},"
                      f"{user_zip[u]},{item_year[i]},{item_genres[i]}\n")
    return {"rows": rows, "distinct_minutes": int(len(np.unique(offsets))), "span_minutes": int(offsets.max() + 1)}


def run(command: list[str], cwd: Path, log: Path) -> float:
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(cwd)}).returncode
    seconds = time.monotonic() - started
    if code:
        raise SystemExit(f"{' '.join(command)} failed with exit code {code}; see {log}")
    return seconds


def step_seconds(log: Path) -> dict[str, float]:
    """Each step's wall time from the runner's progress lines ('<step>: done in N s' or 'step <step> ... s')."""
    import re

    found = {}
    for line in log.read_text(errors="replace").splitlines():
        match = re.search(r"step (\w+) (?:finished|done|succeeded)[^0-9]*([0-9.]+) ?s", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def _commit(repo: Path) -> str:
    """The checkout's commit, with '+changes' when its tracked files other than bench/results' differ from it (a
    result written by an earlier run leaves the code as committed, as in bench/provenance.py)."""
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD", "--", ":(top)",
                            ":(top,exclude)bench/results"]).returncode != 0
    return head + ("+changes" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=80_000)
    parser.add_argument("--minutes", type=int, default=23_159)
    parser.add_argument("--days", type=int, default=168)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_history"))
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose code runs the pipeline")
    parser.add_argument("--steps", default="validate,features,samples")
    parser.add_argument("--only", choices=["spread", "one_day"], action="append",
                        help="run only these layouts (default: both)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config overrides for the runs")
    parser.add_argument("--fresh", action="store_true", help="ingest again into empty data roots")
    parser.add_argument("--revalidate", action="store_true",
                        help="then validate again with --set features.min_count=2 (markers should hold)")
    parser.add_argument("--before", type=Path, help="an earlier result (e.g. of another --repo) kept beside")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "history.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    spec_path = args.work / "movielens_like.yaml"
    spec_path.write_text(SPEC)
    python = sys.executable
    results: dict = {"rows": args.rows, "minutes": args.minutes, "days": args.days, "seed": args.seed,
                     "repo": str(args.repo), "commit": _commit(args.repo), "steps": args.steps, "set": args.set,
                     "layouts": {}}
    for name in args.only or ["spread", "one_day"]:
        root = args.work / name
        csv = args.work / f"{name}.csv"
        shape = write_log(csv, args.rows, args.minutes, args.days, args.seed, one_day=name == "one_day")
        sets = ["--set", f"paths.data_root={root}"]
        if args.fresh or not (root / "raw").is_dir():
            subprocess.run(["rm", "-rf", str(root)], check=True)
            ingest_s = run([python, "-m", "pipelines.cli", "ingest", "--spec", str(spec_path), *sets, str(csv)],
                           args.repo, args.work / f"{name}-ingest.log")
        else:
            ingest_s = None
        end = START.timestamp() + (1 if name == "one_day" else args.days) * 86400
        interval = ["--start", START.isoformat(), "--end", datetime.fromtimestamp(end, UTC).isoformat()]
        overrides = [item for s in args.set for item in ("--set", s)]
        log = args.work / f"{name}-run.log"
        seconds = run([python, "-m", "pipelines.cli", "run", "daily", "--spec", str(spec_path), *sets, *overrides,
                       *interval, "--steps", args.steps], args.repo, log)
        results["layouts"][name] = {**shape, "ingest_seconds": ingest_s, "run_seconds": round(seconds, 1),
                                    "steps_seconds": step_seconds(log), "log": str(log)}
        if args.revalidate and "validate" in args.steps.split(","):
            # The same slices under a spec that differs in what no check reads: markers should hold.
            again = args.work / f"{name}-revalidate.log"
            run([python, "-m", "pipelines.cli", "run", "daily", "--spec", str(spec_path), *sets, *overrides,
                 "--set", "features.min_count=2", *interval, "--steps", "validate"], args.repo, again)
            results["layouts"][name]["validate_again_with_min_count_2_seconds"] = step_seconds(again)["validate"]
        print(json.dumps({name: results["layouts"][name]}), flush=True)
    results["cpu_count"], results["load_average_at_end"] = os.cpu_count(), [round(v, 2) for v in os.getloadavg()]
    if args.before:
        results["before"] = json.loads(args.before.read_text())
    command = "make bench-history" + (f" BENCH_HISTORY_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else "")
    results = {**provenance(command), **results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
