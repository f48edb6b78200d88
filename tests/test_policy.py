import pytest

from aiperf_core.policy import Policy, PolicyError, precision_allowed


def test_defaults_follow_table_4():
    p = Policy()
    assert p["dataset"] == "imagenet" and p["initial_architecture"] == "resnet50"
    assert p["batch_size"] == 448 and p["learning_rate"] == 0.1 and p["max_epochs"] == 60
    assert p["min_precision"] == "fp16" and p["max_error"] == 0.30
    assert p.overridden_fixed() == []


def test_overriding_a_fixed_item_is_recorded_not_refused():
    p = Policy({"dataset": "digits", "batch_size": 64})
    assert p.overridden_fixed() == ["dataset"]


@pytest.mark.parametrize("values, field", [
    ({"batch_size": 0}, "policy.batch_size"),
    ({"max_epochs": 61}, "policy.max_epochs"),
    ({"hpo_kernel_sizes": [3, 4]}, "policy.hpo_kernel_sizes"),
    ({"bogus": 1}, "policy.bogus"),
    ({"warmup_epochs": [70]}, "policy.warmup_epochs"),
])
def test_bad_values_name_the_item(values, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        Policy(values)


def test_rules_for_rate_patience_and_epochs():
    p = Policy()
    assert p.learning_rate_for(448) == pytest.approx(0.1)
    assert p.learning_rate_for(224) == pytest.approx(0.05)
    assert [p.patience_for(r) for r in (1, 2, 8, 20)] == [3, 4, 10, 10]
    assert [p.epochs_for(r) for r in (1, 2, 3, 4, 9)] == [15, 30, 45, 60, 60]
    assert p.is_warmup(3) and not p.is_warmup(4)
    assert precision_allowed("bf16") and precision_allowed("fp32") and not precision_allowed("fp8")
    assert precision_allowed("tf32")  # fp16's 10-bit mantissa, fp32's 8-bit exponent (docs/scoring.md)


def test_precision_defaults_to_auto_and_accepts_only_known_names():
    assert Policy()["precision"] == "auto"
    for name in ("auto", "fp32", "tf32", "bf16", "fp16"):
        assert Policy({"precision": name})["precision"] == name
    with pytest.raises(PolicyError, match=r"^policy\.precision: 'fp8' must be one of auto, fp32, tf32, bf16, fp16$"):
        Policy({"precision": "fp8"})
