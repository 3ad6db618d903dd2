from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime

import pytest

from components.manifest import (
    MANIFEST_NAME,
    ManifestError,
    commit_dir,
    file_sha256,
    format_hash,
    read_manifest,
    staging_dir,
    write_json_atomic,
    write_manifest,
)

pytestmark = pytest.mark.unit


def _build(directory, payloads: dict[str, bytes], **kwargs):
    for name, data in payloads.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return write_manifest(
        directory, kind=kwargs.pop("kind", "dataset"), version="v1", files=list(payloads), **kwargs
    )


def test_file_sha256_matches_hashlib_across_chunks(tmp_path):
    data = bytes(range(256)) * 100
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_sha256(path, chunk_bytes=7) == hashlib.sha256(data).hexdigest()
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()


def test_write_then_read_round_trip_with_checksums(tmp_path):
    created = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    written = _build(
        tmp_path,
        {"a.bin": b"hello", "sub/b.bin": b"world!"},
        inputs={"raw": "/raw/x"},
        row_counts={"train": 12},
        extra={"min_count": 5},
        created_at=created,
    )
    read = read_manifest(tmp_path, kind="dataset")
    assert read == written
    assert read["files"] == {
        "a.bin": {"sha256": hashlib.sha256(b"hello").hexdigest(), "bytes": 5},
        "sub/b.bin": {"sha256": hashlib.sha256(b"world!").hexdigest(), "bytes": 6},
    }
    assert read["kind"] == "dataset"
    assert read["version"] == "v1"
    assert read["format_hash"] == format_hash()
    assert "feature_spec_hash" not in read  # not given: the output does not depend on the columns
    assert read["created_at"] == "2026-01-02T03:04:00+00:00"
    assert read["inputs"] == {"raw": "/raw/x"}
    assert read["row_counts"] == {"train": 12}
    assert read["min_count"] == 5
    # Only the manifest is added to the directory; no temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", MANIFEST_NAME, "sub"]


def test_write_manifest_rejects_a_file_that_is_not_there(tmp_path):
    with pytest.raises(ManifestError, match=r"names 'ghost\.bin', which is not a file there"):
        write_manifest(tmp_path, kind="dataset", version="v1", files=["ghost.bin"])
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_tampered_file_is_named(tmp_path):
    _build(tmp_path, {"a.bin": b"hello", "b.bin": b"world"})
    (tmp_path / "b.bin").write_bytes(b"w0rld")  # same size, other bytes
    with pytest.raises(ManifestError, match=r"file 'b\.bin' does not match its manifest checksum"):
        read_manifest(tmp_path)
    # Without verification the manifest is still readable.
    assert read_manifest(tmp_path, verify=False)["files"]["b.bin"]["bytes"] == 5


def test_truncated_file_is_named(tmp_path):
    _build(tmp_path, {"a.bin": b"hello"})
    (tmp_path / "a.bin").write_bytes(b"hell")
    with pytest.raises(ManifestError, match=r"file 'a\.bin' does not match its manifest checksum"):
        read_manifest(tmp_path)


def test_deleted_file_is_named(tmp_path):
    _build(tmp_path, {"a.bin": b"hello"})
    (tmp_path / "a.bin").unlink()
    with pytest.raises(ManifestError, match=r"file 'a\.bin' named in the manifest is missing"):
        read_manifest(tmp_path)


def test_missing_manifest_message(tmp_path):
    with pytest.raises(
        ManifestError,
        match=re.escape(str(tmp_path))
        + r" has no manifest\.json: it is missing or was not completely written; re-run the step",
    ):
        read_manifest(tmp_path)


def test_malformed_manifest_message(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text('{"kind": ')
    with pytest.raises(
        ManifestError, match=r"manifest\.json is not valid JSON .*re-run the step that produces it"
    ):
        read_manifest(tmp_path)


def test_wrong_kind_is_rejected(tmp_path):
    _build(tmp_path, {"a.bin": b"x"}, kind="checkpoint")
    with pytest.raises(ManifestError, match=r"describes a 'checkpoint', expected a 'feature_state'"):
        read_manifest(tmp_path, kind="feature_state")


def test_other_format_is_rejected(tmp_path):
    _build(tmp_path, {"a.bin": b"x"})
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    manifest["format_hash"] = "0123456789abcdef"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"written in format '0123456789abcdef', this code reads"):
        read_manifest(tmp_path)


