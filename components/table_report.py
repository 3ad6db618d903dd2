"""The table report: what every embedding table holds after a run, and how the run used it.

Per table of the feature spec: rows in use, handed to new values, evicted and still free; the values waiting for
admission; how often the admitted values occurred (percentiles of their counts); the rows this run's training
changed; days since each admitted value was last seen (a row is trained only when its value occurs, so this is
the age of its last update, to the day); L2 norms of the rows; and the share of the training rows' lookups that
read the shared rare row or the missing row. A team tunes admission (`min_count`), eviction (`evict_after_days`)
and table sizes from it, and a row norm that grows without bound shows here before it shows in the loss.

Built from what a run leaves behind (the feature state, the checkpoint's weights, the samples' manifest), never
from the training process, so the daily and the minute runs make the same report, and `ctr-pipeline tables
VERSION` prints the one stored in a version's manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from components.feature_spec import MISSING_ROW, NUM_RESERVED_ROWS, RARE_ROW, FeatureSpec
from components.feature_state import FeatureState

TABLES_FILE = "tables.json"
# Days since an admitted value was last seen: bins [low, next low), the last one open.
AGE_BIN_LOWS = (0, 1, 2, 4, 8, 15, 31)
PERCENTILES = (50, 90, 99)
# The path of CategoricalEmbedding's concatenated table among a model's weights ("<model>/embedding/embeddings");
# multi-hash tables sit one level deeper ("<model>/embedding/hashed_feature_3/embeddings").
EMBEDDING_PATH_TAIL = ("embedding", "embeddings")


# A tiered table's norms are over at most this many of its rows in use, drawn without replacement with a fixed
# seed (the same rows from run to run while the rows in use stay): every run, a minute's too, reads a bounded
# part of a table larger than memory, not all of it. Percentiles of 65,536 draws sit within about half a
# percentile point of the whole table's.
NORM_SAMPLE_ROWS = 65_536

def day_date(day: int) -> str:
    """A day number (days since 1970-01-01 UTC, as the feature state counts them) as YYYY-MM-DD."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=int(day))).date().isoformat()


def age_bin_labels() -> list[str]:
    labels = []
    for low, high in zip(AGE_BIN_LOWS, (*AGE_BIN_LOWS[1:], None), strict=True):
        labels.append(f"{low}+" if high is None else str(low) if high == low + 1 else f"{low}-{high - 1}")
    return labels


def embedding_table(weight_specs: Sequence[Mapping[str, Any]], weights: Sequence[np.ndarray]) -> np.ndarray | None:
    """The model's concatenated embedding table among its weights (trainer.export.weight_specs order), or None
    when every table is hashed (no such weight)."""
    for spec, weight in zip(weight_specs, weights, strict=True):
        if tuple(str(spec["path"]).split("/")[-2:]) == EMBEDDING_PATH_TAIL:
            return np.asarray(weight)
    return None


def table_offsets(table_sizes: Mapping[str, int], hashed: Sequence[str]) -> dict[str, int]:
    """Where each table's rows start in the concatenated table: the tables in order, hashed ones left out (as
    CategoricalEmbedding lays them out)."""
    offsets, start = {}, 0
    for name, size in table_sizes.items():
        if name not in hashed:
            offsets[name] = start
            start += int(size)
    return offsets


def hashed_tables(spec: FeatureSpec, multi_hash_features: Sequence[str] = ()) -> list[str]:
    """The tables without rows of their own: the spec's `hashing` ones and train.multi_hash_features."""
    return [name for name, table in spec.tables().items() if table.hashing or name in multi_hash_features]


def changed_rows_by_table(embeddings: np.ndarray, table_sizes: Mapping[str, int], parent: np.ndarray,
                          parent_sizes: Mapping[str, int], hashed: Sequence[str]) -> dict[str, np.ndarray]:
    """Per table, the rows (table-local ids) whose values differ from the parent's. A row past the parent's
    table differs by definition. Tables the parent lacks are left out."""
    offsets, parent_offsets = table_offsets(table_sizes, hashed), table_offsets(parent_sizes, hashed)
    out = {}
    for name, offset in offsets.items():
        if name not in parent_offsets:
            continue
        size, common = int(table_sizes[name]), min(int(table_sizes[name]), int(parent_sizes[name]))
        start = parent_offsets[name]
        differ = np.any(embeddings[offset:offset + common] != parent[start:start + common], axis=1)
        out[name] = np.concatenate([np.flatnonzero(differ), np.arange(common, size)]).astype(np.int64)
    return out


def _percentiles(values: np.ndarray) -> dict[str, float] | None:
    if not len(values):
        return None
    points = np.percentile(values, PERCENTILES)
    return {**{f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)}, "max": float(values.max())}


