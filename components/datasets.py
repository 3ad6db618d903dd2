"""Real public click logs the project can train on, fetched at run time from the package index.

Two real logs ship inside wheels on PyPI. Their terms allow research use and forbid redistribution, so the
project never commits them: `fetch_dataset` downloads the wheel (`pip download --no-deps`, into a cache
directory), reads its members straight from the zip, and writes one CSV that `ctr-pipeline ingest --spec <name>` reads
with the preset of the same name (components/feature_specs/<name>.yaml):

- movielens: MovieLens 100K in recbole 1.2.1 (recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}):
  100,000 ratings of 1,682 movies by 943 users with their Unix timestamps. Each rating is a row; its label
  `liked` is rating >= 4 (the rating itself is left out: it is the label). The user's age, gender, occupation
  and zip code and the movie's release year and genres (`genres`, "|"-separated) are joined on; the title is
  left out (one per movie, so it says no more than item_id).
- obd: the Open Bandit Dataset in obp 0.4.1 (obp/dataset/obd/<policy>/<campaign>/<campaign>.csv): 10,000
  real impressions of a fashion site per policy (random, bts) and campaign (all, men, women), with `click`,
  the impression time (as whole Unix seconds), item_id, position and four hashed user features; the item's
  four features (item_context.csv) are joined on. The 80 user-item affinities and the logging policy's
  propensity score are left out (the propensity is a property of the policy, not of the user or the item).

Rows are written in time order (ties by the other key columns), so a split by time is a split by row.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOVIELENS = "movielens"
OBD = "obd"
DATASET_NAMES = (MOVIELENS, OBD)
OBD_POLICIES = ("random", "bts", "both")  # both: the two policies' logs of the campaign, one time line
OBD_CAMPAIGNS = ("all", "men", "women")
LIKED_AT_LEAST = 4  # MovieLens: a rating of 4 or 5 is a positive


@dataclass(frozen=True)
class Wheel:
    """The pinned wheel that carries a dataset."""

    package: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return f"{self.package}-{self.version}-py3-none-any.whl"


WHEELS = {MOVIELENS: Wheel("recbole", "1.2.1"), OBD: Wheel("obp", "0.4.1")}
MOVIELENS_MEMBER = "recbole/dataset_example/ml-100k/ml-100k"
MOVIELENS_COLUMNS = ("liked", "timestamp", "user_id", "item_id", "age", "gender", "occupation", "zip_code",
                     "release_year", "genres")
OBD_MEMBER = "obp/dataset/obd"
OBD_USER_FEATURES = tuple(f"user_feature_{i}" for i in range(4))
OBD_ITEM_FEATURES = tuple(f"item_feature_{i}" for i in range(4))
OBD_COLUMNS = ("click", "timestamp", "item_id", "position", *OBD_USER_FEATURES, *OBD_ITEM_FEATURES)


class DatasetError(RuntimeError):
    """A dataset cannot be fetched or read: the message says what failed and how to get past it."""


@dataclass(frozen=True)
class DatasetReport:
    name: str
    path: str
    rows: int
    positives: int
    first_timestamp: int
    last_timestamp: int
    wheel: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def pip_command() -> list[str]:
    """A pip that can download: this interpreter's own when it has one, else the first `pip3`/`pip` on PATH
    (a uv-built environment has no pip of its own)."""
    try:
        import pip  # noqa: F401

        return [sys.executable, "-m", "pip"]
    except ImportError:
        pass
    for name in ("pip3", "pip"):
        found = shutil.which(name)
        if found:
            return [found]
    raise DatasetError("no pip to download the dataset's wheel with: this Python has none and neither pip3 nor pip "
                       "is on PATH; install pip, or download the wheel yourself into the --cache directory")


def fetch_wheel(wheel: Wheel, cache_dir: str | Path, *, timeout_s: float = 300.0) -> Path:
    """The wheel's path in `cache_dir`, downloaded with `pip download --no-deps` when it is not there yet.
    Raises DatasetError with pip's own message when the index cannot be reached."""
    cache_dir = Path(cache_dir)
    target = cache_dir / wheel.file_name
    if target.is_file() and zipfile.is_zipfile(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               wheel.requirement, "-d", str(cache_dir)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        raise DatasetError(f"`{' '.join(command)}` did not finish in {timeout_s:.0f} s: is the package index "
                           "reachable? Put the wheel in the cache directory by hand to work offline") from err
    if done.returncode != 0 or not target.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise DatasetError(f"could not download {wheel.requirement} from the package index (exit {done.returncode}: "
                           f"{' / '.join(tail) or 'no output'}); check the network or pip's index settings, or put "
                           f"{wheel.file_name} into {cache_dir} by hand")
    return target


def _member(archive: zipfile.ZipFile, name: str) -> str:
    try:
        return archive.read(name).decode("utf-8", errors="replace")
    except KeyError as err:
        raise DatasetError(f"{archive.filename} has no member {name!r}: not the expected wheel; delete it from the "
                           "cache directory and fetch again") from err


def _write_csv(header: tuple[str, ...], rows: Iterable[list[str]], out: Path) -> None:
    """Writes a CSV with a header under a temporary name, then renames it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(tmp, out)


def movielens_rows(wheel_path: str | Path) -> list[list[str]]:
    """MovieLens 100K as rows of MOVIELENS_COLUMNS (see the module's doc), in time order."""
    with zipfile.ZipFile(wheel_path) as archive:
        tables = {part: _atomic_table(_member(archive, f"{MOVIELENS_MEMBER}.{part}"))
                  for part in ("inter", "user", "item")}
    users = {row["user_id"]: row for row in tables["user"]}
    items = {row["item_id"]: row for row in tables["item"]}
    rows = []
    for rating in tables["inter"]:
        user = users.get(rating["user_id"], {})
        item = items.get(rating["item_id"], {})
        liked = "1" if float(rating["rating"]) >= LIKED_AT_LEAST else "0"
        rows.append([liked, str(int(float(rating["timestamp"]))), rating["user_id"], rating["item_id"],
                     user.get("age", ""), user.get("gender", ""), user.get("occupation", ""),
                     user.get("zip_code", ""), item.get("release_year", ""),
                     "|".join(item.get("class", "").split())])
    rows.sort(key=lambda r: (int(r[1]), int(r[2]), int(r[3])))
    return rows


def _atomic_table(text: str) -> list[dict[str, str]]:
    """A recbole atomic file (tab-separated, a header of name:type) as dicts by name."""
    lines = text.splitlines()
    if not lines:
        return []
    names = [field.split(":")[0] for field in lines[0].split("\t")]
    return [dict(zip(names, line.split("\t"), strict=False)) for line in lines[1:] if line]


def obd_rows(wheel_path: str | Path, policy: str = "both", campaign: str = "all") -> list[list[str]]:
    """The Open Bandit log of (policy, campaign) as rows of OBD_COLUMNS (see the module's doc), in time order.
    Both policies ran in the same week on the same items, so `both` is one log of twice the rows."""
    if policy not in OBD_POLICIES:
        raise DatasetError(f"OBD policy {policy!r} is not one of {list(OBD_POLICIES)}")
    if campaign not in OBD_CAMPAIGNS:
        raise DatasetError(f"OBD campaign {campaign!r} is not one of {list(OBD_CAMPAIGNS)}")
    rows = []
    with zipfile.ZipFile(wheel_path) as archive:
        for name in (("random", "bts") if policy == "both" else (policy,)):
            folder = f"{OBD_MEMBER}/{name}/{campaign}"
            log = csv.DictReader(io.StringIO(_member(archive, f"{folder}/{campaign}.csv")))
            context = csv.DictReader(io.StringIO(_member(archive, f"{folder}/item_context.csv")))
            items = {row["item_id"]: row for row in context}
            for record in log:
                item = items.get(record["item_id"], {})
                seconds = int(datetime.fromisoformat(record["timestamp"]).timestamp())
                rows.append([record["click"], str(seconds), record["item_id"], record["position"],
                             *(record[key] for key in OBD_USER_FEATURES),
                             *(item.get(key, "") for key in OBD_ITEM_FEATURES)])
    rows.sort(key=lambda r: (int(r[1]), int(r[2]), int(r[3])))
    return rows


def fetch_dataset(name: str, out_dir: str | Path, *, cache_dir: str | Path, policy: str = "both",
                  campaign: str = "all") -> DatasetReport:
    """Writes dataset `name` (DATASET_NAMES) as `out_dir`/<file>.csv for `ctr-pipeline ingest --spec <name>`, fetching
    its wheel into `cache_dir` first when needed. `policy` and `campaign` choose the OBD log."""
    if name not in DATASET_NAMES:
        raise DatasetError(f"unknown dataset {name!r}; expected one of {', '.join(DATASET_NAMES)}")
    wheel = WHEELS[name]
    path = fetch_wheel(wheel, cache_dir)
    if name == MOVIELENS:
        rows, header, out = movielens_rows(path), MOVIELENS_COLUMNS, Path(out_dir) / f"{MOVIELENS}.csv"
    else:
        rows, header = obd_rows(path, policy, campaign), OBD_COLUMNS
        out = Path(out_dir) / f"{OBD}-{policy}-{campaign}.csv"
    _write_csv(header, rows, out)
    return DatasetReport(name=name, path=str(out), rows=len(rows), positives=sum(r[0] == "1" for r in rows),
                         first_timestamp=int(rows[0][1]) if rows else 0,
                         last_timestamp=int(rows[-1][1]) if rows else 0, wheel=wheel.requirement)
