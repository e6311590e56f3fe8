"""Output-length prediction: quantile, cap, cold start, the KS test, drift and the key bound."""

from __future__ import annotations

import math
import random

import pytest

from extproc.predict import (
    KeyStats,
    OutputLengthPredictor,
    PredictorConfig,
    kolmogorov_sf,
    ks_2samp,
    ks_statistic,
    quantile,
)

KEY = ("tenant-a", "llama-3-8b-instruct")


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param(list(range(1, 11)), 0.9, 9, id="p90 of 1..10: the 9th value"),
        pytest.param(list(range(1, 11)), 0.95, 10, id="p95 rounds the rank up"),
        pytest.param(list(range(1, 11)), 1.0, 10, id="p100 is the maximum"),
        pytest.param([7], 0.9, 7, id="one value"),
        pytest.param([1, 2], 0.01, 1, id="tiny q: the minimum"),
    ],
)
def test_nearest_rank_quantile(values: list[int], q: float, expected: int) -> None:
    assert quantile(values, q) == expected


@pytest.mark.parametrize(
    ("a", "b", "d"),
    [
        pytest.param([1, 2, 3], [4, 5, 6], 1.0, id="disjoint samples"),
        pytest.param([1, 2, 3], [1, 2, 3], 0.0, id="identical samples"),
        pytest.param([1, 2, 3, 4], [3, 4, 5, 6], 0.5, id="half overlap: F_a(2)=1/2, F_b(2)=0"),
        pytest.param([1, 2, 2, 3], [2, 2, 2, 4], 0.25, id="ties step together: at 3, 1 vs 3/4"),
        pytest.param([5], [1, 9], 0.5, id="unequal sizes: at 1, 0 vs 1/2"),
    ],
)
def test_ks_statistic(a: list[int], b: list[int], d: float) -> None:
    assert ks_statistic(a, b) == pytest.approx(d)
    assert ks_statistic(b, a) == pytest.approx(d)  # symmetric


@pytest.mark.parametrize(
    ("x", "p"),
    [
        pytest.param(0.0, 1.0, id="no distance: p = 1"),
        pytest.param(0.5, 0.963945, id="small-x theta form: 1 - 5.0133 * exp(-pi^2/2)"),
        pytest.param(1.0, 0.2699997, id="2 (e^-2 - e^-8 + e^-18)"),
        pytest.param(1.358, 0.0500, id="the 5% critical value"),
        pytest.param(1.628, 0.0100, id="the 1% critical value (alpha of the paper)"),
        pytest.param(2.0, 0.000670925, id="2 (e^-8 - e^-32)"),
    ],
)
def test_kolmogorov_survival(x: float, p: float) -> None:
    tolerance = 2e-6 if p < 0.005 else 1e-4  # the critical values are rounded to 3 decimals
    assert kolmogorov_sf(x) == pytest.approx(p, abs=tolerance)


def test_kolmogorov_series_agree_where_they_switch() -> None:
    assert kolmogorov_sf(1.1799999) == pytest.approx(kolmogorov_sf(1.18), abs=1e-6)


@pytest.mark.parametrize(
    ("a", "b", "d", "p"),
    [
        # ne = 5, lambda = (sqrt 5 + 0.12 + 0.11 / sqrt 5) * 0.5 = 1.20263; 2 (e^-2.8926 - e^-11.57)
        pytest.param(list(range(1, 11)), list(range(6, 16)), 0.5, 0.110840, id="shifted by half"),
        # ne = 2, lambda = 0.80600 (theta form)
        pytest.param([1, 2, 3, 4], [3, 4, 5, 6], 0.5, 0.534416, id="tiny samples: not significant"),
        pytest.param([3, 1, 2], [2, 3, 1], 0.0, 1.0, id="unsorted input, same sample"),
    ],
)
def test_ks_2samp_known_values(a: list[int], b: list[int], d: float, p: float) -> None:
    result = ks_2samp(a, b)
    assert result.statistic == pytest.approx(d)
    assert result.p_value == pytest.approx(p, abs=1e-5)


def test_cold_start_until_enough_observations() -> None:
    predictor = OutputLengthPredictor(PredictorConfig(cold_start_tokens=300, min_observations=10))
    assert predictor.predict(KEY) == 300  # unknown key
    for length in range(1, 10):
        predictor.observe(KEY, length)
    assert predictor.predict(KEY) == 300  # 9 observations: still cold
    predictor.observe(KEY, 10)
    assert predictor.predict(KEY) == 9  # p90 of 1..10


