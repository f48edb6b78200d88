"""The LM track's official sizing, checked with the analytic count (never a timer): one official step
asks a teraflop of each device of a replica of two eight-accelerator nodes, and the embedded corpus keeps a CPU-sized,
unofficial default."""

from __future__ import annotations

from aiperf_core import workloads
from aiperf_core.data.text_corpus import embedded_corpus
from aiperf_core.policy import Policy
from aiperf_core.workflow.plan import EMBEDDED_LM_DEFAULTS, build_policy, RunRequest
from aiperf_opcount import count
from aiperf_opcount.memory import plan_memory

NODE_ACCELERATORS = 8
REPLICA_NODES = 2
TERA = 10 ** 12


def _official_seed(policy: Policy):
    return workloads.get("lm").seed.build(policy, embedded_corpus())


def test_one_official_step_gives_each_device_of_two_eight_accelerator_nodes_a_teraflop():
    policy = Policy({"workload": "lm"})
    seed = _official_seed(policy)
    heads = next(n for n in seed.nodes if n.op == "attention")
    assert (policy["seq_len"], policy["initial_architecture"]) == (1024, "gpt2_small")
    assert sum(n.op == "attention" for n in seed.nodes) >= 12 and seed.shapes[heads.id][-1] >= 768
    assert heads.attrs["head_dim"] == 64
    per_sequence = count(seed).total  # FP + BP, the paper convention
    # ... on a replica of two such nodes, the lm rules' replica wherever the machine has two or more.
    for batch in (policy["batch_size"], policy["hpo_batch_size_bounds"][0]):
        assert per_sequence * batch / (REPLICA_NODES * NODE_ACCELERATORS) >= TERA, batch
    # ... and the default global batch fits an 80 GB accelerator without accumulation at bf16.
    shard = -(-policy["batch_size"] // NODE_ACCELERATORS)
    assert plan_memory(seed, shard, 80 * 10 ** 9, "bf16", "adamw").micro_batch == shard


def test_the_embedded_corpus_keeps_a_cpu_sized_unofficial_default():
    values = build_policy(RunRequest(workload="lm"), "embedded")
    policy = Policy(values)
    assert {k: policy[k] for k in EMBEDDED_LM_DEFAULTS} == EMBEDDED_LM_DEFAULTS
    assert set(policy.overridden_fixed()) == {"dataset", "seq_len", "initial_architecture", "epoch_tokens", "val_tokens",
                                              "max_bits_per_byte"}
    assert count(_official_seed(policy)).total < count(_official_seed(Policy({"workload": "lm"}))).total / 1000
