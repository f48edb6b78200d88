import numpy as np

from aiperf_core.policy import Policy
from aiperf_core.search.hpo import Observation, propose


def test_warmup_rounds_use_the_policy_and_later_rounds_the_tuner():
    policy = Policy({"batch_size": 64})
    for r in (1, 2, 3):
        p = propose(policy, r, [], [0, 0])
        assert (p.batch_size, p.kernel_size, p.source) == (64, 3, "warmup")
    assert propose(policy, 4, [], [0, 0]).source == "hpo"


def test_proposals_stay_within_the_policy_bounds():
    policy = Policy({"hpo_batch_size_bounds": [24, 96], "hpo_kernel_sizes": [3, 5], "batch_size": 32})
    rng = np.random.default_rng(0)
    observations = []
    for r in range(4, 16):
        p = propose(policy, r, observations, [7, 1])
        assert 24 <= p.batch_size <= 96 and p.kernel_size in (3, 5)
        observations.append(Observation(p.batch_size, p.kernel_size, float(rng.uniform(0.5, 0.9))))


def test_a_warmup_point_outside_the_space_is_not_told_and_one_valued_dimensions_are_fixed():
    policy = Policy({"hpo_batch_size_bounds": [32, 32], "hpo_kernel_sizes": [5], "batch_size": 448})
    p = propose(policy, 4, [Observation(448, 3, 0.7)], [0, 0])
    assert (p.batch_size, p.kernel_size) == (32, 5)
    policy = Policy({"hpo_batch_size_bounds": [16, 64]})
    assert 16 <= propose(policy, 5, [Observation(448, 3, 0.7), Observation(32, 3, 0.6)], [0, 0]).batch_size <= 64


def test_proposals_depend_on_the_observations_and_round_only():
    policy = Policy({"batch_size": 64})
    observations = [Observation(64, 3, 0.5), Observation(64, 3, 0.6), Observation(64, 3, 0.7)]
    first = propose(policy, 6, observations, [3, 2])
    assert propose(policy, 6, observations, [3, 2]) == first


def test_the_tuner_moves_towards_better_observed_batch_sizes():
    policy = Policy({"hpo_batch_size_bounds": [16, 512], "hpo_kernel_sizes": [3]})
    # Accuracy is best at small batches: the tuner's proposals should end up small.
    observations = [Observation(b, 3, 0.9 - 0.3 * np.log2(b / 16) / 5) for b in (16, 24, 48, 128, 256, 512)]
    picks = [propose(policy, r, observations, [0, 0]).batch_size for r in range(4, 12)]
    assert np.median(picks) < 100