def table_report(
    spec: FeatureSpec,
    state: FeatureState,
    *,
    kind: str,
    version: str,
    embeddings: np.ndarray | None,
    hashed: Sequence[str] = (),
    changed: Mapping[str, np.ndarray] | None = None,
    parent: str | None = None,
    since_day: int | None = None,
    samples: Mapping[str, Any] | None = None,
    tiered: Mapping[str, Mapping[str, Any]] | None = None,
    norm_sample_rows: int = NORM_SAMPLE_ROWS,
) -> dict[str, Any]:
    """The report of every table after a run.

    `embeddings`: the trained concatenated table (embedding_table); `changed`: per table the rows this run
    changed (changed_rows_by_table against `parent`, the version or checkpoint it started from). Without a
    parent, the rows counted as touched are those of values seen on or after `since_day` (the run's first day),
    plus the reserved rows the training rows read. `samples`: the training split's samples manifest (its
    row count and per-column rare and missing reads). `tiered`: per tiered table, `rows` (a function of row ids
    -> their values, read from its store) and `counters` (what its hot tier and store did in training,
    TieredTables.counters); its norms are over at most `norm_sample_rows` of its rows in use (`l2_norm_rows`)."""
    tables = spec.tables()
    sizes = state.table_sizes()
    tiered = dict(tiered or {})
    offsets = table_offsets(sizes, [*hashed, *tiered])
    candidates = state.candidates
    feature_of = candidates["feature"]
    num_rows = int(samples["row_counts"]["rows"]) if samples else 0
    rare_reads = dict(samples.get("rare_rows", {})) if samples else {}
    missing_reads = samples.get("missing_rows") if samples else None
    out: list[dict[str, Any]] = []  # a list: spec order survives manifests written with sorted keys
    for name, table in tables.items():
        vocabulary = state.vocabularies[name]
        waiting = candidates.filter(pc.equal(feature_of, name)) if candidates.num_rows else candidates
        in_use = np.asarray(vocabulary.rows, np.int64)
        counts = np.asarray(vocabulary.counts, np.int64)
        ages = state.day - np.asarray(vocabulary.last_seen, np.int64)
        columns = [f for f in table.features if f in spec.categorical_names]
        lookups = num_rows * len(columns)
        rare = sum(int(rare_reads.get(c, 0)) for c in columns)
        missing = sum(int(missing_reads.get(c, 0)) for c in columns) if missing_reads is not None else None
        entry: dict[str, Any] = {
            "name": name,
            "storage": "hashed" if name in hashed else "tiered" if name in tiered else "memory",
            "features": list(table.features),
            "min_count": table.min_count if table.min_count else state.min_count,
            "evict_after_days": table.evict_after_days,
            "rows": int(sizes[name]),
            "rows_in_use": len(in_use),
            "rows_free": len(vocabulary.free_rows) + max(0, int(sizes[name]) - vocabulary.num_rows),
            "rows_new": len(state.new_rows.get(name, ())),
            "rows_evicted": len(state.evicted_rows.get(name, ())),
            "waiting_for_admission": int(waiting.num_rows),
            "frequency": _percentiles(counts),
            "waiting_frequency": _percentiles(waiting["count"].to_numpy()) if waiting.num_rows else None,
            "age_days": {"bins": age_bin_labels(),
                         "rows": np.bincount(np.searchsorted(AGE_BIN_LOWS, np.maximum(ages, 0), side="right") - 1,
                                             minlength=len(AGE_BIN_LOWS)).tolist()},
            "lookups": lookups,
            "rare_share": rare / lookups if lookups else None,
            "missing_share": (missing / lookups if lookups and missing is not None else None),
        }
        if name in tiered:
            entry.update(_tiered_entry(tiered[name], in_use, since_day, vocabulary, rare, missing,
                                       changed.get(name) if changed is not None else None, norm_sample_rows))
        elif name in offsets and embeddings is not None:
            rows = embeddings[offsets[name]:offsets[name] + int(sizes[name])].astype(np.float64)
            norms = np.sqrt(np.sum(np.square(rows), axis=1))
            entry["l2_norm"] = _percentiles(norms[in_use])
            entry["rare_row_norm"], entry["missing_row_norm"] = float(norms[RARE_ROW]), float(norms[MISSING_ROW])
            entry["bytes"] = int(rows.shape[0] * rows.shape[1] * embeddings.dtype.itemsize)
            read = [row for row, count in ((RARE_ROW, rare), (MISSING_ROW, missing)) if count]
            if changed is not None and name in changed:
                # Rows reset when their value was evicted and not handed out again are not training's doing.
                live = np.zeros(int(sizes[name]), bool)
                live[in_use] = True
                live[:NUM_RESERVED_ROWS] = True
                touched = changed[name]
                entry["rows_touched"] = int(live[touched[touched < len(live)]].sum())
            elif since_day is not None:
                seen = np.asarray(vocabulary.last_seen, np.int64) >= since_day
                entry["rows_touched"] = int(seen.sum()) + len(read)
            else:
                entry["rows_touched"] = None
        out.append(entry)
    totals = {key: sum(int(t.get(key) or 0) for t in out)
              for key in ("rows", "rows_in_use", "rows_new", "rows_evicted", "waiting_for_admission", "rows_touched",
                          "bytes")}
    return {
        "kind": kind,
        "version": version,
        "day": state.day,
        "date": day_date(state.day),
        "feature_state": state.version,
        "parent": parent,
        "rows_touched_basis": ("rows whose values differ from the parent's" if changed is not None else
                               "rows of values seen in the run's interval (no parent to compare with)"),
        "training_rows": num_rows,
        "totals": totals,
        "tables": out,
    }


