import numpy as np
import pytest

from aiperf_core.errors import AiperfError
from aiperf_core.search.curve import fit_power_law, predict_final_accuracy


def test_a_synthetic_power_law_curve_is_recovered_and_extrapolated():
    a, b, c = 0.92, 0.7, 0.8
    t = np.arange(1, 16)
    rng = np.random.default_rng(0)
    observed = a - b * t ** -c + rng.normal(0, 0.003, len(t))
    fa, fb, fc = fit_power_law(observed)
    assert (fa, fb, fc) == pytest.approx((a, b, c), rel=0.15)
    truth = a - b * 60 ** -c
    predicted = predict_final_accuracy(list(observed), 60)
    assert predicted == pytest.approx(truth, abs=0.02)
    assert predicted > observed.max() - 0.01  # still rising: the prediction is above what was seen


def test_flat_or_falling_curves_do_not_extrapolate_upwards():
    assert predict_final_accuracy([0.5, 0.5, 0.5, 0.5], 60) == pytest.approx(0.5)
    assert predict_final_accuracy([0.6, 0.5, 0.4], 60) <= 0.6


def test_short_or_broken_curves_fall_back_to_the_best_seen():
    assert predict_final_accuracy([0.3, 0.4], 60) == 0.4
    assert predict_final_accuracy([0.3, None, 0.5, 0.6], 60) == 0.6
    assert predict_final_accuracy([], 60) == 0.0
    with pytest.raises(AiperfError, match="learning curve"):
        fit_power_law([0.1, 0.2])


def test_the_prediction_stays_a_probability():
    assert 0.0 <= predict_final_accuracy([0.2, 0.6, 0.9, 0.99], 60) <= 1.0
