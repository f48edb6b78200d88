"""Gaussian-process regression over a distance, and the acquisition functions of the NAS.

The covariance of two architectures is k(d) = s^2 exp(-(d / l)^2 / 2) of their edit distance d.
An edit distance is not Euclidean, so that matrix need not be positive semi-definite (Auto-Keras
embeds the distances for the same reason); here its negative eigenvalues are clipped to zero,
the nearest PSD matrix in the Frobenius norm, before the noise term is added.

Targets are standardised (mean 0, variance 1) so that the noise and the prior scale are in units
of the observed spread; the length scale defaults to the median of the observed distances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aiperf_core.errors import AiperfError

NOISE = 1e-2  # observation noise variance, in standardised units: repeated trainings differ
MIN_SPREAD = 1e-3  # floor of the targets' standard deviation, so that equal targets do not divide by 0


def covariance(d: np.ndarray, length_scale: float) -> np.ndarray:
    return np.exp(-0.5 * (np.asarray(d) / length_scale) ** 2)


def nearest_psd(k: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((k + k.T) / 2.0)
    return (vectors * np.maximum(values, 0.0)) @ vectors.T


def median_length_scale(d: np.ndarray) -> float:
    off = d[np.triu_indices(len(d), k=1)]
    off = off[off > 0]
    return float(np.median(off)) if len(off) else 1.0


@dataclass(frozen=True)
class Posterior:
    mean: np.ndarray
    std: np.ndarray


def posterior(train_d: np.ndarray, y: np.ndarray, cross_d: np.ndarray, length_scale: float | None = None,
              noise: float = NOISE) -> Posterior:
    """GP posterior at new points, given the distances among the observed points (n, n), their
    targets (n,) and the distances from the observed to the new points (n, m)."""
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if train_d.shape != (n, n) or cross_d.shape[0] != n:
        raise AiperfError(f"posterior: distance shapes {train_d.shape} and {cross_d.shape} do not fit {n} targets")
    m = cross_d.shape[1]
    if n == 0:
        return Posterior(np.zeros(m), np.ones(m))
    if length_scale is None:
        length_scale = median_length_scale(train_d)
    centre, spread = float(np.mean(y)), max(float(np.std(y)), MIN_SPREAD)
    z = (y - centre) / spread
    k = nearest_psd(covariance(train_d, length_scale)) + noise * np.eye(n)
    chol = np.linalg.cholesky(k)
    k_star = covariance(cross_d, length_scale)
    alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, z))
    v = np.linalg.solve(chol, k_star)
    mean = k_star.T @ alpha
    var = np.maximum(1.0 - np.sum(v * v, axis=0), 1e-12)
    return Posterior(centre + spread * mean, spread * np.sqrt(var))


def ucb(post: Posterior, kappa: float) -> np.ndarray:
    """Upper confidence bound, for maximisation."""
    return post.mean + kappa * post.std


def expected_improvement(post: Posterior, best: float, xi: float = 0.0) -> np.ndarray:
    """E[max(f - best - xi, 0)] under the posterior, for maximisation."""
    improve = post.mean - best - xi
    z = improve / post.std
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return improve * cdf + post.std * pdf


def acquisition(post: Posterior, kind: str, kappa: float, best: float) -> np.ndarray:
    if kind == "ucb":
        return ucb(post, kappa)
    if kind == "ei":
        return expected_improvement(post, best)
    raise AiperfError(f"nas_acquisition: unknown acquisition {kind!r} (choose ucb or ei)")
