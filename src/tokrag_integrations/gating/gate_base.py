"""The gate contract: per query, "retrieve or not?", with the score behind the answer.

A gate computes a *score* for a query (its own scale: a confidence, a GECE value...). Its
``retrieve_when`` says which side of the threshold asks for retrieval (``"above"`` or
``"below"``). The threshold is never hard-coded for a model: :meth:`Gate.calibrate` sets it
as a percentile of the scores of a calibration set of queries, chosen so that
``percentile`` % of the calibration queries are answered *without* retrieval (GECE's paper
retrieves for the top 20 %: ``percentile=80``). :meth:`Gate.save` / :meth:`Gate.load` keep
the calibration as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..trace import json_data


@dataclass
class GateDecision:
    """One gate's verdict on one query.

    ``retrieve``: whether to retrieve; ``score``: the gate's score; ``threshold``: the
    calibrated or given threshold it was compared with; ``details``: the numbers behind the
    score (the draft answer, the five confidence metrics, GECE terms, CtrlA token scores...).
    """

    retrieve: bool
    score: float
    threshold: float | None
    gate: str = ""
    retrieve_when: str = "below"
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return json_data(asdict(self), finite=True)


class Gate:
    """Base class: subclasses set ``name``, ``retrieve_when``, ``config_keys`` and implement
    :meth:`score`."""

    name: str = "gate"
    #: "below": retrieve when score < threshold (confidences); "above": when score > it.
    retrieve_when: str = "below"
    #: Default share (%) of calibration queries answered without retrieval.
    default_percentile: float = 50.0
    #: Constructor arguments that :meth:`load` passes back (attributes of the same name).
    config_keys: tuple[str, ...] = ()

    def __init__(self, threshold: float | None = None) -> None:
        self.threshold = None if threshold is None else float(threshold)
        self.percentile: float | None = None
        self.calibration: dict[str, Any] = {}

    @property
    def threshold(self) -> float | None:
        """The calibrated or given threshold (None until calibrated); never NaN."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: float | None) -> None:
        if value is not None and math.isnan(value):
            raise ValueError(
                f"{type(self).__name__} threshold must be a number, got NaN (not a number); "
                "pass a number or calibrate the gate"
            )
        self._threshold = value

    # ------------------------------------------------------------------ to implement
    def score(self, query: str) -> tuple[float, dict[str, Any]]:
        """The gate's score for ``query`` and the details behind it."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Calibrated state besides the threshold (e.g. GECE's mean gradient)."""
        return {}

    def set_state(self, state: dict[str, Any], folder: Path) -> None:
        """Restore :meth:`state` (files it names are in ``folder``)."""

    def calibration_scores(self, queries: list[str], **kwargs: Any) -> list[float]:
        """The scores of the calibration queries; a gate may fit its statistics here first
        (GECE: E(grad); CtrlA: the token statistics)."""
        return [self.score(q)[0] for q in queries]

    # ------------------------------------------------------------------ the contract
    def retrieves(self, score: float, threshold: float | None = None) -> bool:
        thr = self.threshold if threshold is None else threshold
        if thr is None:
            raise RuntimeError(
                f"{type(self).__name__} has no threshold: call calibrate(queries) or load(path) "
                "first, or pass threshold=... to the constructor."
            )
        if math.isnan(score):  # no answer / undefined score: be safe, retrieve
            return True
        if math.isinf(thr):  # a forced route: +inf "below" / -inf "above" always retrieves
            return (thr > 0) == (self.retrieve_when == "below")
        # +-inf scores compare as such (CtrlA: -inf = a refusal, retrieve; +inf = no content
        # token to doubt, do not retrieve)
        return score < thr if self.retrieve_when == "below" else score > thr

    def decide(self, query: str) -> GateDecision:
        """Score ``query`` and compare with the calibrated threshold."""
        s, details = self.score(query)
        return GateDecision(
            retrieve=self.retrieves(s),
            score=float(s),
            threshold=self.threshold,
            gate=self.name,
            retrieve_when=self.retrieve_when,
            details=details,
        )

    def calibrate(
        self, queries: Sequence[str], percentile: float | None = None, **kwargs: Any
    ) -> list[float]:
        """Set the threshold from calibration ``queries``; returns their scores.

        Args:
            queries: representative user queries (no gold answers needed, except for GECE
                ``gold`` mode, which takes ``references=`` through ``kwargs``).
            percentile: share (%) of calibration queries answered without retrieval
                (default: the gate's ``default_percentile``).
        """
        queries = list(queries)
        if not queries:
            raise ValueError("calibrate() needs at least one query.")
        scores = self.calibration_scores(queries, **kwargs)
        self.set_threshold_from_scores(
            scores, self.default_percentile if percentile is None else percentile
        )
        return scores

    def set_threshold_from_scores(self, scores: Sequence[float], percentile: float) -> float:
        """The threshold that leaves ``percentile`` % of the finite ``scores`` un-retrieved."""
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {percentile}")
        arr = np.asarray([s for s in scores if math.isfinite(s)], dtype=float)
        if arr.size == 0:
            raise ValueError("no finite calibration scores: pass queries the model can answer.")
        q = percentile if self.retrieve_when == "above" else 100.0 - percentile
        self.threshold = float(np.percentile(arr, q))
        self.percentile = float(percentile)
        stats = {k: float(getattr(arr, k)()) for k in ("mean", "std", "min", "max")}
        self.calibration = {"n": len(scores), **stats}
        return self.threshold

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return json_data(
            {
                "gate": self.name,
                "class": f"{type(self).__module__}:{type(self).__qualname__}",
                "config": {k: getattr(self, k) for k in self.config_keys},
                "retrieve_when": self.retrieve_when,
                "threshold": self.threshold,
                "percentile": self.percentile,
                "calibration": self.calibration,
                "state": self.state(),
            },
            finite=True,
        )

    def save(self, path: str | Path) -> Path:
        """Write the calibration (threshold, percentile, config, state) as JSON."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path, lm: Any = None, **kwargs: Any) -> Gate:
        """Rebuild a gate from :meth:`save` output; ``lm`` and ``kwargs`` (e.g. a retriever)
        are passed to the constructor together with the saved config."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"no gate calibration at {path}: run calibrate() and save() first."
            )
        data = json.loads(path.read_text(encoding="utf-8"))
        target = cls if cls is not Gate else _gate_class(data["class"])
        args = {**data.get("config", {}), **kwargs}
        gate = target(lm, **args) if lm is not None else target(**args)
        if data.get("gate") not in (None, gate.name):
            raise ValueError(
                f"{data.get('gate')!r} calibration cannot be loaded into a {gate.name!r} gate"
            )
        gate.threshold = data.get("threshold")
        gate.percentile = data.get("percentile")
        gate.calibration = dict(data.get("calibration") or {})
        gate.set_state(dict(data.get("state") or {}), path.parent)
        return gate


def _gate_class(name: str) -> type[Gate]:
    """The imported :class:`Gate` subclass saved as ``"module:qualname"``."""
    todo = [Gate]
    while todo:
        c = todo.pop()
        if f"{c.__module__}:{c.__qualname__}" == name:
            return c
        todo += c.__subclasses__()
    raise ValueError(f"unknown gate class {name!r}: import the module that defines it first")
