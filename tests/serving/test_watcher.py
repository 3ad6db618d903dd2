"""ModelWatcher: loading the latest version, swapping to newer ones under load, skipping broken ones."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from components.config import ServingConfig
from components.model_store import LocalModelStore
from serving import watcher as watcher_module
from serving.app import create_app
from serving.handoff import LOADER_NICE
from serving.model import LoadedModel
from serving.watcher import ModelWatcher
from tests.serving.fixture_model import MODEL_NAME, NEW_VERSION, OLD_VERSION, corrupt

pytestmark = pytest.mark.unit

PREDICT = f"/v1/models/{MODEL_NAME}:predict"
INSTANCE = {"I1": 3.0, "I2": 2.5, "C1": "abc"}  # dense sum 5.5
# old: sigmoid(0.1 * 5.5 + 0.5); new: sigmoid(-0.3 * 5.5 + 2.0)
VALUES = {OLD_VERSION: 0.7407749, NEW_VERSION: 0.5866176}


class CountingStore:
    """A LocalModelStore that counts fetches per version."""

    def __init__(self, store: LocalModelStore) -> None:
        self.store = store
        self.uri = store.uri
        self.fetches: dict[str, int] = {}

    def latest(self, model_name: str) -> str | None:
        return self.store.latest(model_name)

    def stable(self, model_name: str) -> str | None:
        return self.store.stable(model_name)

    def manifest(self, model_name: str, version: str) -> dict[str, Any]:
        return self.store.manifest(model_name, version)

    def fetch(self, model_name: str, version: str, cache_dir: Path) -> Path:
        self.fetches[version] = self.fetches.get(version, 0) + 1
        return self.store.fetch(model_name, version, cache_dir)


def wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(0.01)


def test_start_loads_the_latest_version(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
    before = datetime.now(UTC)

    with ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=60) as watcher:
        model = watcher.current()

    assert model is not None
    assert watcher.version == model.version == NEW_VERSION
    assert before <= model.loaded_at <= datetime.now(UTC)
    assert model.predict([INSTANCE]).tolist() == pytest.approx([VALUES[NEW_VERSION]], rel=1e-6)


def _thread_nices() -> dict[str, int]:
    """name (comm) and nice value of every thread of this process, from /proc."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out[f"{stat[stat.index('(') + 1:stat.rindex(')')]} {tid}"] = int(stat[stat.rindex(")") + 2:].split()[16])
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread priorities are read from Linux's /proc")
def test_full_models_load_below_the_requests_priority_once_a_version_serves(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full-model load takes the core for about half a second: while a version serves, it runs on a thread at
    nice 19, so the request threads of the process come first on a busy core. The first load runs on the
    calling thread at the process's priority: TensorFlow may create its thread pools there, and threads inherit
    the nice value of the thread that starts them; pools created at nice 19 would run every request's model
    call at the loader's priority. No thread is left at the lower priority after the swap."""
    loads: list[tuple[str, int]] = []
    load = LoadedModel.load

    def noting_priority(*args: Any, **kwargs: Any) -> LoadedModel:
        loads.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return load(*args, **kwargs)

    monkeypatch.setattr(LoadedModel, "load", noting_priority)
    store.publish(MODEL_NAME, OLD_VERSION, exported[OLD_VERSION])
    process_nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert LOADER_NICE > process_nice
    with ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=0.05) as watcher:
        assert loads == [(threading.current_thread().name, process_nice)]  # the first load, on this thread
        store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
        wait_for(lambda: watcher.version == NEW_VERSION)
        thread = watcher._thread
        assert thread is not None
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == process_nice  # it applies deltas
        assert watcher.current().predict([INSTANCE]).tolist() == pytest.approx([VALUES[NEW_VERSION]], rel=1e-6)
    later = loads[1:]
    assert later and all(name.startswith(f"load-{MODEL_NAME}-{NEW_VERSION}") and nice == LOADER_NICE
                         for name, nice in later), loads
    lowered = {name: nice for name, nice in _thread_nices().items() if nice != process_nice}
    assert lowered == {}


