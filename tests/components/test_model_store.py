from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from components.manifest import MANIFEST_NAME, ManifestError, write_manifest
from components.model_store import (
    LocalModelStore,
    ModelStoreError,
    S3ModelStore,
    open_model_store,
    promote,
    rollback,
)

MODEL = "ctr"


def _export(directory: Path, weights: bytes = b"weights-v1") -> Path:
    """A tiny exported model: a nested SavedModel-like tree and its manifest."""
    (directory / "variables").mkdir(parents=True)
    (directory / "saved_model.pb").write_bytes(b"graph")
    (directory / "variables" / "variables.data").write_bytes(weights)
    write_manifest(directory, kind="model", version="1", files=["saved_model.pb", "variables/variables.data"])
    return directory


# ---------------------------------------------------------------- local store


@pytest.mark.unit
def test_local_publish_versions_latest_fetch_manifest(tmp_path):
    store = LocalModelStore(tmp_path / "store")
    assert store.versions(MODEL) == []
    assert store.latest(MODEL) is None

    path = store.publish(MODEL, "202601020000", _export(tmp_path / "a", b"old"))
    assert path == str(tmp_path / "store" / MODEL / "202601020000")
    store.publish(MODEL, "202601030000", _export(tmp_path / "b", b"new"))
    store.publish(MODEL, "99", _export(tmp_path / "c", b"oldest"))

    assert store.versions(MODEL) == ["99", "202601020000", "202601030000"]  # numeric order, not text order
    assert store.latest(MODEL) == "202601030000"
    fetched = store.fetch(MODEL, "202601030000", tmp_path / "cache")
    assert (fetched / "variables" / "variables.data").read_bytes() == b"new"
    manifest = store.manifest(MODEL, "202601020000")
    assert manifest["kind"] == "model"
    assert set(manifest["files"]) == {"saved_model.pb", "variables/variables.data"}
    assert store.uri == str(tmp_path / "store")


@pytest.mark.unit
def test_local_republish_replaces_the_version(tmp_path):
    store = LocalModelStore(tmp_path / "store")
    store.publish(MODEL, "1", _export(tmp_path / "a", b"first"))
    store.publish(MODEL, "1", _export(tmp_path / "b", b"second"))
    assert store.versions(MODEL) == ["1"]
    assert (
        store.fetch(MODEL, "1", tmp_path / "cache") / "variables" / "variables.data"
    ).read_bytes() == b"second"
    assert sorted(p.name for p in (tmp_path / "store" / MODEL).iterdir()) == ["1", "_changed.json"]


@pytest.mark.unit
def test_local_versions_ignore_dirs_without_manifest(tmp_path):
    store = LocalModelStore(tmp_path / "store")
    store.publish(MODEL, "5", _export(tmp_path / "a"))
    half = tmp_path / "store" / MODEL / "7"
    half.mkdir()
    (half / "saved_model.pb").write_bytes(b"half-copied")
    (tmp_path / "store" / MODEL / "notes").mkdir()
    superscript = _export(tmp_path / "store" / MODEL / "2\u00b2")  # a digit to isdigit(), not to int()
    assert (superscript / MANIFEST_NAME).is_file()
    assert store.versions(MODEL) == ["5"]
    assert store.latest(MODEL) == "5"
    with pytest.raises(
        ModelStoreError, match=r"version 7 of 'ctr' is corrupt or incomplete: .*has no manifest\.json"
    ):
        store.fetch(MODEL, "7", tmp_path / "cache")
    with pytest.raises(ModelStoreError, match=r"version 7 of 'ctr' is not in "):
        store.manifest(MODEL, "7")


@pytest.mark.unit
@pytest.mark.parametrize("version", ["v1", "1.0", "", "-1", "../1", "2\u00b2", "\u0663"])
def test_local_non_integer_version_is_rejected(tmp_path, version):
    store = LocalModelStore(tmp_path / "store")
    with pytest.raises(
        ModelStoreError, match=rf"model version {re.escape(repr(version))} must be a decimal integer"
    ):
        store.publish(MODEL, version, _export(tmp_path / "a"))
    assert store.versions(MODEL) == []


