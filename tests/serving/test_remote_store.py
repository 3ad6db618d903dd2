"""ModelWatcher with an S3 model store (a moto server on loopback): versions are downloaded into the cache."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from components.model_store import S3ModelStore
from serving.watcher import ModelWatcher
from tests.serving.fixture_model import MODEL_NAME, NEW_VERSION, OLD_VERSION

pytestmark = pytest.mark.integration

INSTANCE = {"I1": 3.0, "I2": 2.5, "C1": "abc"}  # new version: sigmoid(-0.3 * 5.5 + 2.0)


def test_a_remote_store_is_fetched_into_the_cache_and_old_versions_pruned(
    exported: dict[str, Path], tmp_path: Path
) -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket="serving-models")  # moto keeps buckets process-wide: one per test file
        store = S3ModelStore("s3://serving-models/prod", client=client)
        store.publish(MODEL_NAME, OLD_VERSION, exported[OLD_VERSION])
        cache = tmp_path / "cache"

        with ModelWatcher(store, MODEL_NAME, cache, poll_seconds=60) as watcher:
            cached_before = sorted(path.name for path in (cache / MODEL_NAME).iterdir())
            store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
            swapped = watcher.poll_once()
            model = watcher.current()
    finally:
        server.stop()

    assert cached_before == [OLD_VERSION]
    assert swapped is True
    assert model is not None
    assert model.directory == cache / MODEL_NAME / NEW_VERSION
    assert sorted(path.name for path in (cache / MODEL_NAME).iterdir()) == [NEW_VERSION]
    assert model.predict([INSTANCE]).tolist() == pytest.approx([0.5866176], rel=1e-6)


@pytest.mark.parametrize("name", ["../../outside.bin", "/tmp/absolute.bin", "a/../../b.bin", "a//b.bin"])
def test_a_manifest_naming_a_file_outside_its_version_is_refused_before_anything_is_written(
    name: str, tmp_path: Path
) -> None:
    import json

    from components.model_store import ModelStoreError

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket="hostile-models")
        manifest = {"kind": "full_model", "version": "202601010000",
                    "files": {name: {"bytes": 5, "sha256": "0" * 64}}}
        client.put_object(Bucket="hostile-models", Key=f"m/ctr/202601010000/{name.lstrip('/')}", Body=b"owned")
        client.put_object(Bucket="hostile-models", Key="m/ctr/202601010000/manifest.json",
                          Body=json.dumps(manifest).encode())
        store = S3ModelStore("s3://hostile-models/m", client=client)
        cache = tmp_path / "deep" / "cache"
        with pytest.raises(ModelStoreError, match="not a plain relative path inside its directory"):
            store.fetch("ctr", "202601010000", cache)
    finally:
        server.stop()
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [] and not Path("/tmp/absolute.bin").exists()
