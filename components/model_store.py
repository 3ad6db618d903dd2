"""The model store: versioned model directories in a local folder or under an S3 prefix.

Layout: <store>/<model_name>/<version>/{...files, manifest.json}. Versions are integers as strings (the
TF-Serving convention), increasing with the data they were trained on. A version exists only once its
manifest is there: locally the version is built in a staging directory and renamed into place; on S3 every
object is uploaded before the manifest object. A version is a full model or a delta on its parent version.

Rollback retracts versions: <store>/<model_name>/_retracted/<version>.json records why. `latest` skips
retracted versions, so serving moves back to the newest version still standing and the next incremental run
trains on from it; retracted versions stay in the store for inspection.

Promotion marks a version as trusted: <store>/<model_name>/_promoted/<version>.json records who and why. The
two version labels follow from the markers (TF Serving's /labels/{label}): `stable` is the newest promoted
version still standing, `canary` the newest standing version when it is newer than that (not yet promoted).

Every publish, retraction and promotion rewrites <store>/<model_name>/_changed.json last. `changed` reads it (one
small read, one HEAD on S3), so a reader can look for news often and list the store only when there are some;
listing stays the truth (a store changed by hand, without the marker, is seen at the next listing).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from components.manifest import (
    MANIFEST_NAME,
    ManifestError,
    check_file_name,
    commit_dir,
    read_manifest,
    staging_dir,
    write_json_atomic,
)


class ModelStoreError(RuntimeError):
    """A version is missing, incomplete or corrupt in the model store."""


class ModelStore(Protocol):
    uri: str

    def changed(self, model_name: str) -> str | None: ...

    def publish(self, model_name: str, version: str, source: Path) -> str: ...
    def versions(self, model_name: str) -> list[str]: ...
    def manifest(self, model_name: str, version: str) -> dict[str, Any]: ...
    def fetch(self, model_name: str, version: str, cache_dir: Path) -> Path: ...

    def latest(self, model_name: str) -> str | None: ...
    def retract(self, model_name: str, version: str, reason: str) -> None: ...
    def promote(self, model_name: str, version: str, reason: str) -> None: ...
    def promoted(self, model_name: str) -> set[str]: ...
    def stable(self, model_name: str) -> str | None: ...
    def labels(self, model_name: str) -> dict[str, str]: ...
    def latest_full(self, model_name: str) -> str | None: ...
    def retracted(self, model_name: str) -> set[str]: ...


def _is_version(name: str) -> bool:
    # str.isdigit alone admits "²" and other Unicode digits, which int() (the sort key) rejects.
    return name.isascii() and name.isdigit()


def _check_version(version: str) -> None:
    if not _is_version(version):
        raise ModelStoreError(f"model version {version!r} must be a decimal integer, e.g. 202601020000")


CHANGED_NAME = "_changed.json"
RETRACTED_DIR = "_retracted"
PROMOTED_DIR = "_promoted"
STABLE_LABEL = "stable"
CANARY_LABEL = "canary"
LABELS = (STABLE_LABEL, CANARY_LABEL)
# A marker per full model (the start of a delta chain), written after its manifest: incremental runs find the
# newest full model without reading every version's manifest.
FULL_MODELS_DIR = "_full"
FULL_KIND = "full_model"


def _is_full(source: Path) -> bool:
    return json.loads((source / MANIFEST_NAME).read_text()).get("kind") == FULL_KIND


class _Standing:
    """What both stores derive from their version list and their marker folders (`_markers`)."""

    def versions(self, model_name: str) -> list[str]:
        raise NotImplementedError

    def _markers(self, model_name: str, folder: str) -> set[str]:
        raise NotImplementedError

    def _write_marker(self, model_name: str, folder: str, version: str, body: dict[str, Any]) -> None:
        raise NotImplementedError

    def _write_changed(self, model_name: str, body: dict[str, Any]) -> None:
        raise NotImplementedError

    def _mark_changed(self, model_name: str, change: str) -> None:
        """Rewrites the change marker (last, after the change itself); unique per change."""
        self._write_changed(model_name, {"change": change, "at": datetime.now(UTC).isoformat(),
                                         "id": uuid.uuid4().hex})

    def retracted(self, model_name: str) -> set[str]:
        return self._markers(model_name, RETRACTED_DIR)

    def retract(self, model_name: str, version: str, reason: str) -> None:
        _check_version(version)
        self._write_marker(model_name, RETRACTED_DIR, version, {"version": version, "reason": reason})
        self._mark_changed(model_name, f"retract {version}")

    def promoted(self, model_name: str) -> set[str]:
        return self._markers(model_name, PROMOTED_DIR)

    def promote(self, model_name: str, version: str, reason: str) -> None:
        _check_version(version)
        self._write_marker(model_name, PROMOTED_DIR, version,
                           {"version": version, "reason": reason, "promoted_at": _now_iso()})
        self._mark_changed(model_name, f"promote {version}")

    def stable(self, model_name: str) -> str | None:
        """The newest promoted version that is not retracted: what label `stable` names."""
        return _latest_standing(sorted(self.promoted(model_name), key=int), self.retracted(model_name))

    def labels(self, model_name: str) -> dict[str, str]:
        """Label -> version: `stable` (the newest promoted version standing) and `canary` (the newest standing
        version, when it is newer than `stable`); a label that names no version is left out."""
        stable, latest = self.stable(model_name), self.latest(model_name)
        out = {STABLE_LABEL: stable} if stable is not None else {}
        if latest is not None and (stable is None or int(latest) > int(stable)):
            out[CANARY_LABEL] = latest
        return out

    def latest(self, model_name: str) -> str | None:
        """The newest version that is not retracted."""
        return _latest_standing(self.versions(model_name), self.retracted(model_name))

    def latest_full(self, model_name: str) -> str | None:
        """The newest full model that is not retracted."""
        return _latest_standing(sorted(self._markers(model_name, FULL_MODELS_DIR), key=int),
                                self.retracted(model_name))


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _latest_standing(versions: list[str], retracted: set[str]) -> str | None:
    standing = [v for v in versions if v not in retracted]
    return standing[-1] if standing else None


def _check_source(source: Path) -> None:
    if not (source / MANIFEST_NAME).is_file():
        raise ModelStoreError(f"cannot publish {source}: it has no {MANIFEST_NAME}; export the model first")
    read_manifest(source)


class LocalModelStore(_Standing):
    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self.uri = str(self.root)

    def publish(self, model_name: str, version: str, source: Path) -> str:
        """Copies an exported model directory (with its manifest) into the store as `version`."""
        _check_version(version)
        _check_source(Path(source))
        final = self.root / model_name / version
        staging = staging_dir(final)
        shutil.rmtree(staging)
        shutil.copytree(source, staging)
        commit_dir(staging, final)
        if _is_full(Path(source)):
            write_json_atomic(self.root / model_name / FULL_MODELS_DIR / f"{version}.json", {"version": version})
        self._mark_changed(model_name, f"publish {version}")
        return str(final)

    def _write_changed(self, model_name: str, body: dict[str, Any]) -> None:
        write_json_atomic(self.root / model_name / CHANGED_NAME, body)

    def changed(self, model_name: str) -> str | None:
        """The change marker's content, or None before the first change."""
        try:
            return (self.root / model_name / CHANGED_NAME).read_text()
        except FileNotFoundError:
            return None

    def versions(self, model_name: str) -> list[str]:
        base = self.root / model_name
        if not base.is_dir():
            return []
        found = [p.name for p in base.iterdir() if _is_version(p.name) and (p / MANIFEST_NAME).is_file()]
        return sorted(found, key=int)

    def _write_marker(self, model_name: str, folder: str, version: str, body: dict[str, Any]) -> None:
        write_json_atomic(self.root / model_name / folder / f"{version}.json", body)

    def _markers(self, model_name: str, folder: str) -> set[str]:
        base = self.root / model_name / folder
        return {p.stem for p in base.glob("*.json") if _is_version(p.stem)} if base.is_dir() else set()

    def manifest(self, model_name: str, version: str) -> dict[str, Any]:
        path = self.root / model_name / version / MANIFEST_NAME
        if not path.is_file():
            raise ModelStoreError(f"version {version} of {model_name!r} is not in {self.uri}")
        return json.loads(path.read_text())

    def fetch(self, model_name: str, version: str, cache_dir: Path) -> Path:
        """Returns a local directory holding the version, after verifying its checksums."""
        directory = self.root / model_name / version
        try:
            read_manifest(directory)
        except ManifestError as err:
            raise ModelStoreError(f"version {version} of {model_name!r} is corrupt or incomplete: {err}") from err
        return directory


