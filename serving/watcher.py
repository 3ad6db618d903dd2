"""Keeps the newest good model version loaded, swapping versions without dropping or mixing requests.

A new version is fetched (the store verifies its checksums), loaded and warmed up with one prediction while
the old one keeps serving; only then is the single `_model` reference replaced. A request reads that reference
once (`current()`), so it is answered by exactly one version from start to end, and the old version is freed
when its last request finishes. A version that fails to fetch, load or warm up is logged and not tried again
until a backoff has passed; serving stays on the last good version.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from components.model_store import ModelStore
from serving.model import LoadedModel

logger = logging.getLogger(__name__)

# A failed version is retried after this long, doubling on each further failure up to the maximum: a corrupt
# upload is not re-downloaded every poll, and a transient outage (network, S3) heals on its own.
RETRY_FIRST_SECONDS = 30.0
RETRY_MAX_SECONDS = 3600.0


class ModelWatcher:
    def __init__(
        self, store: ModelStore, model_name: str, cache_dir: str | Path, poll_seconds: float
    ) -> None:
        if poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be positive, got {poll_seconds!r}")
        self.store = store
        self.model_name = model_name
        self.cache_dir = Path(cache_dir)
        self.poll_seconds = poll_seconds
        self._model: LoadedModel | None = None
        # version -> (number of failures, monotonic time before which it is not tried again)
        self._failures: dict[str, tuple[int, float]] = {}
        self._store_down = False
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> LoadedModel | None:
        """The model serving now; read it once per request."""
        return self._model

    @property
    def version(self) -> str | None:
        model = self._model
        return model.version if model else None

    def start(self) -> LoadedModel | None:
        """Loads the latest version now, then keeps polling for newer ones in a background thread."""
        if self._thread is not None:
            raise RuntimeError("this ModelWatcher is already started")
        self.poll_once()
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.model_name}", daemon=True)
        self._thread.start()
        return self._model

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ModelWatcher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.poll_once()

    def poll_once(self) -> bool:
        """Swaps to the store's latest version if it is newer and loads cleanly; says whether it swapped."""
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> bool:
        try:
            latest = self.store.latest(self.model_name)
        except Exception:  # the store is remote: any client error must not stop the watcher
            if not self._store_down:
                logger.exception("cannot list versions of %r in %s", self.model_name, self.store.uri)
            self._store_down = True
            return False
        if self._store_down:
            logger.info("model store %s answers again", self.store.uri)
            self._store_down = False
        current = self._model
        if latest is None or (current is not None and int(latest) <= int(current.version)):
            return False
        failures, retry_at = self._failures.get(latest, (0, 0.0))
        if time.monotonic() < retry_at:
            return False
        started = time.monotonic()
        try:
            model = self._load(latest)
        except Exception:  # any failure of one version leaves the last good one serving
            failures += 1
            delay = min(RETRY_FIRST_SECONDS * 2 ** (failures - 1), RETRY_MAX_SECONDS)
            self._failures[latest] = (failures, time.monotonic() + delay)
            logger.exception(
                "version %s of %r failed to load (failure %d); still serving version %s; next try in %.0f s",
                latest, self.model_name, failures, current.version if current else None, delay,
            )
            return False
        self._model = model
        self._failures = {v: entry for v, entry in self._failures.items() if int(v) > int(latest)}
        logger.info(
            "now serving version %s of %r (was %s); fetched, loaded and warmed up in %.2f s",
            model.version, self.model_name, current.version if current else None, time.monotonic() - started,
        )
        self._prune_cache(keep=model.directory)
        return True

    def _load(self, version: str) -> LoadedModel:
        directory = self.store.fetch(self.model_name, version, self.cache_dir)
        # fetch() has just verified every checksum.
        model = LoadedModel.load(directory, version, verify=False)
        model.predict([{}])  # warm-up: traces and allocates before the first real request
        return model

    def _prune_cache(self, keep: Path) -> None:
        """Removes older versions that a remote store downloaded into the cache."""
        if "://" not in self.store.uri:
            return  # a local store serves its own directories: they are the store, not a cache
        cached = self.cache_dir / self.model_name
        if not cached.is_dir():
            return
        for path in cached.iterdir():
            if path.is_dir() and path.name.isdigit() and path.resolve() != keep.resolve():
                shutil.rmtree(path, ignore_errors=True)
