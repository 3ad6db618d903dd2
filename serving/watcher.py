"""Keeps the newest good model version loaded, swapping versions without dropping or mixing requests.

The store's newest standing version is either a full model or a delta on a parent (components.delta). The
watcher resolves its chain back to the version serving now, or else to the full model it starts from:

- a chain of deltas on the served version is applied to a second, standby replica of the same model while the
  active one keeps serving, and then the two swap; the old active replica catches up on the next swap;
- anything else (a new full model, a rollback, a gap: the served version is not an ancestor) loads the full
  model twice (active and standby) and applies its chain to both.

The store's `stable` version (the newest promoted one, components.model_store) is served beside it under
TF Serving's version label `stable`, from one more replica, when it is not the newest version; the newest is
then the `canary`. Requests without a version or label are answered by the newest.

With `hand_off` set (serving.full_loads=process, serving.handoff), the full loads after the first are not made
here: the watcher names the version to `hand_off`, once, and keeps serving; a new server process loads it and
takes the traffic over, and this one exits. Deltas on the served chain are still applied here.

A new version is checksummed (the store's fetch), applied or loaded, and warmed up with one prediction before
the single `_model` reference is replaced. A request reads that reference once (`current()`), so it is
answered by exactly one version; a prediction still running on a replica that a later swap updates in place
makes the update wait for it (serving.model.ReplicaGuard). A version that fails to fetch, load, apply or warm
up is logged and not tried again until a backoff has passed; serving stays on the last good version.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from components.delta import DELTA_KIND, read_delta
from components.model_store import CANARY_LABEL, STABLE_LABEL, ModelStore, ModelStoreError
from serving.handoff import lower_this_threads_priority
from serving.model import LoadedModel
from serving.row_cache import PROTECTED_SHARE, check_protected_share

logger = logging.getLogger(__name__)

# A failed version is retried after this long, doubling on each further failure up to the maximum: a corrupt
# upload is not re-downloaded every poll, and a transient outage (network, S3) heals on its own.
RETRY_FIRST_SECONDS = 30.0
RETRY_MAX_SECONDS = 3600.0
# A chain longer than this (a day of minute deltas is 1440) is refused: a loop in the parents or a broken store.
MAX_CHAIN_LENGTH = 100_000
# Under the cache directory: where models with tiered tables keep their deltas' rows (serving.row_cache).
DELTA_ROWS_DIR = "delta-rows"


class ModelWatcher:
    def __init__(
        self, store: ModelStore, model_name: str, cache_dir: str | Path, poll_seconds: float,
        precision: str = "float32", watch_seconds: float | None = None,
        hand_off: Callable[[str], None] | None = None, low_priority_loads: bool = False, native_rows: bool = True,
        row_cache_protected_share: float = PROTECTED_SHARE,
    ) -> None:
        """Lists the store every `poll_seconds`; with `watch_seconds`, also reads the store's change marker that
        often (ModelStore.changed: one small read) and lists it at once when the marker changed.

        `hand_off`: called (once per version, from the watcher's thread) with a version that needs a full load
        once start() has returned; the version is then left to another process (module docstring).
        `low_priority_loads`: the loads of start() run below the requests' priority too, as later ones always do
        (a process started beside a serving one); TensorFlow's runtime must then be running already.
        `native_rows`: the models read row-form bodies with native code where they can (serving.native_rows).
        `row_cache_protected_share`: the protected segment of a tiered table's row cache
        (serving.row_cache_protected_share)."""
        if poll_seconds <= 0 or (watch_seconds is not None and watch_seconds <= 0):
            raise ValueError(f"poll_seconds and watch_seconds must be positive, got {poll_seconds!r} and "
                             f"{watch_seconds!r}")
        check_protected_share(row_cache_protected_share)
        self.row_cache_protected_share = row_cache_protected_share
        self.store = store
        self.precision = precision
        self.native_rows = native_rows
        self.model_name = model_name
        self.cache_dir = Path(cache_dir)
        self.poll_seconds = poll_seconds
        self.watch_seconds = watch_seconds
        self._model: LoadedModel | None = None
        # The second replica of the served chain, and the deltas it lacks to reach the active version.
        self._standby: LoadedModel | None = None
        self._pending: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []
        # The store's stable version, and its replica when it is not the newest version (which serves it then).
        self._stable_version: str | None = None
        self._stable: LoadedModel | None = None
        # Published manifests never change; kept for the served chain (a day of minutes: 1440 small entries).
        self._manifests: dict[str, dict[str, Any]] = {}
        self.last_error: str | None = None
        # version -> (number of failures, monotonic time before which it is not tried again)
        self._failures: dict[str, tuple[int, float]] = {}
        self._store_down = False
        self.hand_off = hand_off
        self.low_priority_loads = low_priority_loads
        self._handed_off: set[str] = set()
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

    def models(self) -> list[LoadedModel]:
        """Every version loaded, the newest first: the one serving now, then the stable one if it differs."""
        return [model for model in (self._model, self._stable) if model is not None]

    def labels(self) -> dict[str, str]:
        """Label -> loaded version: `stable` (the newest promoted version) and `canary` (the newest version, when
        it is not promoted yet); a label whose version is not loaded is left out."""
        model, stable_version = self._model, self._stable_version
        out = {}
        if stable_version is not None and stable_version in {loaded.version for loaded in self.models()}:
            out[STABLE_LABEL] = stable_version
        if model is not None and (stable_version is None or int(model.version) > int(stable_version)):
            out[CANARY_LABEL] = model.version
        return out

    def start(self) -> LoadedModel | None:
        """Loads the latest version now, then keeps polling for newer ones in a background thread."""
        if self._thread is not None:
            raise RuntimeError("this ModelWatcher is already started")
        self.poll_once()
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.model_name}", daemon=True)
        self._thread.start()
        return self._model

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stops polling, waiting up to `timeout_s` (None: as long as it takes) for a poll in progress; says whether
        the thread has ended. One still loading a version is a daemon thread: it ends with the process, and
        leaves no half-written version behind (the store's fetch stages and renames)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def __enter__(self) -> ModelWatcher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        if self.watch_seconds is None or self.watch_seconds >= self.poll_seconds:
            while not self._stop.wait(self.poll_seconds):
                self.poll_once()
            return
        marker, listed = self._marker(), time.monotonic()
        while not self._stop.wait(self.watch_seconds):
            seen = self._marker()
            if seen != marker or time.monotonic() - listed >= self.poll_seconds:
                marker, listed = seen, time.monotonic()
                self.poll_once()

    def _marker(self) -> str | None:
        """The store's change marker; while it cannot be read, one value for the whole outage, so an outage
        brings one listing at its start (which reports it) and one when it ends, not one per read."""
        try:
            return self.store.changed(self.model_name)
        except Exception:  # noqa: BLE001 - the store is remote; _poll logs what is wrong with it
            return "(the change marker cannot be read)"

    def poll_once(self) -> bool:
        """Swaps to the store's latest version if it is newer and loads cleanly; says whether it swapped."""
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> bool:
        try:
            latest = self.store.latest(self.model_name)
            stable = self.store.stable(self.model_name)
        except Exception:  # the store is remote: any client error must not stop the watcher
            if not self._store_down:
                logger.exception("cannot list versions of %r in %s", self.model_name, self.store.uri)
            self._store_down = True
            return False
        if self._store_down:
            logger.info("model store %s answers again", self.store.uri)
            self._store_down = False
        swapped = self._follow_latest(latest)
        if self._follow_stable(stable) or swapped:
            self._prune_cache(keep=[model.directory for model in self.models()])
        return swapped

    def _follow_latest(self, latest: str | None) -> bool:
        current = self._model
        if latest is None or (current is not None and latest == current.version):
            return False
        if not self._may_try(latest):
            return False
        started = time.monotonic()
        try:
            if self._handing_off(latest, full=lambda: self._needs_full_load(latest)):
                return False
            model = self._load(latest)
        except Exception as err:  # any failure of one version leaves the last good one serving
            delay = self._failed(latest, err)
            logger.exception(
                "version %s of %r failed to load (failure %d); still serving version %s; next try in %.0f s",
                latest, self.model_name, self._failures[latest][0], current.version if current else None, delay,
            )
            return False
        self._model = model
        self.last_error = None
        self._failures = {v: entry for v, entry in self._failures.items()
                          if int(v) > int(latest) or v == self._stable_version}
        logger.info(
            "now serving version %s of %r (was %s); fetched, loaded and warmed up in %.2f s",
            model.version, self.model_name, current.version if current else None, time.monotonic() - started,
        )
        return True

    def _follow_stable(self, stable: str | None) -> bool:
        """Keeps the stable version loaded beside the newest one, in one replica of its own, when it differs.
        Says whether it loaded one."""
        self._stable_version = stable
        model = self._model
        if stable is None or (model is not None and model.version == stable):
            self._stable = None  # no promoted version, or the newest version is the stable one
            return False
        if (self._stable is not None and self._stable.version == stable) or not self._may_try(stable):
            return False
        started = time.monotonic()
        try:
            if self._handing_off(stable, full=lambda: True):
                return False
            self._stable = self._load_alone(stable)
        except Exception as err:
            delay = self._failed(stable, err)
            logger.exception("stable version %s of %r failed to load; label %r names no version; next try in "
                             "%.0f s", stable, self.model_name, STABLE_LABEL, delay)
            return False
        logger.info("now serving stable version %s of %r beside version %s; loaded in %.2f s", stable,
                    self.model_name, model.version if model else None, time.monotonic() - started)
        return True

    def _handing_off(self, version: str, full: Callable[[], bool]) -> bool:
        """Whether `version` is left to another process: `hand_off` is set, start() has returned and the version
        needs a full load (`full`). Calls `hand_off` the first time."""
        if self.hand_off is None or self._thread is None or self._model is None or not full():
            return False
        if version not in self._handed_off:
            self._handed_off.add(version)
            logger.info("version %s of %r needs a full load: handed off to a new server process; version %s serves "
                        "until it takes over", version, self.model_name, self._model.version)
            self.hand_off(version)
        return True

    def hand_off_failed(self, version: str, error: str) -> None:
        """The process that `version` was handed off to could not serve it: it is tried again after the backoff of
        a failed load, and handed off again then."""
        with self._poll_lock:
            self._handed_off.discard(version)
            delay = self._failed(version, RuntimeError(error))
        logger.error("version %s of %r failed to load in a new server process (failure %d): %s; still serving "
                     "version %s; next try in %.0f s", version, self.model_name, self._failures[version][0], error,
                     self.version, delay)

    def _needs_full_load(self, version: str) -> bool:
        """Whether serving `version` takes a full model's load (_load): not a chain of deltas on the served one."""
        active = self._model
        first = self._chain(version, stop_at=active.version if active is not None else None)[0][1]
        return not (first.get("kind") == DELTA_KIND and active is not None and self._standby is not None)

    def _may_try(self, version: str) -> bool:
        return time.monotonic() >= self._failures.get(version, (0, 0.0))[1]

    def _failed(self, version: str, err: Exception) -> float:
        """Records a failure of `version` and returns the seconds before it is tried again."""
        self.last_error = f"version {version}: {err}"
        failures = self._failures.get(version, (0, 0.0))[0] + 1
        delay = min(RETRY_FIRST_SECONDS * 2 ** (failures - 1), RETRY_MAX_SECONDS)
        self._failures[version] = (failures, time.monotonic() + delay)
        return delay

    def _load_alone(self, version: str) -> LoadedModel:
        """One replica of `version`: its chain's full model with the chain's deltas applied."""
        chain = self._chain(version, stop_at=None)
        if chain[0][1].get("kind") == DELTA_KIND:
            raise ModelStoreError(f"the chain of version {version} does not reach a full model")
        return self._replica(chain[0][0], [self._fetch_delta(v) for v, _ in chain[1:]])

    def _replica(self, full_version: str, deltas: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> LoadedModel:
        """A fresh replica of a full model with `deltas` applied, warmed up. While a version is serving, on a
        thread of its own at LOADER_NICE: a load takes the core for about half a second, and the requests on the
        same core come first (their threads, and TensorFlow's, keep the process's priority). The first load
        runs on the calling thread: nothing is served yet, and TensorFlow's thread pools, which it may create,
        must not inherit a lower priority."""
        if self._model is None and not self.low_priority_loads:
            return self._load_replica(full_version, deltas)
        outcome: dict[str, Any] = {}

        def load() -> None:
            lower_this_threads_priority()
            try:
                outcome["model"] = self._load_replica(full_version, deltas)
            except Exception as err:  # noqa: BLE001 - raised again on the watcher's thread
                outcome["error"] = err

        loader = threading.Thread(target=load, name=f"load-{self.model_name}-{full_version}", daemon=True)
        loader.start()
        loader.join()
        if "error" in outcome:
            raise outcome["error"]
        if "model" not in outcome:
            raise RuntimeError(f"loading version {full_version} of {self.model_name!r} ended without a model")
        return outcome["model"]

    def _load_replica(self, full_version: str, deltas: list[tuple[dict[str, Any], dict[str, np.ndarray]]]
                      ) -> LoadedModel:
        directory = self.store.fetch(self.model_name, full_version, self.cache_dir)
        model = LoadedModel.load(directory, full_version, verify=False, precision=self.precision,  # fetch() verified it
                                 native_rows=self.native_rows, scratch=self.cache_dir / DELTA_ROWS_DIR,
                                 row_cache_protected_share=self.row_cache_protected_share)
        if model.precision != self.precision:
            logger.warning("version %s was exported without a %s endpoint: it answers in %s", full_version,
                           self.precision, model.precision)
        for manifest, arrays in deltas:
            model = model.apply_delta(manifest, arrays)
        model.warm_up()  # traces and allocates before the first real request
        return model

    def _load(self, version: str) -> LoadedModel:
        """The model of `version`, ready to serve: the standby replica moved forward by the deltas since the
        served version, or a fresh load of the chain's full model with the chain applied."""
        active = self._model
        chain = self._chain(version, stop_at=active.version if active is not None else None)
        first_version, first = chain[0]
        if first.get("kind") == DELTA_KIND and active is not None and self._standby is not None:
            deltas = [self._fetch_delta(v) for v, _ in chain]
            standby = self._standby
            self._standby = None  # if an update fails half-way, the next version reloads both replicas
            for manifest, arrays in [*self._pending, *deltas]:
                standby = standby.apply_delta(manifest, arrays)
            standby.predict([{}])  # a replica that served before: its kernels are built
            self._standby, self._pending = active, deltas
            return standby
        if first.get("kind") == DELTA_KIND:  # the served version is an ancestor, but there is no standby
            chain = self._chain(version, stop_at=None)
            first_version, first = chain[0]
        if first.get("kind") == DELTA_KIND:
            raise ModelStoreError(f"the chain of version {version} does not reach a full model")
        deltas = [self._fetch_delta(v) for v, _ in chain[1:]]
        copies = 2 if deltas or first.get("weight_specs") else 1
        replicas = [self._replica(first_version, deltas) for _ in range(copies)]
        self._standby = replicas[1] if len(replicas) > 1 else None
        self._pending = []
        self._manifests = dict(chain)  # a new chain: older chains' manifests are not needed again
        if active is not None and deltas:
            logger.info("version %s: loaded its full model %s and %d deltas (served version %s is not its ancestor)",
                        version, first_version, len(deltas), active.version)
        return replicas[0]

    def _manifest(self, version: str) -> dict[str, Any]:
        manifest = self._manifests.get(version)
        if manifest is None:
            manifest = self._manifests[version] = self.store.manifest(self.model_name, version)
        return manifest

    def _chain(self, version: str, stop_at: str | None) -> list[tuple[str, dict[str, Any]]]:
        """(version, manifest) from the full model (or from the delta right after `stop_at`) to `version`."""
        chain = [(version, self._manifest(version))]
        while chain[-1][1].get("kind") == DELTA_KIND:
            parent = chain[-1][1].get("parent")
            if parent is None:
                raise ModelStoreError(f"delta {chain[-1][0]} names no parent")
            if parent == stop_at:
                break
            if len(chain) >= MAX_CHAIN_LENGTH:
                raise ModelStoreError(f"the chain of version {version} is longer than {MAX_CHAIN_LENGTH} versions")
            try:
                chain.append((str(parent), self._manifest(str(parent))))
            except ModelStoreError as err:
                raise ModelStoreError(f"the chain of version {version} has a gap: {err}") from err
        return chain[::-1]

    def _fetch_delta(self, version: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        directory = self.store.fetch(self.model_name, version, self.cache_dir)
        return read_delta(directory, verify=False)  # fetch() verified the checksums

    def _prune_cache(self, keep: list[Path]) -> None:
        """Removes the versions a remote store downloaded into the cache that no loaded model came from."""
        if "://" not in self.store.uri:
            return  # a local store serves its own directories: they are the store, not a cache
        cached = self.cache_dir / self.model_name
        if not cached.is_dir():
            return
        for path in cached.iterdir():
            if path.is_dir() and path.name.isdigit() and path.resolve() not in {k.resolve() for k in keep}:
                shutil.rmtree(path, ignore_errors=True)