# Rows read at a time from a tiered table's store for the norms: the report never holds a whole table.
STORE_CHUNK_ROWS = 65_536


def _tiered_entry(table: Mapping[str, Any], in_use: np.ndarray, since_day: int | None, vocabulary: Any,
                  rare: int, missing: int | None, touched: np.ndarray | None,
                  sample_rows: int = NORM_SAMPLE_ROWS) -> dict[str, Any]:
    """A tiered table's norms (over at most `sample_rows` of its rows in use, read from its store a chunk at a
    time; `l2_norm_rows` says how many), rows touched (`touched`, the rows the run's batches read, where given;
    else the values seen in the run), hot-tier hit rate and the store's bytes read and written in training."""
    read_rows = table["rows"]
    sampled = in_use
    if len(in_use) > sample_rows:
        sampled = np.sort(np.random.default_rng(0).choice(in_use, sample_rows, replace=False))
    norms = np.concatenate([np.sqrt(np.sum(np.square(read_rows(sampled[i:i + STORE_CHUNK_ROWS]).astype(np.float64)),
                                           axis=1)) for i in range(0, len(sampled), STORE_CHUNK_ROWS)] or [np.zeros(0)])
    reserved = np.sqrt(np.sum(np.square(read_rows(np.asarray([RARE_ROW, MISSING_ROW])).astype(np.float64)), axis=1))
    counters = dict(table.get("counters") or {})
    hits, loads = counters.get("tier_rows_hit", 0), counters.get("tier_rows_loaded", 0)
    read = [row for row, count in ((RARE_ROW, rare), (MISSING_ROW, missing)) if count]
    seen = (int((np.asarray(vocabulary.last_seen, np.int64) >= since_day).sum()) + len(read)
            if since_day is not None else None)
    if touched is not None:
        seen = int(len(np.unique(touched)))
    return {
        "l2_norm": _percentiles(norms), "l2_norm_rows": int(len(sampled)),
        "rare_row_norm": float(reserved[0]), "missing_row_norm": float(reserved[1]),
        "bytes": int(table.get("bytes", 0)), "hot_rows": int(table.get("hot_rows", 0)), "rows_touched": seen,
        "hit_rate": hits / (hits + loads) if hits + loads else None,
        "rows_loaded": loads, "rows_written_back": counters.get("tier_rows_written_back", 0),
        "store_bytes_read": counters.get("store_bytes_read", 0),
        "store_bytes_written": counters.get("store_bytes_written", 0),
        # Rows the store drew from their seed (never written before), and of those the ones on pages that hold
        # no data, drawn without a read (trainer/row_store.py).
        "rows_drawn": counters.get("store_rows_fresh", 0), "rows_drawn_without_read": counters.get(
            "store_rows_in_holes", 0),
    }