class S3ModelStore(_Standing):
    def __init__(self, uri: str, endpoint_url: str = "", client: Any = None):
        if not uri.startswith("s3://"):
            raise ModelStoreError(f"S3 model store URI must start with s3://, got {uri!r}")
        self.uri = uri.rstrip("/")
        bucket, _, prefix = self.uri[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix
        if client is None:
            import boto3

            client = boto3.client("s3", endpoint_url=endpoint_url or None)
        self.client = client

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def publish(self, model_name: str, version: str, source: Path) -> str:
        _check_version(version)
        source = Path(source)
        _check_source(source)
        files = sorted(p for p in source.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
        for path in files:  # every object first ...
            key = self._key(model_name, version, str(path.relative_to(source)))
            self.client.upload_file(str(path), self.bucket, key)
        # ... the manifest last: readers ignore a version without one.
        self.client.upload_file(str(source / MANIFEST_NAME), self.bucket, self._key(model_name, version, MANIFEST_NAME))
        if _is_full(source):
            self.client.put_object(Bucket=self.bucket, Key=self._key(model_name, FULL_MODELS_DIR, f"{version}.json"),
                                   Body=json.dumps({"version": version}).encode())
        self._mark_changed(model_name, f"publish {version}")
        return f"{self.uri}/{model_name}/{version}"

    def _write_changed(self, model_name: str, body: dict[str, Any]) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(model_name, CHANGED_NAME),
                               Body=json.dumps(body).encode())

    def changed(self, model_name: str) -> str | None:
        """The change marker's ETag (a HEAD request), or None before the first change."""
        try:
            return str(self.client.head_object(Bucket=self.bucket, Key=self._key(model_name, CHANGED_NAME))["ETag"])
        except self.client.exceptions.ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def versions(self, model_name: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        found = set()
        base = self._key(model_name) + "/"
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
            for item in page.get("Contents", []):
                version, _, rest = item["Key"][len(base):].partition("/")
                if rest == MANIFEST_NAME and _is_version(version):
                    found.add(version)
        return sorted(found, key=int)

    def _write_marker(self, model_name: str, folder: str, version: str, body: dict[str, Any]) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(model_name, folder, f"{version}.json"),
                               Body=json.dumps(body).encode())

    def _markers(self, model_name: str, folder: str) -> set[str]:
        base = self._key(model_name, folder) + "/"
        found = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for item in page.get("Contents", []):
                stem = item["Key"][len(base):].removesuffix(".json")
                if _is_version(stem):
                    found.add(stem)
        return found

    def manifest(self, model_name: str, version: str) -> dict[str, Any]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(model_name, version, MANIFEST_NAME))["Body"]
        except self.client.exceptions.NoSuchKey as err:
            raise ModelStoreError(f"version {version} of {model_name!r} is not in {self.uri}") from err
        return json.loads(body.read())

    def fetch(self, model_name: str, version: str, cache_dir: Path) -> Path:
        final = Path(cache_dir) / model_name / version
        if final.is_dir():
            try:
                read_manifest(final)
                return final
            except ManifestError:
                shutil.rmtree(final)
        manifest = self.manifest(model_name, version)
        try:
            for name in manifest["files"]:  # checked before anything is written: the names become local paths
                check_file_name(name, f"{self.uri}/{model_name}/{version}/{MANIFEST_NAME}")
        except ManifestError as err:
            raise ModelStoreError(f"version {version} of {model_name!r} is refused: {err}") from err
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{version}."))
        for name in manifest["files"]:
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.bucket, self._key(model_name, version, name), str(target))
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest))
        try:
            read_manifest(staging)
        except ManifestError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise ModelStoreError(f"version {version} of {model_name!r} in {self.uri} is corrupt: {err}") from err
        return commit_dir(staging, final)