def test_serves_503_until_a_first_version_is_published(exported: dict[str, Path], tmp_path: Path) -> None:
    store = LocalModelStore(tmp_path / "store")
    watcher = ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=60)
    client = TestClient(create_app(watcher, ServingConfig()))

    assert watcher.start() is None
    before = client.get("/healthz")
    store.publish(MODEL_NAME, OLD_VERSION, exported[OLD_VERSION])
    swapped = watcher.poll_once()
    after = client.get("/healthz")
    watcher.stop()

    assert before.status_code == 503
    assert swapped is True
    assert (after.status_code, after.json()["model_version"]) == (200, OLD_VERSION)


def test_hot_swap_under_load_drops_and_mixes_nothing(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    watcher = ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=0.05)
    app = create_app(watcher, ServingConfig())
    per_client: list[list[tuple[int, str | None, Any]]] = [[], []]
    stop = threading.Event()

    def send_requests(responses: list[tuple[int, str | None, Any]]) -> None:
        with TestClient(app) as client:
            while not stop.is_set():
                response = client.post(PREDICT, json={"instances": [INSTANCE, INSTANCE]})
                responses.append(
                    (response.status_code, response.headers.get("x-model-version"), response.json())
                )

    def num_responses() -> int:
        return sum(len(responses) for responses in per_client)

    with watcher:
        clients = [threading.Thread(target=send_requests, args=(responses,)) for responses in per_client]
        for thread in clients:
            thread.start()
        try:
            wait_for(lambda: num_responses() >= 20)
            store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
            wait_for(lambda: watcher.version == NEW_VERSION)
            swapped_at = num_responses()
            wait_for(lambda: num_responses() >= swapped_at + 20)
        finally:
            stop.set()
            for thread in clients:
                thread.join()

    for responses in per_client:
        assert [status for status, _, _ in responses] == [200] * len(responses)
        # Every response is wholly one version's function, and it is the version its header names.
        for _, version, body in responses:
            assert body["predictions"] == pytest.approx([VALUES[version]] * 2, rel=1e-6)
        # Each client's requests are sequential: old ones, then new ones, never back.
        versions = [version for _, version, _ in responses]
        num_old = versions.count(OLD_VERSION)
        assert num_old > 0
        assert versions == [OLD_VERSION] * num_old + [NEW_VERSION] * (len(versions) - num_old)
        assert versions[-1] == NEW_VERSION


def test_a_corrupt_version_is_skipped_and_not_refetched_every_poll(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    counting = CountingStore(store)
    watcher = ModelWatcher(counting, MODEL_NAME, tmp_path / "cache", poll_seconds=60)
    client = TestClient(create_app(watcher, ServingConfig()))
    watcher.start()
    corrupt(Path(store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])))

    with caplog.at_level(logging.ERROR, logger="serving.watcher"):
        first = watcher.poll_once()
        second = watcher.poll_once()
    response = client.post(PREDICT, json={"instances": [INSTANCE]})
    newest = "202601010200"
    store.publish(MODEL_NAME, newest, exported[NEW_VERSION])
    recovered = watcher.poll_once()
    watcher.stop()

    assert (first, second) == (False, False)
    assert counting.fetches == {OLD_VERSION: 1, NEW_VERSION: 1, newest: 1}
    assert (
        f"version {NEW_VERSION} of 'ctr' failed to load (failure 1); still serving version {OLD_VERSION}; "
        "next try in 30 s"
    ) in caplog.text
    assert "does not match its manifest checksum" in caplog.text
    assert response.headers["x-model-version"] == OLD_VERSION
    assert response.json()["predictions"] == pytest.approx([VALUES[OLD_VERSION]], rel=1e-6)
    assert recovered is True
    assert watcher.version == newest