def _number(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and digits:
        return f"{value:.{digits}f}"
    return f"{int(round(value)):,}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as the CLI prints it: one line per table, then the totals."""
    header = (f"{'table':<16} {'storage':<7} {'rows':>11} {'in use':>11} {'new':>8} {'evicted':>8} {'waiting':>9} "
              f"{'touched':>9} {'count p50/p99':>15} {'norm p50/p99':>13} {'rare':>6} {'missing':>7}")
    lines = [f"tables of {report['kind']} version {report['version']} (feature state {report['feature_state']} of "
             f"{report['date']}, {report['training_rows']:,} training rows; parent {report['parent'] or '-'})",
             header, "-" * len(header)]
    for t in report["tables"]:
        name = t["name"]
        frequency = t["frequency"] or {}
        norm = t.get("l2_norm") or {}
        lines.append(
            f"{name[:16]:<16} {t['storage']:<7} {_number(t['rows']):>11} {_number(t['rows_in_use']):>11} "
            f"{_number(t['rows_new']):>8} {_number(t['rows_evicted']):>8} {_number(t['waiting_for_admission']):>9} "
            f"{_number(t.get('rows_touched')):>9} "
            f"{_number(frequency.get('p50')) + '/' + _number(frequency.get('p99')):>15} "
            f"{_number(norm.get('p50'), 2) + '/' + _number(norm.get('p99'), 2):>13} "
            f"{_share(t['rare_share']):>6} {_share(t['missing_share']):>7}")
    totals = report["totals"]
    lines.append("-" * len(header))
    lines.append(f"{'all':<16} {'':<7} {_number(totals['rows']):>11} {_number(totals['rows_in_use']):>11} "
                 f"{_number(totals['rows_new']):>8} {_number(totals['rows_evicted']):>8} "
                 f"{_number(totals['waiting_for_admission']):>9} {_number(totals['rows_touched']):>9}   "
                 f"{totals['bytes'] / 1e6:,.1f} MB of embedding rows")
    for t in report["tables"]:
        if t["storage"] == "tiered" and "hot_rows" in t:
            hit = "-" if t.get("hit_rate") is None else f"{100 * t['hit_rate']:.1f} %"
            lines.append(f"tiered {t['name']}: {_number(t['hot_rows'])} hot rows, hit rate {hit}, "
                         f"{_number(t['rows_loaded'])} rows loaded, {_number(t['rows_written_back'])} written back; "
                         f"store {t['store_bytes_read'] / 1e6:,.1f} MB read, {t['store_bytes_written'] / 1e6:,.1f} MB "
                         "written in training"
                         + (f", {_number(t['rows_drawn'])} rows drawn from their seed "
                            f"({_number(t.get('rows_drawn_without_read', 0))} without a read)"
                            if t.get("rows_drawn") else "")
                         + (f"; norms of {_number(t['l2_norm_rows'])} rows drawn from its "
                            f"{_number(t['rows_in_use'])} in use" if t.get("l2_norm_rows", 0) < t["rows_in_use"]
                            else ""))
    lines.append(f"touched: {report['rows_touched_basis']}; count: occurrences of an admitted value so far; rare and "
                 "missing: the share of the training rows' lookups that read the shared rare or missing row")
    return "\n".join(lines)


def plot_report(report: Mapping[str, Any], path: Path) -> Path:
    """Four panels, tables side by side: rows (in use, new, evicted, free, waiting), the share of lookups that
    read the rare and the missing row, row norms (p50 to p99), and days since last seen (all tables)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = {t["name"]: t for t in report["tables"]}
    names = list(tables)
    x = np.arange(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(max(10.0, 0.45 * len(names) + 4), 7.5))
    ax = axes[0][0]
    bottom = np.zeros(len(names))
    for key, label in (("rows_in_use", "in use"), ("rows_free", "free"), ("waiting_for_admission", "waiting")):
        values = np.array([tables[n][key] or 0 for n in names], float)
        ax.bar(x, values, bottom=bottom, label=label)
        bottom += values
    for key, marker, label in (("rows_new", "k^", "new this run"), ("rows_evicted", "rv", "evicted this run")):
        values = np.array([tables[n][key] for n in names], float)
        shown = values > 0  # nothing to mark where there were none
        ax.plot(x[shown], values[shown], marker, label=label)
    ax.set_yscale("log")
    ax.set_title("rows", pad=22)
    ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax = axes[0][1]
    rare = [100 * (tables[n]["rare_share"] or 0) for n in names]
    missing = [100 * (tables[n]["missing_share"] or 0) for n in names]
    ax.bar(x - 0.2, rare, 0.4, label="rare row")
    ax.bar(x + 0.2, missing, 0.4, label="missing row")
    ax.set_title("training lookups that read a shared row (%)", pad=22)
    ax.legend(fontsize=7, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax = axes[1][0]
    for position, name in enumerate(names):
        norm = tables[name].get("l2_norm")
        if norm:
            ax.vlines(position, norm["p50"], norm["p99"], color="tab:blue")
            ax.plot(position, norm["p50"], "o", color="tab:blue")
            ax.plot(position, norm["max"], "x", color="tab:red")
    ax.set_title("row L2 norm: p50 (dot) to p99, max (x)")
    ax = axes[1][1]
    labels = age_bin_labels()
    ages = np.sum([tables[n]["age_days"]["rows"] for n in names], axis=0)
    ax.bar(labels, ages)
    ax.set_title("admitted rows by days since last seen")
    ax.set_xlabel("days")
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=90, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"tables after {report['kind']} version {report['version']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
