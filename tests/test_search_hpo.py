import numpy as np

from aiperf_core.policy import Policy
from aiperf_core.search.hpo import Observation, propose
from aiperf_core.workloads import get


def cnn_propose(policy, round_number, observations, seed):
    return propose(policy, round_number, observations, seed, get("cnn").hpo.dimensions(policy))


def cnn(batch, kernel, quality):
    return Observation({"batch_size": batch, "kernel_size": kernel}, quality)


def test_warmup_rounds_use_the_policy_and_later_rounds_the_tuner():
    policy = Policy({"batch_size": 64})
    for r in (1, 2, 3):
        p = cnn_propose(policy, r, [], [0, 0])
        assert (p.batch_size, p.point["kernel_size"], p.source) == (64, 3, "warmup")
    assert cnn_propose(policy, 4, [], [0, 0]).source == "hpo"


def test_proposals_stay_within_the_policy_bounds():
    policy = Policy({"hpo_batch_size_bounds": [24, 96], "hpo_kernel_sizes": [3, 5], "batch_size": 32})
    rng = np.random.default_rng(0)
    observations = []
    for r in range(4, 16):
        p = cnn_propose(policy, r, observations, [7, 1])
        assert 24 <= p.batch_size <= 96 and p.point["kernel_size"] in (3, 5)
        observations.append(cnn(p.batch_size, p.point["kernel_size"], float(rng.uniform(0.5, 0.9))))


def test_a_warmup_point_outside_the_space_is_not_told_and_one_valued_dimensions_are_fixed():
    policy = Policy({"hpo_batch_size_bounds": [32, 32], "hpo_kernel_sizes": [5], "batch_size": 448})
    p = cnn_propose(policy, 4, [cnn(448, 3, 0.7)], [0, 0])
    assert (p.batch_size, p.point["kernel_size"]) == (32, 5)
    policy = Policy({"hpo_batch_size_bounds": [16, 64]})
    assert 16 <= cnn_propose(policy, 5, [cnn(448, 3, 0.7), cnn(32, 3, 0.6)], [0, 0]).batch_size <= 64


def test_proposals_depend_on_the_observations_and_round_only():
    policy = Policy({"batch_size": 64})
    observations = [cnn(64, 3, 0.5), cnn(64, 3, 0.6), cnn(64, 3, 0.7)]
    first = cnn_propose(policy, 6, observations, [3, 2])
    assert cnn_propose(policy, 6, observations, [3, 2]) == first


def test_the_tuner_moves_towards_better_observed_batch_sizes():
    policy = Policy({"hpo_batch_size_bounds": [16, 512], "hpo_kernel_sizes": [3]})
    # Accuracy is best at small batches: the tuner's proposals should end up small.
    observations = [cnn(b, 3, 0.9 - 0.3 * np.log2(b / 16) / 5) for b in (16, 24, 48, 128, 256, 512)]
    picks = [cnn_propose(policy, r, observations, [0, 0]).batch_size for r in range(4, 12)]
    assert np.median(picks) < 100


def test_the_lm_tunes_the_batch_size_and_a_learning_rate_factor_on_a_log_scale():
    policy = Policy({"workload": "lm", "hpo_lr_scale_bounds": [0.5, 2.0]})
    space = get("lm").hpo
    warmup = propose(policy, 1, [], [0, 0], space.dimensions(policy))
    assert warmup.point == {"batch_size": policy["batch_size"], "lr_scale": 1.0}
    assert space.learning_rate(policy, warmup) == policy["learning_rate"]
    # The best quality lies at a factor of 1.5: the proposals lean above 1.
    observations = [Observation({"batch_size": 32, "lr_scale": s}, 1.0 - abs(np.log2(s / 1.5)))
                    for s in (0.5, 0.7, 1.0, 1.4, 2.0)]
    picks = [propose(policy, r, observations, [0, 0], space.dimensions(policy)) for r in range(4, 10)]
    assert all(0.5 <= p.point["lr_scale"] <= 2.0 and isinstance(p.point["lr_scale"], float) for p in picks)
    low, high = policy["hpo_batch_size_bounds"]
    assert all(low <= p.batch_size <= high for p in picks)
    assert np.median([p.point["lr_scale"] for p in picks]) > 1.0