@pytest.mark.unit
def test_local_publish_refuses_a_source_without_manifest(tmp_path):
    source = tmp_path / "export"
    source.mkdir()
    (source / "saved_model.pb").write_bytes(b"graph")
    store = LocalModelStore(tmp_path / "store")
    with pytest.raises(ModelStoreError, match=r"has no manifest\.json; export the model first"):
        store.publish(MODEL, "1", source)
    assert store.versions(MODEL) == []


@pytest.mark.unit
def test_local_publish_refuses_a_corrupt_source(tmp_path):
    source = _export(tmp_path / "export")
    (source / "saved_model.pb").write_bytes(b"GRAPH")
    store = LocalModelStore(tmp_path / "store")
    with pytest.raises(ManifestError, match=r"file 'saved_model\.pb' does not match its manifest checksum"):
        store.publish(MODEL, "1", source)
    assert store.versions(MODEL) == []


@pytest.mark.unit
def test_local_fetch_of_a_tampered_version_raises(tmp_path):
    store = LocalModelStore(tmp_path / "store")
    store.publish(MODEL, "3", _export(tmp_path / "a"))
    (tmp_path / "store" / MODEL / "3" / "variables" / "variables.data").write_bytes(b"tampered!!")
    with pytest.raises(
        ModelStoreError,
        match=r"version 3 of 'ctr' is corrupt or incomplete: "
        r".*file 'variables/variables\.data' does not match",
    ):
        store.fetch(MODEL, "3", tmp_path / "cache")


@pytest.mark.unit
def test_open_model_store_picks_the_backend(tmp_path):
    assert isinstance(open_model_store(str(tmp_path)), LocalModelStore)
    with pytest.raises(
        ModelStoreError, match=r"model store 'gs://b/p' is neither a local directory nor an s3:// URI"
    ):
        open_model_store("gs://b/p")
    with pytest.raises(ModelStoreError, match=r"S3 model store URI must start with s3://, got '/tmp/x'"):
        S3ModelStore("/tmp/x", client=object())


# ------------------------------------------------------------ S3 store (moto)

BUCKET = "models"


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_client(s3_endpoint):
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    yield client
    # Each test starts from an empty bucket.
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    client.delete_bucket(Bucket=BUCKET)


