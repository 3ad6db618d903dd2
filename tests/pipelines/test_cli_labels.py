"""`ctr promote` and `ctr rollback` on a local model store: what they print, their exit codes, the labels."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.manifest import write_manifest
from components.model_store import LocalModelStore
from pipelines.cli import main

pytestmark = pytest.mark.unit


def publish(store: LocalModelStore, tmp_path: Path, version: str) -> None:
    source = tmp_path / "exported" / version
    source.mkdir(parents=True)
    (source / "weights").write_bytes(version.encode())
    write_manifest(source, kind="full_model", version=version, files=["weights"])
    store.publish("ctr", version, source)


def test_promote_labels_a_version_stable_and_refuses_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = LocalModelStore(tmp_path / "store")
    for version in ("100", "101"):
        publish(store, tmp_path, version)
    where = ["--set", f"paths.model_store={store.root}", "--set", f"paths.data_root={tmp_path}"]

    promoted = main(["promote", "100", *where])
    printed = capsys.readouterr().out
    missing = main(["promote", "7", *where])
    refused = capsys.readouterr().err
    rolled = main(["rollback", "100", *where])
    newest = main(["promote", *where])

    assert (promoted, missing, rolled, newest) == (0, 1, 0, 0)
    assert printed.startswith("promoted version 100; labels now {'stable': '100', 'canary': '101'}")
    assert refused.startswith("ctr: model store: cannot promote version 7 of 'ctr': it is not in ")
    assert store.labels("ctr") == {"stable": "100"}
