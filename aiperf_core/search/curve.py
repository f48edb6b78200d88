"""Predicting a trial's final validation accuracy from a short learning curve.

Warm-up rounds train only a few epochs; what the tuner should learn from them is how good the
configuration would be after max_epochs. The curve is fitted by a saturating power law

    acc(t) = a - b * t^(-c),   t = epoch + 1,  b >= 0,  a <= 1,

which rises towards the ceiling a ever more slowly (Domhan et al. 2015 found power laws among the
best single models of learning curves). For each c on a fixed log grid, (a, b) is the linear
least-squares fit; the c with the smallest residual wins. A grid instead of a nonlinear solver
keeps the fit deterministic and free of starting-point failures.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from aiperf_core.errors import AiperfError

EXPONENTS = np.geomspace(0.05, 4.0, 80)
MIN_POINTS = 3  # below this a curve has no shape to extrapolate


def _fit_ab(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares of y = a - b x under b >= 0 and a <= 1."""
    xc = x - x.mean()
    sxx = float(xc @ xc)
    b = -float(xc @ (y - y.mean())) / sxx if sxx > 0 else 0.0
    b = max(b, 0.0)
    a = float(y.mean() + b * x.mean())
    if a > 1.0:  # refit the slope with the ceiling pinned at 1
        a = 1.0
        b = max(float(x @ (1.0 - y)) / float(x @ x), 0.0)
    return a, b


def fit_power_law(accuracies: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, c) of acc(t) = a - b t^(-c) fitted to accuracies[epoch]."""
    y = np.asarray(accuracies, dtype=np.float64)
    if len(y) < MIN_POINTS or not np.all(np.isfinite(y)):
        raise AiperfError(f"learning curve: need {MIN_POINTS} or more finite accuracies, got {list(y)}")
    t = np.arange(1, len(y) + 1, dtype=np.float64)
    best = None
    for c in EXPONENTS:
        x = t ** -c
        a, b = _fit_ab(x, y)
        residual = float(np.sum((a - b * x - y) ** 2))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, a, b, float(c))
    return best[1], best[2], best[3]


def predict_final_accuracy(accuracies: Sequence[float], final_epochs: int) -> float:
    """The fitted curve at epoch final_epochs (1-based), within [0, 1]. With fewer than MIN_POINTS
    finite values the best observed accuracy stands in."""
    values = [float(a) for a in accuracies if a is not None and np.isfinite(a)]
    if not values:
        return 0.0
    if len(values) < MIN_POINTS or len(values) != len(accuracies):
        return max(values)
    a, b, c = fit_power_law(values)
    return float(np.clip(a - b * float(max(final_epochs, len(values))) ** -c, 0.0, 1.0))