def test_the_feature_spec_hash_is_recorded_and_checked_when_the_reader_gives_one(tmp_path):
    from components.feature_spec import load_spec

    criteo, events = load_spec("criteo"), load_spec("events")
    assert criteo.hash() != events.hash()
    _build(tmp_path, {"a.bin": b"x"}, spec_hash=criteo.hash())
    assert read_manifest(tmp_path)["feature_spec_hash"] == criteo.hash()
    assert read_manifest(tmp_path, spec_hash=criteo.hash())["feature_spec_hash"] == criteo.hash()
    with pytest.raises(ManifestError, match=rf"made with feature spec '{criteo.hash()}', this run uses "
                                            rf"'{events.hash()}'; re-run the step that produces it with this spec"):
        read_manifest(tmp_path, spec_hash=events.hash())


def test_write_json_atomic_replaces_and_creates_parents(tmp_path):
    target = tmp_path / "deep" / "report.json"
    write_json_atomic(target, {"b": 1, "a": [1, 2]})
    write_json_atomic(target, {"b": 2})
    assert json.loads(target.read_text()) == {"b": 2}
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]


def test_staging_dir_is_a_hidden_sibling(tmp_path):
    final = tmp_path / "out" / "model"
    staging = staging_dir(final)
    assert staging.parent == final.parent
    assert staging.is_dir() and staging.name.startswith(".model.") and staging.name.endswith(".staging")
    assert staging_dir(final) != staging
    assert not final.exists()


def test_commit_dir_moves_a_complete_staging_dir(tmp_path):
    final = tmp_path / "features"
    staging = staging_dir(final)
    _build(staging, {"vocab.bin": b"v1"})
    assert commit_dir(staging, final) == final
    assert not staging.exists()
    assert (final / "vocab.bin").read_bytes() == b"v1"
    read_manifest(final)


def test_commit_dir_replaces_an_existing_dir(tmp_path):
    final = tmp_path / "features"
    first = staging_dir(final)
    _build(first, {"old_only.bin": b"old", "vocab.bin": b"v1"})
    commit_dir(first, final)
    second = staging_dir(final)
    _build(second, {"vocab.bin": b"v2"})
    commit_dir(second, final)
    assert sorted(p.name for p in final.iterdir()) == [MANIFEST_NAME, "vocab.bin"]
    assert (final / "vocab.bin").read_bytes() == b"v2"
    assert read_manifest(final)["files"]["vocab.bin"]["sha256"] == hashlib.sha256(b"v2").hexdigest()
    # Nothing but the committed directory is left next to it.
    assert [p.name for p in tmp_path.iterdir()] == ["features"]


def test_commit_dir_refuses_a_staging_dir_without_manifest(tmp_path):
    final = tmp_path / "features"
    staging = staging_dir(final)
    (staging / "vocab.bin").write_bytes(b"partial")
    with pytest.raises(
        ManifestError, match=r"refusing to commit " + re.escape(str(staging)) + r": it has no manifest\.json"
    ):
        commit_dir(staging, final)
    assert not final.exists()
    assert (staging / "vocab.bin").read_bytes() == b"partial"


def test_a_staging_dir_left_by_a_crash_is_never_read_as_the_final_dir(tmp_path):
    final = tmp_path / "features"
    committed = staging_dir(final)
    _build(committed, {"vocab.bin": b"good"})
    commit_dir(committed, final)

    # A re-run crashes after writing every file and even its manifest, but before commit_dir.
    crashed = staging_dir(final)
    _build(crashed, {"vocab.bin": b"newer but never committed"})

    assert (final / "vocab.bin").read_bytes() == b"good"
    assert read_manifest(final)["files"]["vocab.bin"]["sha256"] == hashlib.sha256(b"good").hexdigest()

    # A crash on the very first run leaves no final dir at all: readers get the missing-manifest error.
    other = tmp_path / "samples"
    half = staging_dir(other)
    (half / "part-0.tfrecord").write_bytes(b"half")
    with pytest.raises(ManifestError, match=re.escape(str(other)) + r" has no manifest\.json"):
        read_manifest(other)


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "a/../../b", "", "a\\..\\b", "./a"])
def test_a_manifest_naming_a_path_outside_its_directory_is_refused(tmp_path, name):
    write_manifest(tmp_path, kind="delta", version="v", files=[])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["files"] = {name: {"bytes": 1, "sha256": "0" * 64}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for verify in (True, False):
        with pytest.raises(ManifestError, match="not a plain relative path inside its directory"):
            read_manifest(tmp_path, verify=verify)
