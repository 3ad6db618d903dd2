"""Manifests: the JSON record written last beside every dataset, feature state, checkpoint and model.

A reader trusts a directory only when its manifest exists and the checksums of the files it names match.
Directories are built under a temporary name and renamed into place, so a half-written output is never
mistaken for a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"


class ManifestError(RuntimeError):
    """A manifest is missing, malformed, or does not match the files beside it."""


@lru_cache(maxsize=1)
def format_hash() -> str:
    """A short hash of what every reader must agree on whatever the columns: the reserved vocabulary rows and
    the block TFRecord layout. The columns themselves are the feature spec's, recorded as its hash."""
    from components.block_codec import (
        BLOCK_CATEGORICAL_KEY,
        BLOCK_DENSE_KEY,
        BLOCK_LABEL_KEY,
        BLOCK_LAYOUT,
        BLOCK_NUM_ROWS_KEY,
    )
    from components.feature_spec import MISSING_ROW, RARE_ROW

    description = {
        "reserved_rows": {"rare": RARE_ROW, "missing": MISSING_ROW},
        "block_layout": BLOCK_LAYOUT,
        "block_keys": [BLOCK_NUM_ROWS_KEY, BLOCK_LABEL_KEY, BLOCK_DENSE_KEY, BLOCK_CATEGORICAL_KEY],
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@lru_cache(maxsize=1)
def code_version() -> str:
    """The git commit of the code that wrote an output (with '-dirty' for local changes), else 'unknown'."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def write_manifest(
    directory: str | Path,
    *,
    kind: str,
    version: str,
    files: Iterable[str],
    spec_hash: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    row_counts: Mapping[str, int] | None = None,
    extra: Mapping[str, Any] | None = None,
    created_at: datetime | None = None,
) -> dict[str, Any]:
    """Checksums `files` (paths relative to `directory`) and writes the manifest atomically, last.

    The manifest is a function of what it describes: no write time is recorded unless `created_at` is given
    (from the run's data interval, never the clock), so re-running a step writes byte-identical manifests.
    `spec_hash` is the hash of the feature spec the output was made with (components.feature_spec); readers
    that depend on the columns pass theirs to `read_manifest`."""
    directory = Path(directory)
    entries = {}
    for name in sorted(files):
        path = directory / name
        if not path.is_file():
            raise ManifestError(f"manifest for {directory} names {name!r}, which is not a file there")
        entries[name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    manifest = {
        "kind": kind,
        "version": version,
        "format_hash": format_hash(),
        **({"feature_spec_hash": spec_hash} if spec_hash is not None else {}),
        "code_version": code_version(),
        **({"created_at": created_at.isoformat()} if created_at is not None else {}),
        "inputs": dict(inputs or {}),
        "row_counts": dict(row_counts or {}),
        "files": entries,
        **dict(extra or {}),
    }
    write_json_atomic(directory / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(directory: str | Path, *, kind: str | None = None, verify: bool = True,
                  spec_hash: str | None = None) -> dict[str, Any]:
    """Reads and (by default) verifies a manifest. Given `spec_hash`, the output must have been made with that
    feature spec. Raises ManifestError with what is wrong."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{directory} has no {MANIFEST_NAME}: it is missing or was not completely written; "
            "re-run the step that produces it"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); re-run the step that produces it") from err
    if kind is not None and manifest.get("kind") != kind:
        raise ManifestError(f"{path} describes a {manifest.get('kind')!r}, expected a {kind!r}")
    if manifest.get("format_hash") != format_hash():
        raise ManifestError(
            f"{path} was written in format {manifest.get('format_hash')!r}, this code reads {format_hash()!r}; "
            "regenerate it with this code version"
        )
    if spec_hash is not None and manifest.get("feature_spec_hash") != spec_hash:
        raise ManifestError(
            f"{path} was made with feature spec {manifest.get('feature_spec_hash')!r}, this run uses {spec_hash!r}; "
            "re-run the step that produces it with this spec (features.spec), or run with the spec it was made with"
        )
    for name in manifest.get("files", {}):
        check_file_name(name, path)
    if verify:
        for name, entry in manifest.get("files", {}).items():
            file_path = directory / name
            if not file_path.is_file():
                raise ManifestError(f"{directory}: file {name!r} named in the manifest is missing")
            if file_path.stat().st_size != entry["bytes"] or file_sha256(file_path) != entry["sha256"]:
                raise ManifestError(f"{directory}: file {name!r} does not match its manifest checksum")
    return manifest


def check_file_name(name: str, manifest: str | Path) -> str:
    """A file name a manifest lists must stay inside its directory: a relative path without `..`, empty or
    absolute parts, backslashes or NUL (a manifest from a store is input like any other). Raises ManifestError."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\0" in name
            or any(part in ("", ".", "..") for part in parts)):
        raise ManifestError(f"{manifest} names the file {name!r}, which is not a plain relative path inside its "
                            "directory; refusing it (the manifest is corrupt or was not written by this pipeline)")
    return name


def write_json_atomic(path: str | Path, payload: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def staging_dir(final: str | Path) -> Path:
    """A fresh temporary sibling of `final` to build an output in before `commit_dir`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.staging")
    tmp.mkdir()
    return tmp


def commit_dir(staging: str | Path, final: str | Path) -> Path:
    """Moves a fully written `staging` directory (manifest included) to `final`, replacing an older one."""
    staging, final = Path(staging), Path(final)
    if not (staging / MANIFEST_NAME).is_file():
        raise ManifestError(f"refusing to commit {staging}: it has no {MANIFEST_NAME}")
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.replaced")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # Staging directories of earlier attempts at this output that died before committing (a killed task):
    # never trusted (no manifest, never renamed into place), removed once an attempt has committed.
    for stale in final.parent.glob(f".{final.name}.*.staging"):
        shutil.rmtree(stale, ignore_errors=True)
    return final