def test_a_failed_version_is_retried_after_its_backoff(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher_module, "RETRY_FIRST_SECONDS", 0.0)
    watcher = ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=60)
    watcher.start()
    corrupt(Path(store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])))

    failed = watcher.poll_once()
    store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])  # the same version, re-published whole
    retried = watcher.poll_once()
    watcher.stop()

    assert (failed, retried) == (False, True)
    assert watcher.version == NEW_VERSION


def test_the_stable_version_is_served_beside_the_canary_under_its_label(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    from components.model_store import promote

    watcher = ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=60)
    client = TestClient(create_app(watcher, ServingConfig()))
    body = {"instances": [INSTANCE]}

    def answer(path: str) -> tuple[int, str | None, Any]:
        response = client.post(f"/v1/models/{MODEL_NAME}{path}:predict", json=body)
        return response.status_code, response.headers.get("x-model-version"), response.json()

    watcher.start()
    promote(store, MODEL_NAME, OLD_VERSION, "reviewed")
    store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
    watcher.poll_once()
    both = {path: answer(path) for path in ("", "/labels/stable", "/labels/canary", f"/versions/{OLD_VERSION}")}
    status = client.get(f"/v1/models/{MODEL_NAME}").json()
    loaded_both = [model.version for model in watcher.models()]

    promote(store, MODEL_NAME, NEW_VERSION, "a day of canary traffic")
    watcher.poll_once()
    after = {path: answer(path)[:2] for path in ("/labels/stable", "/labels/canary")}
    loaded_after = [model.version for model in watcher.models()]
    watcher.stop()

    new, old = VALUES[NEW_VERSION], VALUES[OLD_VERSION]
    assert both[""][:2] == both["/labels/canary"][:2] == (200, NEW_VERSION)
    assert both[""][2]["predictions"] == pytest.approx([new], rel=1e-6)
    assert both["/labels/stable"][:2] == both[f"/versions/{OLD_VERSION}"][:2] == (200, OLD_VERSION)
    assert both["/labels/stable"][2]["predictions"] == pytest.approx([old], rel=1e-6)
    assert loaded_both == [NEW_VERSION, OLD_VERSION]
    assert status["labels"] == {"stable": OLD_VERSION, "canary": NEW_VERSION}
    assert [entry["version"] for entry in status["model_version_status"]] == [NEW_VERSION, OLD_VERSION]
    # The newest is promoted: one replica serves both the default and the stable label; there is no canary.
    assert after["/labels/stable"] == (200, NEW_VERSION)
    assert after["/labels/canary"] == (404, None)
    assert loaded_after == [NEW_VERSION]


def test_a_publish_or_a_retraction_is_followed_at_the_change_markers_pace_not_the_listings(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    from components.model_store import rollback

    store.publish(MODEL_NAME, OLD_VERSION, exported[OLD_VERSION])
    # Listing once a minute: only the change marker, read every 20 ms, can bring the new version in time.
    watcher = ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=60, watch_seconds=0.02)
    with watcher:
        assert watcher.version == OLD_VERSION
        store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
        wait_for(lambda: watcher.version == NEW_VERSION, timeout=10)
        rollback(store, MODEL_NAME, OLD_VERSION, "new one is wrong")
        wait_for(lambda: watcher.version == OLD_VERSION, timeout=10)
    with pytest.raises(ValueError, match="must be positive"):
        ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=1, watch_seconds=0)


def test_a_change_marker_that_cannot_be_read_brings_one_listing_not_one_per_read(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    store.publish(MODEL_NAME, OLD_VERSION, exported[OLD_VERSION])

    class Outage(CountingStore):
        listings = 0

        def latest(self, model_name: str) -> str | None:
            self.listings += 1
            return super().latest(model_name)

        def changed(self, model_name: str) -> str | None:
            raise ConnectionError("the store does not answer")

    outage = Outage(store)
    with ModelWatcher(outage, MODEL_NAME, tmp_path / "cache", poll_seconds=60, watch_seconds=0.01) as watcher:
        time.sleep(0.5)  # about 50 reads of the marker, every one failing
        assert watcher.version == OLD_VERSION
    assert outage.listings == 1  # the start's listing only: the marker never answered, so nothing changed
