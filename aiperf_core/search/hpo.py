"""HPO: scikit-optimize Bayesian optimisation over the workload's hyperparameters (paper section
4.2), one tuner per replica. Each workload names its dimensions (aiperf_core.workloads): the CNN's
are the batch size and the kernel size of morph-added convs, the LM's the batch size and a
learning-rate multiplier, both on a log scale.

Rounds before policy["hpo_start_round"] are warm-up: they train with each dimension's warm-up
value, and the tuner is told, for each, the quality predicted from its learning curve
(aiperf_core.search.curve), since a few warm-up epochs say little about the final value.
From hpo_start_round on, the tuner proposes.

The tuner is rebuilt for every proposal: a fresh skopt Optimizer seeded with
[run seed, replica, round] is told every observation so far, then asked once. Its answer then
depends on the observations and the round only, never on the process's past, so a restarted
replica proposes what an uninterrupted one would have.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from aiperf_core.policy import Policy

WARMUP_KERNEL = 3  # what deeper morphs use when no tuner chooses


@dataclass(frozen=True)
class Dimension:
    """One tuned hyperparameter: integers or reals in [low, high] on a log scale, or one of
    `choices`; `warmup` is its value in warm-up rounds."""

    name: str
    warmup: float
    low: float | None = None
    high: float | None = None
    choices: tuple = ()
    integer: bool = True

    def contains(self, value) -> bool:
        if self.choices:
            return value in self.choices
        return self.low <= value <= self.high

    def fixed(self):
        """The one value of a dimension that has one (skopt refuses those), else None."""
        if self.choices:
            return self.choices[0] if len(self.choices) == 1 else None
        return self.low if self.low == self.high else None

    def skopt(self):
        from skopt.space import Categorical, Integer, Real

        if self.choices:
            return Categorical(list(self.choices), name=self.name)
        kind = Integer if self.integer else Real
        return kind(self.low, self.high, prior="log-uniform", name=self.name)

    def cast(self, value):
        return int(value) if self.integer else float(value)


@dataclass(frozen=True)
class Observation:
    point: Mapping[str, float]  # a value per dimension
    quality: float  # predicted final quality in warm-up rounds, else the best observed (higher is better)


@dataclass(frozen=True)
class Proposal:
    point: Mapping[str, float]
    source: str  # "warmup" or "hpo"

    @property
    def batch_size(self) -> int:
        return int(self.point["batch_size"])


def warmup_kernel(policy: Mapping) -> int:
    kernels = policy["hpo_kernel_sizes"]
    return WARMUP_KERNEL if WARMUP_KERNEL in kernels else kernels[0]


def propose(policy: Policy, round_number: int, observations: Sequence[Observation], seed: Sequence[int],
            dimensions: Sequence[Dimension]) -> Proposal:
    """Hyperparameters of round round_number. seed is [run seed, replica]."""
    if policy.is_warmup(round_number):
        return Proposal({d.name: d.cast(d.warmup) for d in dimensions}, "warmup")
    from skopt import Optimizer

    fixed = {d.name: d.cast(d.fixed()) for d in dimensions if d.fixed() is not None}
    tuned = [d for d in dimensions if d.fixed() is None]
    if not tuned:
        return Proposal(fixed, "hpo")
    # Points outside the space (a warm-up batch size beyond the bounds) cannot be told to skopt.
    usable = [o for o in observations if all(d.name in o.point and d.contains(o.point[d.name]) for d in tuned)]
    entropy = np.random.SeedSequence([*seed, round_number]).generate_state(1)[0]
    # Repeating a good point is right here: each round trains a different architecture, so the
    # same hyperparameters are a new experiment (skopt would otherwise swap in a random point).
    optimizer = Optimizer([d.skopt() for d in tuned], base_estimator="gp", acq_func="EI", random_state=int(entropy),
                          n_initial_points=max(1, policy["hpo_start_round"] - 2), avoid_duplicates=False)
    if usable:
        optimizer.tell([[o.point[d.name] for d in tuned] for o in usable], [1.0 - o.quality for o in usable])
    with warnings.catch_warnings():  # "evaluated at point ... before": intended, see above
        warnings.simplefilter("ignore", UserWarning)
        point = dict(zip((d.name for d in tuned), optimizer.ask()))
    return Proposal({**fixed, **{d.name: d.cast(point[d.name]) for d in tuned}}, "hpo")