def _keys(client) -> list[str]:
    return sorted(item["Key"] for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", []))


@pytest.mark.integration
def test_s3_publish_versions_latest_fetch_manifest(tmp_path, s3_client):
    store = S3ModelStore(f"s3://{BUCKET}/prod/", client=s3_client)
    assert store.uri == f"s3://{BUCKET}/prod"
    assert store.versions(MODEL) == []
    assert store.latest(MODEL) is None

    assert (
        store.publish(MODEL, "202601020000", _export(tmp_path / "a", b"old"))
        == f"s3://{BUCKET}/prod/ctr/202601020000"
    )
    store.publish(MODEL, "202601030000", _export(tmp_path / "b", b"new"))
    store.publish(MODEL, "99", _export(tmp_path / "c", b"oldest"))
    assert "prod/ctr/202601030000/variables/variables.data" in _keys(s3_client)
    assert len(_keys(s3_client)) == 10  # three versions of three objects, and the change marker
    assert "prod/ctr/_changed.json" in _keys(s3_client)

    assert store.versions(MODEL) == ["99", "202601020000", "202601030000"]
    assert store.latest(MODEL) == "202601030000"
    manifest = store.manifest(MODEL, "202601020000")
    assert manifest["files"]["variables/variables.data"]["bytes"] == 3

    cache = tmp_path / "cache"
    fetched = store.fetch(MODEL, "202601030000", cache)
    assert fetched == cache / MODEL / "202601030000"
    assert (fetched / "variables" / "variables.data").read_bytes() == b"new"
    assert (fetched / "saved_model.pb").read_bytes() == b"graph"
    assert (
        json.loads((fetched / MANIFEST_NAME).read_text())["files"]
        == store.manifest(MODEL, "202601030000")["files"]
    )
    # Only the committed version is left in the cache, no staging dir.
    assert [p.name for p in (cache / MODEL).iterdir()] == ["202601030000"]


@pytest.mark.integration
def test_s3_fetch_uses_a_valid_cache_and_replaces_a_damaged_one(tmp_path, s3_client):
    store = S3ModelStore(f"s3://{BUCKET}", client=s3_client)
    store.publish(MODEL, "1", _export(tmp_path / "a", b"good"))
    cache = tmp_path / "cache"
    fetched = store.fetch(MODEL, "1", cache)

    # A valid cached copy is served without downloading: deleting the objects does not matter.
    s3_client.delete_object(Bucket=BUCKET, Key="ctr/1/saved_model.pb")
    assert store.fetch(MODEL, "1", cache) == fetched
    s3_client.upload_file(str(tmp_path / "a" / "saved_model.pb"), BUCKET, "ctr/1/saved_model.pb")

    # A damaged cached copy is downloaded again.
    (fetched / "variables" / "variables.data").write_bytes(b"rotten")
    assert (store.fetch(MODEL, "1", cache) / "variables" / "variables.data").read_bytes() == b"good"


@pytest.mark.integration
def test_s3_version_without_manifest_object_is_invisible(tmp_path, s3_client):
    store = S3ModelStore(f"s3://{BUCKET}/prod", client=s3_client)
    store.publish(MODEL, "1", _export(tmp_path / "a"))
    # A publish of version 2 that has uploaded its files but not yet its manifest.
    source = _export(tmp_path / "b", b"in flight")
    for name in ("saved_model.pb", "variables/variables.data"):
        s3_client.upload_file(str(source / name), BUCKET, f"prod/ctr/2/{name}")
    s3_client.put_object(Bucket=BUCKET, Key="prod/ctr/notes/manifest.json", Body=b"{}")  # not a version
    s3_client.put_object(Bucket=BUCKET, Key="prod/ctr/3\u00b2/manifest.json", Body=b"{}")  # nor is this
    assert store.versions(MODEL) == ["1"]
    assert store.latest(MODEL) == "1"
    with pytest.raises(ModelStoreError, match=rf"version 2 of 'ctr' is not in s3://{BUCKET}/prod"):
        store.manifest(MODEL, "2")
    with pytest.raises(ModelStoreError, match=r"version 2 of 'ctr' is not in"):
        store.fetch(MODEL, "2", tmp_path / "cache")
    assert not (tmp_path / "cache" / MODEL / "2").exists()

    s3_client.upload_file(str(source / MANIFEST_NAME), BUCKET, f"prod/ctr/2/{MANIFEST_NAME}")
    assert store.versions(MODEL) == ["1", "2"]


@pytest.mark.integration
def test_s3_non_integer_version_is_rejected(tmp_path, s3_client):
    store = S3ModelStore(f"s3://{BUCKET}", client=s3_client)
    with pytest.raises(ModelStoreError, match=r"model version 'latest' must be a decimal integer"):
        store.publish(MODEL, "latest", _export(tmp_path / "a"))
    assert _keys(s3_client) == []


@pytest.mark.integration
def test_s3_publish_refuses_a_source_without_manifest(tmp_path, s3_client):
    source = tmp_path / "export"
    source.mkdir()
    (source / "saved_model.pb").write_bytes(b"graph")
    store = S3ModelStore(f"s3://{BUCKET}", client=s3_client)
    with pytest.raises(ModelStoreError, match=r"has no manifest\.json; export the model first"):
        store.publish(MODEL, "1", source)
    assert _keys(s3_client) == []


@pytest.mark.integration
def test_s3_fetch_of_a_tampered_version_raises(tmp_path, s3_client):
    store = S3ModelStore(f"s3://{BUCKET}", client=s3_client)
    store.publish(MODEL, "4", _export(tmp_path / "a", b"weights"))
    s3_client.put_object(Bucket=BUCKET, Key="ctr/4/variables/variables.data", Body=b"WEIGHTS")
    cache = tmp_path / "cache"
    with pytest.raises(
        ModelStoreError,
        match=rf"version 4 of 'ctr' in s3://{BUCKET} is corrupt: "
        r".*file 'variables/variables\.data' does not match",
    ):
        store.fetch(MODEL, "4", cache)
    # Nothing half-downloaded is left to be mistaken for the version.
    assert list((cache / MODEL).iterdir()) == []


def _export_kind(directory: Path, kind: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "payload.bin").write_bytes(kind.encode())
    write_manifest(directory, kind=kind, version="1", files=["payload.bin"])
    return directory


def _store(backend, tmp_path, request, prefix):
    """A fresh store of either backend: a local directory, or a prefix of the moto bucket."""
    if backend == "s3":
        return S3ModelStore(f"s3://{BUCKET}/{prefix}", client=request.getfixturevalue("s3_client"))
    return LocalModelStore(tmp_path / "store")


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_rollback_retracts_newer_versions_and_full_models_start_chains(tmp_path, backend, request):
    store = _store(backend, tmp_path, request, "chains")
    for version, kind in (("100", "full_model"), ("101", "delta"), ("102", "delta"), ("200", "full_model"),
                          ("201", "delta")):
        store.publish(MODEL, version, _export_kind(tmp_path / version, kind))
    assert (store.latest(MODEL), store.latest_full(MODEL)) == ("201", "200")
    assert rollback(store, MODEL, "101", "bad minutes") == ["102", "200", "201"]
    assert store.retracted(MODEL) == {"102", "200", "201"}
    assert (store.latest(MODEL), store.latest_full(MODEL)) == ("101", "100")
    assert store.versions(MODEL) == ["100", "101", "102", "200", "201"]  # kept for inspection
    with pytest.raises(ModelStoreError, match="cannot roll back to version 102 of 'ctr': it was retracted itself"):
        rollback(store, MODEL, "102", "again")
    with pytest.raises(ModelStoreError, match=r"version 7 of 'ctr': it is not in .*the newest versions there are"):
        rollback(store, MODEL, "7", "typo")


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_promotion_sets_the_stable_and_canary_labels_and_rollback_moves_them(tmp_path, backend, request):
    store = _store(backend, tmp_path, request, "labels")
    store.publish(MODEL, "100", _export_kind(tmp_path / "100", "full_model"))
    assert store.labels(MODEL) == {"canary": "100"}  # nothing promoted: the newest is a canary
    assert promote(store, MODEL, None, "passed the gate") == "100"  # default: the newest standing version
    assert store.labels(MODEL) == {"stable": "100"}  # the newest is promoted: no canary
    for version, kind in (("101", "delta"), ("102", "delta")):
        store.publish(MODEL, version, _export_kind(tmp_path / version, kind))
    assert store.labels(MODEL) == {"stable": "100", "canary": "102"}
    promote(store, MODEL, "101", "a day of canary traffic")
    assert (store.stable(MODEL), store.labels(MODEL)) == ("101", {"stable": "101", "canary": "102"})
    rollback(store, MODEL, "100", "101 was wrong after all")
    # the stable label falls back to the newest promoted version still standing
    assert store.labels(MODEL) == {"stable": "100"}
    assert store.promoted(MODEL) == {"100", "101"}
    with pytest.raises(ModelStoreError, match=r"cannot promote version 102 of 'ctr': it was retracted"):
        promote(store, MODEL, "102", "again")
    with pytest.raises(ModelStoreError, match=r"cannot promote version 7 of 'ctr': it is not in .*newest versions"):
        promote(store, MODEL, "7", "typo")


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_every_publish_retraction_and_promotion_changes_the_change_marker(tmp_path, backend, request):
    store = _store(backend, tmp_path, request, "changes")
    assert store.changed(MODEL) is None  # nothing happened yet
    seen = []
    store.publish(MODEL, "100", _export_kind(tmp_path / "100", "full_model"))
    seen.append(store.changed(MODEL))
    store.publish(MODEL, "101", _export_kind(tmp_path / "101", "delta"))
    seen.append(store.changed(MODEL))
    promote(store, MODEL, "100", "passed")
    seen.append(store.changed(MODEL))
    rollback(store, MODEL, "100", "101 was wrong")
    seen.append(store.changed(MODEL))
    assert None not in seen and len(set(seen)) == 4
    assert store.changed(MODEL) == seen[-1]  # reading it changes nothing
    assert store.versions(MODEL) == ["100", "101"]  # the marker is not a version
