"""The lm policy item `nas_morphs`: the morphs a round's candidates are drawn from."""

from __future__ import annotations

import pytest

from aiperf_core.builders import gpt
from aiperf_core.morph import transformer as transformer_morph
from aiperf_core.policy import TRANSFORMER_MORPHS, Policy, PolicyError
from aiperf_core.workloads.lm import Morphs


def test_the_items_names_are_the_transformer_morphs():
    assert TRANSFORMER_MORPHS == transformer_morph.OPERATORS
    assert Policy({"workload": "lm"})["nas_morphs"] == list(TRANSFORMER_MORPHS)


@pytest.mark.parametrize("value, problem", [
    ([], "must be a non-empty list of distinct morph names"),
    (["deeper", "deeper"], "must be a non-empty list of distinct morph names"),
    ("deeper", "must be a non-empty list of distinct morph names"),
    (["deeper", "wider"], "has 'wider', not a transformer morph"),
])
def test_bad_lists_name_the_item(value, problem):
    with pytest.raises(PolicyError, match=r"policy\.nas_morphs") as caught:
        Policy({"workload": "lm", "nas_morphs": value})
    assert problem in str(caught.value)


def test_candidates_come_only_from_the_listed_morphs_and_the_default_draws_as_before():
    seed = gpt(layers=2, hidden=32, heads=2, seq_len=8, vocab=32)
    only = Morphs().generate_candidates(seed, None, 6, 3, Policy({"workload": "lm", "nas_morphs": ["upcycle_moe"]}))
    assert only and {c.record["op"] for c in only} == {"upcycle_moe"}
    default = Morphs().generate_candidates(seed, None, 8, 3, Policy({"workload": "lm"}))
    before = transformer_morph.generate_candidates(seed, None, 8, 3,
                                                   transformer_morph.TransformerCaps(max_layers=24, max_width=2048,
                                                                                     max_heads=32, max_experts=16))
    assert [c.record for c in default] == [c.record for c in before]
