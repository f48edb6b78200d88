import math

import numpy as np
import pytest

from aiperf_core.search.gp import Posterior, acquisition, expected_improvement, posterior, ucb


def toy():
    """f peaks at x = 0.6 on [0, 1]; the 'architectures' are points with distance |x - y|."""
    x = np.linspace(0.0, 1.0, 9)
    f = lambda t: 1.0 - 4.0 * (t - 0.6) ** 2
    return x, f


def test_posterior_matches_scikit_learn_on_standardised_targets():
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF

    x, f = toy()
    y = f(x)
    grid = np.linspace(0, 1, 41)
    post = posterior(np.abs(x[:, None] - x[None, :]), y, np.abs(x[:, None] - grid[None, :]),
                     length_scale=0.2, noise=1e-2)
    centre, spread = y.mean(), y.std()
    gpr = GaussianProcessRegressor(RBF(0.2, "fixed"), alpha=1e-2, optimizer=None)
    gpr.fit(x[:, None], (y - centre) / spread)
    mean, std = gpr.predict(grid[:, None], return_std=True)
    assert post.mean == pytest.approx(centre + spread * mean, abs=1e-8)
    assert post.std == pytest.approx(spread * std, abs=1e-6)


def test_the_acquisitions_find_the_known_optimum():
    x, f = toy()
    grid = np.linspace(0, 1, 201)
    post = posterior(np.abs(x[:, None] - x[None, :]), f(x), np.abs(x[:, None] - grid[None, :]), 0.25)
    assert grid[np.argmax(ucb(post, 0.0))] == pytest.approx(0.6, abs=0.03)
    assert grid[np.argmax(acquisition(post, "ucb", 2.576, 1.0))] == pytest.approx(0.6, abs=0.1)
    assert grid[np.argmax(acquisition(post, "ei", 0.0, float(f(x).max())))] == pytest.approx(0.6, abs=0.1)
    # Far from every observation the GP is unsure: UCB explores where sigma is large.
    far = posterior(np.zeros((1, 1)), np.array([0.5]), np.array([[0.0, 10.0]]), 1.0)
    assert far.std[1] > far.std[0] and ucb(far, 3.0)[1] > ucb(far, 3.0)[0]


def test_expected_improvement_closed_form():
    post = Posterior(np.array([0.5, 0.7, 0.2]), np.array([0.1, 0.2, 1e-9]))
    best = 0.6
    rng = np.random.default_rng(0)
    draws = post.mean[:2, None] + post.std[:2, None] * rng.standard_normal((2, 400000))
    mc = np.maximum(draws - best, 0).mean(axis=1)
    ei = expected_improvement(post, best)
    assert ei[:2] == pytest.approx(mc, rel=0.02)
    assert ei[2] == pytest.approx(0.0, abs=1e-12)
    z = (0.7 - 0.6) / 0.2
    assert ei[1] == pytest.approx(0.1 * 0.5 * (1 + math.erf(z / math.sqrt(2))) + 0.2 * math.exp(-z * z / 2)
                                  / math.sqrt(2 * math.pi))


def test_an_indefinite_distance_matrix_still_fits():
    # Distances that violate the triangle inequality make the raw covariance indefinite.
    d = np.array([[0, 1, 5.0], [1, 0, 1], [5, 1, 0]])
    post = posterior(d, np.array([0.1, 0.5, 0.9]), d, length_scale=1.0)
    assert np.all(np.isfinite(post.mean)) and np.all(post.std > 0)