def open_model_store(uri: str, endpoint_url: str = "") -> ModelStore:
    if uri.startswith("s3://"):
        return S3ModelStore(uri, endpoint_url=endpoint_url)
    if "://" in uri:
        raise ModelStoreError(f"model store {uri!r} is neither a local directory nor an s3:// URI")
    return LocalModelStore(uri)


def rollback(store: ModelStore, model_name: str, version: str, reason: str) -> list[str]:
    """Retracts every standing version newer than `version`, so that serving moves back to it and incremental
    training continues from it. Returns the versions retracted (newest last)."""
    _check_version(version)
    versions = store.versions(model_name)
    retracted = store.retracted(model_name)
    if version not in versions:
        raise ModelStoreError(f"cannot roll back to version {version} of {model_name!r}: it is not in {store.uri}; "
                              f"the newest versions there are {versions[-5:]}")
    if version in retracted:
        raise ModelStoreError(f"cannot roll back to version {version} of {model_name!r}: it was retracted itself")
    newer = [v for v in versions if int(v) > int(version) and v not in retracted]
    for newer_version in newer:
        store.retract(model_name, newer_version, f"rolled back to {version}: {reason}")
    return newer


def promote(store: ModelStore, model_name: str, version: str | None, reason: str) -> str:
    """Marks `version` (default: the newest standing one) promoted, so that label `stable` names it and
    `canary` names only newer versions. Returns the version promoted."""
    if version is None:
        version = store.latest(model_name)
        if version is None:
            raise ModelStoreError(f"cannot promote: {store.uri} holds no standing version of {model_name!r}")
    _check_version(version)
    versions = store.versions(model_name)
    if version not in versions:
        raise ModelStoreError(f"cannot promote version {version} of {model_name!r}: it is not in {store.uri}; "
                              f"the newest versions there are {versions[-5:]}")
    if version in store.retracted(model_name):
        raise ModelStoreError(f"cannot promote version {version} of {model_name!r}: it was retracted "
                              f"(see {RETRACTED_DIR}/{version}.json in the store)")
    store.promote(model_name, version, reason)
    return version
