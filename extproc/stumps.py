"""Boosted decision stumps: the small learned models the gateway ships (the semantic cache's
paraphrase check, semantic routing's intent decision). Pure numpy.

An additive model: each stump (feature, split, value if <= split, value if above) adds to the
log-odds, so each feature's contribution is a step function. ``fit_stumps`` trains one for the
log-loss; ``Stumps`` evaluates it, one row or a matrix at a time (one ``searchsorted`` per
feature: the stumps on a feature are folded into one step function once); ``stumps_json`` and
``load_stumps`` write and read a shipped model's file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Stump = tuple[int, float, float, float]  # (feature, split, value if <= split, value if above)


@dataclass(frozen=True, slots=True)
class Stumps:
    """A trained additive model: ``bias`` plus each stump's value, as log-odds."""

    stumps: tuple[Stump, ...]
    bias: float
    _steps: list[tuple[int, np.ndarray, np.ndarray]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps = []
        for j in sorted({s[0] for s in self.stumps}):
            mine = sorted((split, left, right) for feature, split, left, right in self.stumps if feature == j)
            splits = np.array([s for s, _, _ in mine])
            lefts, rights = np.array([lo for _, lo, _ in mine]), np.array([hi for _, _, hi in mine])
            # values[k]: x above the first k splits and at or below the rest
            values = np.array([rights[:k].sum() + lefts[k:].sum() for k in range(len(mine) + 1)])
            steps.append((j, splits, values))
        object.__setattr__(self, "_steps", steps)

    def log_odds(self, x: np.ndarray) -> np.ndarray:
        """(rows,) log-odds of a (rows, features) matrix."""
        out = np.full(x.shape[0], self.bias)
        for j, splits, values in self._steps:
            out += values[np.searchsorted(splits, x[:, j], side="left")]
        return out

    def probability(self, x: np.ndarray) -> np.ndarray:
        """(rows,) probabilities of a (rows, features) matrix."""
        return 1.0 / (1.0 + np.exp(-self.log_odds(x)))

    def log_odds_one(self, features: list[float]) -> float:
        """One row's log-odds, without numpy's per-call cost (a check of one pair)."""
        return self.bias + sum(left if features[j] <= split else right for j, split, left, right in self.stumps)


def fit_stumps(x: np.ndarray, y: np.ndarray, rounds: int = 300, learning_rate: float = 0.1, min_leaf: int = 8,
               l2: float = 1.0) -> tuple[tuple[Stump, ...], float]:
    """Gradient-boosted stumps for the log-loss (Newton steps, an L2 penalty on leaf values): the
    stumps and the bias. Deterministic: ties go to the first feature and the lowest split."""
    prior = float(np.clip(y.mean(), 1e-6, 1 - 1e-6))
    bias = math.log(prior / (1 - prior))
    f = np.full(len(y), bias)
    stumps: list[Stump] = []
    orders = [np.argsort(x[:, j], kind="stable") for j in range(x.shape[1])]
    for _ in range(rounds):
        p = 1.0 / (1.0 + np.exp(-f))
        g, h = p - y, p * (1 - p)
        best: tuple[float, int, float, float, float] | None = None
        base = g.sum() ** 2 / (h.sum() + l2)
        for j, order in enumerate(orders):
            xs, gs, hs = x[order, j], np.cumsum(g[order]), np.cumsum(h[order])
            k = np.arange(min_leaf, len(y) - min_leaf)
            k = k[xs[k] != xs[k - 1]]  # a split between two different values only
            if k.size == 0:
                continue
            gl, hl = gs[k - 1], hs[k - 1]
            gr, hr = gs[-1] - gl, hs[-1] - hl
            gains = gl ** 2 / (hl + l2) + gr ** 2 / (hr + l2) - base
            i = int(np.argmax(gains))  # the first of equal gains: the lowest split
            if best is None or gains[i] > best[0]:
                at = int(k[i])
                best = (float(gains[i]), j, float((xs[at] + xs[at - 1]) / 2), float(-gl[i] / (hl[i] + l2)),
                        float(-gr[i] / (hr[i] + l2)))
        if best is None or best[0] <= 0:
            break
        _, j, split, left, right = best
        stump = (j, split, learning_rate * left, learning_rate * right)
        stumps.append(stump)
        f += np.where(x[:, j] <= split, stump[2], stump[3])
    return tuple(stumps), bias


def stumps_json(features: tuple[str, ...], stumps: tuple[Stump, ...], bias: float, **about: object) -> str:
    """A shipped model's file: the features it reads, ``about`` (its settings, how it was trained
    and measured), then the bias and the stumps."""
    return json.dumps({"features": features, **about, "bias": bias, "stumps": [list(s) for s in stumps]},
                      indent=1) + "\n"


def load_stumps(path: Path, features: tuple[str, ...]) -> tuple[dict[str, Any], tuple[Stump, ...], float]:
    """A shipped model's file: (everything it holds, its stumps, its bias); ``ValueError`` if it was
    trained on other ``features``."""
    data = json.loads(path.read_text())
    if tuple(data["features"]) != features:
        raise ValueError(f"{path}: trained on {data['features']}, not {list(features)}")
    stumps = tuple((int(j), float(t), float(lo), float(hi)) for j, t, lo, hi in data["stumps"])
    return data, stumps, float(data["bias"])