@pytest.mark.parametrize(
    ("max_tokens", "n", "expected"),
    [
        pytest.param(None, 1, 90, id="uncapped: p90"),
        pytest.param(50, 1, 50, id="max_tokens caps the estimate"),
        pytest.param(500, 1, 90, id="a loose cap does nothing"),
        pytest.param(50, 3, 150, id="n choices: n times the capped estimate"),
    ],
)
def test_estimate_is_capped_and_per_choice(max_tokens: int | None, n: int, expected: int) -> None:
    predictor = OutputLengthPredictor(PredictorConfig(min_observations=10))
    for length in range(10, 101, 10):
        predictor.observe(KEY, length)
    assert predictor.predict(KEY, max_tokens, n) == expected


def test_cold_start_is_capped_too() -> None:
    assert OutputLengthPredictor(PredictorConfig(cold_start_tokens=512)).predict(KEY, max_tokens=16) == 16


def test_n_choices_are_observed_as_their_mean() -> None:
    predictor = OutputLengthPredictor(PredictorConfig(min_observations=1))
    predictor.observe(KEY, 300, n=3)
    assert predictor.predict(KEY) == 100


def lognormal(rng: random.Random, median: float, count: int) -> list[int]:
    return [round(rng.lognormvariate(math.log(median), 0.5)) for _ in range(count)]


def test_drift_is_detected_and_relearned() -> None:
    rng = random.Random(7)
    predictor = OutputLengthPredictor()  # windows 256 + 256, checked every 16, alpha 0.01
    for length in lognormal(rng, 200, 512):
        predictor.observe(KEY, length)
    before = predictor.predict(KEY)
    assert 300 < before < 450  # p90 of lognormal(200, 0.5) = 200 e^(1.2816 * 0.5) = 380
    drifted_at = None
    for i, length in enumerate(lognormal(rng, 800, 256)):
        if predictor.observe(KEY, length) and drifted_at is None:
            drifted_at = i
    assert drifted_at is not None and drifted_at < 96  # found within a few checks of the shift
    stats = predictor.stats(KEY)
    assert stats is not None and stats.drifts == 1
    assert predictor.predict(KEY) > 1000  # re-learned: p90 of lognormal(800, 0.5) = 1518


def test_no_drift_on_the_same_distribution() -> None:
    rng = random.Random(11)
    predictor = OutputLengthPredictor()
    drifts = sum(predictor.observe(KEY, length) for length in lognormal(rng, 200, 1024))
    assert drifts == 0  # 32 KS checks at alpha 0.01 on one distribution (seeded)
    assert predictor.stats(KEY) == KeyStats(observations=512, estimate=predictor.predict(KEY), drifts=0)


def test_keys_are_bounded_least_recently_used_first() -> None:
    predictor = OutputLengthPredictor(PredictorConfig(max_keys=3, min_observations=1))
    for key in ("a", "b", "c"):
        predictor.observe(key, 10)
    predictor.predict("a")  # a prediction counts as use
    predictor.observe("d", 10)
    assert len(predictor) == 3
    assert predictor.stats("b") is None  # least recently used: forgotten
    assert predictor.stats("a") is not None
    predictor.predict("never-seen")
    assert len(predictor) == 3  # predicting never adds a key


def test_window_is_a_bounded_ring() -> None:
    predictor = OutputLengthPredictor(PredictorConfig(reference_size=4, recent_size=4, min_observations=1,
                                                      check_every=1, alpha=1e-9))
    for length in range(100):
        predictor.observe(KEY, length)
    assert predictor.stats(KEY) == KeyStats(observations=8, estimate=99, drifts=0)  # the last 8 kept


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"quantile": 0}, "quantile", id="quantile 0"),
        pytest.param({"alpha": 1}, "alpha", id="alpha 1"),
        pytest.param({"recent_size": 0}, "recent_size", id="empty window"),
        pytest.param({"min_observations": 300}, "min_observations", id="more than the recent window"),
        pytest.param({"cold_start_tokens": -1}, "cold_start_tokens", id="negative default"),
    ],
)
def test_config_is_validated(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PredictorConfig(**fields)  # type: ignore[arg-type]


def test_negative_usage_is_refused() -> None:
    with pytest.raises(ValueError):
        OutputLengthPredictor().observe(KEY, -1)
