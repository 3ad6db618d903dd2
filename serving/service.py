"""What REST (serving.app) and gRPC (serving.grpc_server) share: which loaded model answers a request, the
limits every request is held to, and the three ways of asking (predict, classify, regress).

A request names a model, and optionally a version or a label (`stable`, `canary`: components.model_store);
without either it is answered by the newest version loaded. Each request is answered by exactly one version:
the model is read once, and a request that finds its replica moved on by a delta (StaleModel) is run again
on the version serving then.

Classify and regress take TF Serving's example form: a list of examples ({feature: value}) and an optional
context whose features every example shares (the user and page of an ad request, the examples being the
candidates). A CTR model answers classify with the two classes "0" and "1" and their probabilities, and
regress with the click probability.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from components.config import ServingConfig
from components.model_store import CANARY_LABEL, LABELS, STABLE_LABEL
from serving.errors import BadRequest, ModelNotFound, NoModelLoaded, PayloadTooLarge
from serving.model import InvalidInput, LoadedModel, StaleModel

# Versions arrive at most once a second, so a request sees a stale replica at most once or twice in practice.
STALE_RETRIES = 5
CLASSES = ("0", "1")  # no click, click

T = TypeVar("T")


class ModelSource(Protocol):
    def current(self) -> LoadedModel | None:
        """The newest model loaded, or None before the first version is loaded."""
        ...

    def models(self) -> list[LoadedModel]:
        """Every version loaded, the newest first."""
        ...

    def labels(self) -> Mapping[str, str]:
        """Label -> loaded version."""
        ...


class PredictionService:
    def __init__(self, source: ModelSource, config: ServingConfig) -> None:
        self.source = source
        self.config = config

    def model(self, name: str, version: str | None = None, label: str | None = None) -> LoadedModel:
        """The one model that answers a request for `name`, at `version` or `label` if given."""
        if name != self.config.model_name:
            raise ModelNotFound(f"model {name!r} is not served here; it serves {self.config.model_name!r}")
        newest = self.source.current()
        if newest is None:
            raise NoModelLoaded(
                f"model {name!r} has no version loaded yet: none is published in the model store or none "
                "has loaded cleanly; retry later"
            )
        if label is not None:
            version = self._labelled(name, label, newest)
        if version is None:
            return newest
        models = self.source.models()
        for model in models:
            if version == model.version or _same_number(version, model.version):
                return model
        loaded = [model.version for model in models]
        raise ModelNotFound(f"version {version} of model {name!r} is not loaded; the loaded versions are {loaded}")

    def _labelled(self, name: str, label: str, newest: LoadedModel) -> str:
        if label not in LABELS:
            raise ModelNotFound(
                f"label {label!r} of model {name!r} is not served; the labels are {STABLE_LABEL!r} (the newest "
                f"promoted version) and {CANARY_LABEL!r} (the newest version, when it is not promoted yet)"
            )
        labels = self.source.labels()
        if label in labels:
            return labels[label]
        if label == STABLE_LABEL:
            raise ModelNotFound(
                f"label {STABLE_LABEL!r} of model {name!r} names no loaded version: no version is promoted yet "
                "(`ctr-pipeline promote VERSION`), or the promoted one is still loading; retry later"
            )
        raise ModelNotFound(
            f"label {CANARY_LABEL!r} of model {name!r} names no version: the newest version, {newest.version}, "
            f"is promoted (label {STABLE_LABEL!r})"
        )

    def run(self, name: str, version: str | None, label: str | None,
            call: Callable[[LoadedModel], T]) -> tuple[LoadedModel, T]:
        """`call` on the model this request resolves to; again on the current one if a delta moves it on."""
        for _ in range(STALE_RETRIES):
            model = self.model(name, version, label)
            try:
                return model, call(model)
            except StaleModel:  # a delta moved this replica on after the request read it
                continue
            except InvalidInput as err:
                raise BadRequest(str(err)) from None
        raise NoModelLoaded(f"model {name!r} changed version {STALE_RETRIES} times during one request; retry")

    def check_count(self, num_instances: int, what: str) -> None:
        if num_instances == 0:
            raise BadRequest(f"the request holds no {what}; expected at least one")
        if num_instances > self.config.max_instances:
            raise PayloadTooLarge(
                f"request has {num_instances} {what}, over the limit of {self.config.max_instances} "
                "(serving.max_instances); split it into smaller requests"
            )


def merge_context(examples: Sequence[Any], context: Mapping[str, Any] | None) -> list[Any]:
    """Each example with the context's features added (an example's own value wins over the context's)."""
    for index, example in enumerate(examples):
        if not isinstance(example, dict):
            raise BadRequest(f"example {index} must be an object of feature values, got {str(example)[:60]}")
    return [{**context, **example} for example in examples] if context else list(examples)


def classes(probabilities: np.ndarray) -> list[list[tuple[str, float]]]:
    """Each example's classes with their scores: ("0", 1 - p) and ("1", p)."""
    return [[(CLASSES[0], 1.0 - p), (CLASSES[1], p)] for p in probabilities.astype(float).tolist()]


def _same_number(left: str, right: str) -> bool:
    return left.isdigit() and right.isdigit() and int(left) == int(right)
