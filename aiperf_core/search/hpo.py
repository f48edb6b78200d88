"""HPO: scikit-optimize Bayesian optimisation over the batch size and the kernel size of
morph-added convs (paper section 4.2), one tuner per replica.

Rounds before policy["hpo_start_round"] are warm-up: they train with the policy's batch size
and a kernel of 3, and the tuner is told, for each, the accuracy predicted from its learning
curve (aiperf_core.search.curve), since a few warm-up epochs say little about the final value.
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
class Observation:
    batch_size: int
    kernel_size: int
    accuracy: float  # predicted final accuracy in warm-up rounds, else the best observed


@dataclass(frozen=True)
class Proposal:
    batch_size: int
    kernel_size: int
    source: str  # "warmup" or "hpo"


def warmup_kernel(policy: Mapping) -> int:
    kernels = policy["hpo_kernel_sizes"]
    return WARMUP_KERNEL if WARMUP_KERNEL in kernels else kernels[0]


def _in_space(policy: Mapping, obs: Observation) -> bool:
    low, high = policy["hpo_batch_size_bounds"]
    return low <= obs.batch_size <= high and obs.kernel_size in policy["hpo_kernel_sizes"]


def propose(policy: Policy, round_number: int, observations: Sequence[Observation], seed: Sequence[int]) -> Proposal:
    """Hyperparameters of round round_number. seed is [run seed, replica]."""
    if policy.is_warmup(round_number):
        return Proposal(policy["batch_size"], warmup_kernel(policy), "warmup")
    from skopt import Optimizer
    from skopt.space import Categorical, Integer

    low, high = policy["hpo_batch_size_bounds"]
    kernels = sorted(policy["hpo_kernel_sizes"])
    # skopt refuses one-valued dimensions; a dimension with one value is simply that value.
    dims, names = [], []
    if low < high:
        dims.append(Integer(low, high, prior="log-uniform", name="batch_size"))
        names.append("batch_size")
    if len(kernels) > 1:
        dims.append(Categorical(kernels, name="kernel_size"))
        names.append("kernel_size")
    fixed = {"batch_size": low, "kernel_size": kernels[0]}
    if not dims:
        return Proposal(fixed["batch_size"], fixed["kernel_size"], "hpo")
    # Points outside the space (a warm-up batch size beyond the bounds) cannot be told to skopt.
    usable = [o for o in observations if _in_space(policy, o)]
    entropy = np.random.SeedSequence([*seed, round_number]).generate_state(1)[0]
    # Repeating a good point is right here: each round trains a different architecture, so the
    # same hyperparameters are a new experiment (skopt would otherwise swap in a random point).
    optimizer = Optimizer(dims, base_estimator="gp", acq_func="EI", random_state=int(entropy),
                          n_initial_points=max(1, policy["hpo_start_round"] - 2), avoid_duplicates=False)
    if usable:
        xs = [[getattr(o, name) for name in names] for o in usable]
        optimizer.tell(xs, [1.0 - o.accuracy for o in usable])
    with warnings.catch_warnings():  # "evaluated at point ... before": intended, see above
        warnings.simplefilter("ignore", UserWarning)
        point = dict(zip(names, optimizer.ask()))
    return Proposal(int(point.get("batch_size", fixed["batch_size"])),
                    int(point.get("kernel_size", fixed["kernel_size"])), "hpo")
