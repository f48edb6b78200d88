"""Level 'parallel' (fp32): data-parallel training equals single-device training.

For a backend whose parallelism() declares data parallelism, every scenario trains the same model
from the same weights twice, on one device (TrainConfig.devices = its first device) and on two, with
the same global batch, and compares the exported weights (moving statistics included), the losses
and the image counts:

  parallel/matches_one_device       2 epochs of full batches: weights and losses within the
                                    declared tolerance ('parallel');
  parallel/synchronized_batch_norm  one step on a batch whose images differ wildly in offset, so
                                    that per-device statistics differ from the global ones: the
                                    moving statistics must be the global batch's;
  parallel/uneven_last_batch        a last global batch of 3 (shards of 2 and 1): exact image counts
                                    and equal weights (shard gradients weighted by shard size);
  parallel/empty_shard              a last global batch of 1 and a validation set of 1: one device
                                    gets nothing, and counts and weights must still be exact;
  parallel/gpt_matches_one_device   a small GPT on next-token labels, 2 epochs with the LM
                                    policy's step (AdamW with decay, warm-up then cosine, a
                                    gradient clip that engages) and an uneven last batch: the clip
                                    must see the global batch's gradient. The attention key biases
                                    are left out of the comparison: their exact gradient is zero,
                                    and AdamW turns rounding into steps of up to the learning rate.

For a backend whose parallelism() also declares expert parallelism (TrainConfig.expert_parallel):

  parallel/gpt_moe_expert_parallel_matches_one_device
                                    the GPT with its first MLP upcycled to 4 experts, top-2, trained
                                    as gpt_matches_one_device plus the load-balancing loss, with
                                    expert_parallel on 2 devices (2 experts each, tokens exchanged
                                    by all-to-all) against 1 device: the exported weights (the whole
                                    model, every expert, in the canonical layout), the losses and each
                                    epoch's expert load must agree, and the backend must have measured
                                    the all-to-all time of every epoch.

A data-parallel backend that does not declare it is certified to refuse it instead:

  parallel/gpt_moe_expert_parallel_refused
                                    expert_parallel on 2 devices is refused with a BackendError
                                    before anything trains, and Parallelism.expert_parallel_why_not says why.

Where fewer than two devices are visible, the level's work runs in a child process with
AIPERF_CPU_DEVICES=2 (aiperf_core.backend.CPU_DEVICES_ENV; a backend reads it when it first
initialises its framework, so it cannot be set in this process), with CUDA devices hidden when the
one visible device is an accelerator; the child writes its outcomes as JSON and the parent reports
them. With two or more devices visible (GPUs), the work runs in this process. The child runs with
faulthandler on (it and the processes it spawns, a backend's ranks) and its stderr in a file: a
scenario that raised there, or a child that died, is reported with how it ended, the last lines of
that stderr and the Python stacks faulthandler wrote (aiperf_conformance.kit.ChildRun). A kit run
that will reach the level starts the child when it starts (start_early), so that the child trains
beside the levels before it, whose work is mostly one thread (tracing, compiling, small ops).

A backend that declares no data parallelism is certified as single-device:

  parallel/one_device_matches_default  training with devices=(its first device,) equals
                                       devices=None, image counts exact with an uneven last batch;
  parallel/refuses_two_devices         asking for two devices is refused with a BackendError
                                       before anything trains, and the declaration is consistent
                                       (synchronised batch norm needs data parallelism).

For a backend whose parallelism() declares multi_node (a replica across nodes, TrainConfig.layout),
each check trains one scenario on 2 nodes of 1 device each, through the path a run takes: two OS
processes of this Python that share nothing but TCP on 127.0.0.1, each calling Backend.start_node
once and then train() with its place in the layout for each check in turn, as a replica's nodes
train its trials (aiperf_conformance.multi_node). Node 0's epoch reports and exported weights are
compared with 1 device on the combined batch, as above. A node that fails, or has not exited within
multi_node.NODE_EXIT_BOUND_S (then it is stopped), fails the check it was training and the ones
after it:

  parallel/multi_node_matches_one_device
                                    the CNN step (batch norm synchronised across the nodes), 2 epochs
                                    with an uneven last batch;
  parallel/gpt_multi_node_matches_one_device
                                    gpt_matches_one_device's GPT and LM step across the nodes;
  parallel/multi_node_expert_parallel_matches_one_device
                                    (with expert_parallel declared too) the upcycled GPT of
                                    gpt_moe_expert_parallel_matches_one_device, 2 experts on each
                                    node: node 0 must hold the whole model (the follower's experts
                                    included), and the losses, expert load and measured all-to-all
                                    time must be as that check requires.

A backend that does not declare it is certified to refuse it instead:

  parallel/multi_node_refused       a layout of 2 nodes is refused with a one-line BackendError
                                    before anything trains, quoting Parallelism.multi_node_why_not
                                    (a backend that gives no reason fails: it must say why).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from aiperf_core.backend import CPU_DEVICES_ENV, BackendError, Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt, resnet_one_block
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph, Node
from aiperf_core.replica_layout import ReplicaLayout
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import (Check, ChildProcessFailed, ChildRun, Context, Outcome, child_account, new_ops,
                                    output_size, read_text, relative_error)
from aiperf_conformance.levels.op import key_biases
from aiperf_conformance.multi_node import ADDR, NODES, NodesTrained, run_nodes

DATA_PARALLEL_CHECKS = ("matches_one_device", "synchronized_batch_norm", "uneven_last_batch", "empty_shard",
                        "gpt_matches_one_device")
EXPERT_PARALLEL_CHECK = "gpt_moe_expert_parallel_matches_one_device"
EXPERT_PARALLEL_REFUSED = "gpt_moe_expert_parallel_refused"
MULTI_NODE_CHECKS = ("multi_node_matches_one_device", "gpt_multi_node_matches_one_device")
MULTI_NODE_EXPERT_CHECK = "multi_node_expert_parallel_matches_one_device"
MULTI_NODE_REFUSED = "multi_node_refused"
MOE_CHECKS = (EXPERT_PARALLEL_CHECK, EXPERT_PARALLEL_REFUSED, MULTI_NODE_EXPERT_CHECK)  # on the upcycled GPT
LM_CHECKS = ("gpt_matches_one_device", "gpt_multi_node_matches_one_device") + MOE_CHECKS
SINGLE_DEVICE_CHECKS = ("one_device_matches_default", "refuses_two_devices")
CHILD_DEVICES = 2
CHILD_TIMEOUT = 1800  # seconds for the whole level in the child (MindSpore on 2 busy cores is slow)
BATCH = 16
LR = 0.05
MOE_AUX_LOSS = 0.01  # the lm policy's default
REFUSAL_TIMEOUT_S = 60.0  # the refused layout's bound on meeting its peers, which never come


@dataclass(frozen=True)
class Scenario:
    graph: Any  # () -> Graph
    train: int  # training images
    val: int  # validation images
    epochs: int
    offsets: bool = False  # per-image offsets, so that per-device BN statistics differ from global ones
    lm: bool = False  # token windows and the LM policy's optimizer step
    expert_parallel: bool = False  # TrainConfig.expert_parallel (and the load-balancing loss) on


def _resnet() -> Graph:
    # What the level compares (shards, the gradient all-reduce, synchronised statistics, image counts)
    # is per op, not per block: resnet_small's ops in one block (builders.resnet_one_block).
    return resnet_one_block((16, 16, 3), 3)


def _bn_probe() -> Graph:
    """conv -> batch norm (momentum 0.5: half of the moving statistics is this step's) -> head."""
    return Graph((
        Node("x", "input", (), {"shape": [8, 8, 3]}),
        Node("conv", "conv2d", ("x",), {"filters": 4, "kernel": [3, 3], "padding": [1, 1, 1, 1]}),
        Node("bn", "batch_norm", ("conv",), {"epsilon": 1e-3, "momentum": 0.5}),
        Node("relu", "relu", ("bn",), {}),
        Node("pool", "global_avg_pool", ("relu",), {}),
        Node("dense", "dense", ("pool",), {"units": 3}),
        Node("probs", "softmax", ("dense",), {}),
    ), name="bn_probe")


def _gpt() -> Graph:
    return gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)


def _gpt_moe() -> Graph:
    """_gpt with its MLP upcycled to 4 GELU experts, top-2: 2 experts a device on 2 devices."""
    from aiperf_core.morph.transformer import upcycle_moe

    return upcycle_moe(_gpt(), None, "h0_fc1", seed=5).graph


SCENARIOS = {
    "matches_one_device": Scenario(_resnet, 3 * BATCH, 10, 2),
    "gpt_matches_one_device": Scenario(_gpt, 2 * BATCH + 3, 5, 2, lm=True),
    EXPERT_PARALLEL_CHECK: Scenario(_gpt_moe, 2 * BATCH + 3, 5, 2, lm=True, expert_parallel=True),
    "synchronized_batch_norm": Scenario(_bn_probe, BATCH, 4, 1, offsets=True),
    "uneven_last_batch": Scenario(_resnet, 2 * BATCH + 3, 7, 1),
    "empty_shard": Scenario(_resnet, BATCH + 1, 1, 1),
    "one_device_matches_default": Scenario(_resnet, 2 * BATCH + 3, 7, 1),
    "multi_node_matches_one_device": Scenario(_resnet, 2 * BATCH + 3, 7, 2),
}
# Across nodes, the same training as on 2 devices of one node.
SCENARIOS["gpt_multi_node_matches_one_device"] = SCENARIOS["gpt_matches_one_device"]
SCENARIOS[MULTI_NODE_EXPERT_CHECK] = SCENARIOS[EXPERT_PARALLEL_CHECK]
QUICK_SCENARIOS = {  # --quick: fewer steps, the same edge cases
    "matches_one_device": Scenario(_resnet, 2 * BATCH, 4, 1),
    "one_device_matches_default": Scenario(_resnet, BATCH + 3, 3, 1),
    "multi_node_matches_one_device": Scenario(_resnet, BATCH + 3, 3, 1),
}


def scenario_of(name: str, quick: bool) -> Scenario | None:
    """The scenario check `name` trains (None for a check that trains none of its own)."""
    return (QUICK_SCENARIOS if quick else {}).get(name) or SCENARIOS.get(name)


def _data(scenario: Scenario, seed: int, classes: int, shape) -> Dataset:
    rng = np.random.default_rng(seed)
    n = scenario.train + scenario.val
    if scenario.lm:
        tokens = rng.integers(0, classes, (n, shape[0] + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        return Dataset(x[:scenario.train], y[:scenario.train], x[scenario.train:], y[scenario.train:], classes)
    x = rng.normal(0, 1, (n,) + tuple(shape))
    if scenario.offsets:
        # The images the first epoch's order (the contract's rule for in-memory data,
        # default_rng(seed + epoch)) puts in the first device's shard are shifted up and scaled
        # down, the others shifted down: each device's batch statistics are far from the global ones.
        first = np.random.default_rng(seed).permutation(scenario.train)[:scenario.train // 2]
        shift = np.full(n, -2.0)
        shift[first] = 2.0
        scale = np.where(shift > 0, 0.5, 1.5)
        x = x * scale[:, None, None, None] + shift[:, None, None, None]
    y = rng.integers(0, classes, n)
    x = x.astype(np.float32)
    return Dataset(x[:scenario.train], y[:scenario.train], x[scenario.train:], y[scenario.train:], classes)


def train_scenario(backend, scenario: Scenario, seed: int, devices, layout: ReplicaLayout | None = None,
                   on_epoch=None) -> tuple[list, dict]:
    """(epoch reports, exported weights) of `scenario` trained on `devices`: on this node's devices
    of a replica across nodes where `layout` is given (every node calls this alike)."""
    graph = scenario.graph()
    weights = trained_looking_weights(graph, seed)
    data = _data(scenario, seed, graph.output_shape[-1], graph.input_shape)
    model = backend.lower(graph, weights)
    config = TrainConfig(epochs=scenario.epochs, batch_size=BATCH, schedule=Schedule(initial=LR), seed=seed,
                         devices=devices, layout=layout)
    if scenario.lm:  # a clip at 0.05 engages on every step of these random labels (norms above 1)
        config = TrainConfig(epochs=scenario.epochs, batch_size=BATCH, seed=seed, devices=devices,
                             schedule=Schedule(initial=0.01, final_fraction=0.1, warmup_epochs=1, shape="cosine"),
                             optimizer="adamw", weight_decay=0.1, grad_clip=0.05,
                             moe_aux_loss=MOE_AUX_LOSS if scenario.expert_parallel else 0.0,
                             expert_parallel=scenario.expert_parallel, layout=layout)
    reports = backend.train(model, data, config, on_epoch)
    return reports, backend.export_weights(model)


def _counts(reports, scenario: Scenario, what: str) -> Outcome | None:
    if len(reports) != scenario.epochs:
        return Outcome(False, len(reports), scenario.epochs, None,
                       f"{what}: {len(reports)} epoch reports for {scenario.epochs} epochs")
    for r in reports:
        if r.train_images != scenario.train or r.val_images != scenario.val:
            return Outcome(False, [r.train_images, r.val_images], [scenario.train, scenario.val], 0,
                           f"{what}, epoch {r.epoch}: counted {r.train_images} training and {r.val_images} "
                           f"validation images, the epoch had {scenario.train} and {scenario.val} (batches "
                           f"of {BATCH}, the last one short)")
    return None


def _agree(one: tuple[list, dict], other: tuple[list, dict], tol: float, what: str,
           only: str | None = None, skip: frozenset = frozenset()) -> Outcome:
    """Weights (every parameter and moving statistic, or those of node `only`, less the (node,
    parameter) pairs in `skip`) and per-epoch losses of `other` against `one`, as relative errors."""
    (reports_a, weights_a), (reports_b, weights_b) = one, other
    worst, where = 0.0, ""
    for node_id, params in weights_a.items():
        if only is not None and node_id != only:
            continue
        for name, value in params.items():
            if (node_id, name) in skip:
                continue
            got = weights_b.get(node_id, {}).get(name)
            if got is None or np.shape(got) != np.shape(value):
                return Outcome(False, None, list(np.shape(value)), tol,
                               f"{what}: node '{node_id}' weight '{name}' missing or misshapen")
            if not np.all(np.isfinite(got)):
                return Outcome(False, "non-finite", "finite", tol, f"{what}: node '{node_id}' weight '{name}' "
                                                                   f"is not finite")
            err = relative_error(got, value)
            if err > worst:
                worst, where = err, f"node '{node_id}' weight '{name}'"
    if only is None:
        for a, b in zip(reports_a, reports_b):
            for field in ("loss", "val_loss"):
                err = abs(getattr(b, field) - getattr(a, field)) / max(abs(getattr(a, field)), 1e-12)
                if err > worst:
                    worst, where = err, f"epoch {a.epoch} {field} ({getattr(b, field):.6g} vs {getattr(a, field):.6g})"
    return Outcome(worst <= tol, worst, 0.0, tol, f"{what}: largest relative difference {worst:.3g} "
                                                  f"({where or 'none'}; tolerance {tol:g})")


def _too_few_devices(backend, devices: list[str]) -> Outcome:
    return Outcome(False, len(devices), CHILD_DEVICES, None,
                   f"backend '{backend.name}' declares data parallelism but exposes {len(devices)} device(s) "
                   f"({', '.join(devices)}) with {CPU_DEVICES_ENV}={CHILD_DEVICES} set and no accelerator: it "
                   f"must expose that many CPU devices (read {CPU_DEVICES_ENV} when the framework initialises)")


def _one_device(backend, scenario: Scenario, seed: int, device: str, ones: dict | None) -> tuple[list, dict]:
    """`scenario` trained on `device` alone: the answer a check on 2 devices or 2 nodes is compared with.
    Within one run of the level, a scenario that two checks train (gpt_matches_one_device and
    gpt_multi_node_matches_one_device, and their upcycled GPT's) is trained on one device once, in
    `ones`: the same graph, weights, data, config and device give the same reference for both."""
    if ones is None:
        return train_scenario(backend, scenario, seed, (device,))
    key = (scenario, seed, device)
    if key not in ones:
        ones[key] = train_scenario(backend, scenario, seed, (device,))
    return ones[key]


def _data_parallel(backend, name: str, scenario: Scenario, seed: int, tol: float,
                   ones: dict | None = None) -> Outcome:
    devices = list(backend.devices())
    if len(devices) < 2:
        return _too_few_devices(backend, devices)
    pair = tuple(devices[:2])
    one = _one_device(backend, scenario, seed, devices[0], ones)
    two = train_scenario(backend, scenario, seed, pair)
    on = f"2 devices ({', '.join(pair)}) vs 1 ({devices[0]})"
    for reports, what in ((one[0], "1 device"), (two[0], "2 devices")):
        bad = _counts(reports, scenario, what)
        if bad:
            return bad
    if name == "synchronized_batch_norm":
        if not backend.parallelism().synchronized_batch_norm:
            return Outcome(False, False, True, None, f"backend '{backend.name}' declares data parallelism without "
                                                     f"synchronised batch norm: training on several devices would "
                                                     f"not equal one device")
        outcome = _agree(one, two, tol, f"{on}: moving statistics of node 'bn' after one step", only="bn")
        if not outcome.passed:
            outcome.message += ": batch-norm statistics are per device, not those of the global batch"
            return outcome
    return _compared(scenario, one, two, on, tol, "2 devices")


def _compared(scenario: Scenario, one: tuple[list, dict], many: tuple[list, dict], on: str, tol: float,
              what: str) -> Outcome:
    """Training on `what` (2 devices, 2 nodes) against one device, both with correct image counts:
    weights and losses (the attention key biases left out, as the level's docstring says), and
    under expert parallelism the records each epoch must carry."""
    outcome = _agree(one, many, tol, on, skip=key_biases(scenario.graph()) if scenario.lm else frozenset())
    if outcome.passed and scenario.expert_parallel:
        outcome = _expert_parallel_records(one[0], many[0], on, outcome, what)
    if outcome.passed and scenario.train % BATCH:
        last = scenario.train % BATCH
        shards = [len(s) for s in np.array_split(np.arange(last), 2)]
        outcome.message += f"; {scenario.train} training images counted exactly (last batch {last}: shards {shards})"
    return outcome


def _expert_parallel_records(one: list, two: list, on: str, agreed: Outcome, what: str = "2 devices") -> Outcome:
    """Each epoch's expert load on `what` equals 1 device's (the counts are the global batch's,
    not a device's), and every epoch there measured its all-to-all seconds."""
    for a, b in zip(one, two):
        if a.expert_load is None or dict(b.expert_load or {}) != dict(a.expert_load):
            return Outcome(False, b.expert_load, a.expert_load, 0,
                           f"{on}, epoch {a.epoch}: expert load {b.expert_load} on {what}, {a.expert_load} on 1")
        seconds = b.all_to_all_seconds
        if seconds is None or not np.isfinite(seconds) or seconds <= 0:
            return Outcome(False, seconds, "> 0", None,
                           f"{on}, epoch {b.epoch}: all_to_all_seconds is {seconds!r}; an expert-parallel epoch "
                           f"measures the time its all-to-all exchanges took")
    seconds = ", ".join(f"{r.all_to_all_seconds:.3g}" for r in two)
    agreed.message += f"; expert load equal every epoch; all-to-all seconds per epoch measured: {seconds}"
    return agreed


def _expert_parallel_refused(backend, seed: int) -> Outcome:
    """A data-parallel backend without expert parallelism refuses it on 2 devices, before training,
    and its declaration says why."""
    declared = backend.parallelism()
    if not declared.expert_parallel_why_not.strip():
        return Outcome(False, "", "a reason", None, f"backend '{backend.name}' declares no expert parallelism and "
                                                    f"gives no reason in Parallelism.expert_parallel_why_not")
    devices = list(backend.devices())
    if len(devices) < 2:
        return _too_few_devices(backend, devices)
    graph = _gpt_moe()
    asked = tuple(devices[:2])
    return _refused(backend, graph, SCENARIOS[EXPERT_PARALLEL_CHECK], seed,
                    TrainConfig(epochs=1, batch_size=BATCH, devices=asked, expert_parallel=True),
                    "expert parallelism", f"expert parallelism on {', '.join(asked)} refused",
                    f"backend '{backend.name}' declares no expert parallelism but trained with expert_parallel on "
                    f"{list(asked)}")


def _refused(backend, graph: Graph, scenario: Scenario, seed: int, config: TrainConfig, what: str, passed: str,
             trained: str, quoting: tuple[str, str] | None = None) -> Outcome:
    """Training `graph` with `config` must raise a BackendError before any weight changes; with
    `quoting` (a declaration's name, its text), one of a single line that quotes that text."""
    weights = trained_looking_weights(graph, seed)
    model = backend.lower(graph, weights)
    data = _data(scenario, seed, graph.output_shape[-1], graph.input_shape)
    try:
        backend.train(model, data, config)
    except BackendError as exc:
        after = backend.export_weights(model)
        changed = [n for n in weights for p in weights[n] if not np.array_equal(after[n][p], weights[n][p])]
        if changed:
            return Outcome(False, changed[:3], [], None, f"refused {what} ({exc}) but trained first: node "
                                                         f"'{changed[0]}' changed")
        text = str(exc).strip()
        if quoting is not None and ("\n" in text or quoting[1] not in text):
            return Outcome(False, text, quoting[1], None, f"refused {what}, but not in one line that quotes "
                                                          f"{quoting[0]}: {text!r}")
        return Outcome(True, "refused", "refused", None, f"{passed}: {exc}")
    return Outcome(False, "trained", "BackendError", None, trained)


# -- a replica across nodes -----------------------------------------------------------------------


def _multi_node(backend, names: list[str], seed: int, tol: float, quick: bool,
                ones: dict | None = None) -> dict[str, Outcome]:
    """Each multi-node check of `names` against 1 device: their scenarios trained one after the other
    by one launch of 2 nodes of 1 device each (aiperf_conformance.multi_node), as a replica's nodes
    train its trials."""
    declared = backend.parallelism()
    if not declared.data_parallel:
        failed = Outcome(False, False, True, None, f"backend '{backend.name}' declares multi_node without data "
                                                   f"parallelism: the devices of a replica's nodes train as one "
                                                   f"data-parallel group")
        return dict.fromkeys(names, failed)
    device = backend.devices()[0]
    one = {name: _one_device(backend, scenario_of(name, quick), seed, device, ones) for name in names}
    trained = run_nodes(_class_path(backend), names, seed, quick)
    return {name: _multi_node_outcome(scenario_of(name, quick), one[name], trained[name], device, tol)
            for name in names}


def _multi_node_outcome(scenario: Scenario, one: tuple[list, dict], nodes: NodesTrained | str, device: str,
                        tol: float) -> Outcome:
    bad = _counts(one[0], scenario, "1 device")
    if bad:
        return bad
    if isinstance(nodes, str):  # the launch failed before both nodes had trained it
        return Outcome(False, None, None, None, nodes)
    where = ", ".join(f"node {rank}: {d}" for rank, d in enumerate(nodes.devices))
    on = f"{NODES} nodes x 1 device ({where}) vs 1 device ({device})"
    bad = _counts(nodes.reports, scenario, f"node 0 of {NODES}")
    if bad:
        return bad
    if nodes.on_epoch_calls != len(nodes.reports):
        return Outcome(False, nodes.on_epoch_calls, len(nodes.reports), 0,
                       f"{on}: node 0's on_epoch was called {nodes.on_epoch_calls} time(s) for {len(nodes.reports)} "
                       f"epochs: the node that leads a replica reports every epoch to it")
    missing = _not_held(one[1], nodes.weights)
    if missing:
        return Outcome(False, missing, "every weight", None,
                       f"{on}: node 0 does not hold the whole model after training: {missing}; the weights a "
                       f"follower trained (its experts) must be gathered to node 0")
    outcome = _compared(scenario, one, (nodes.reports, nodes.weights), on, tol, f"{NODES} nodes")
    outcome.message += f"; the nodes trained it in {' and '.join(f'{t:.1f}' for t in nodes.seconds)} s"
    return outcome


def _not_held(whole: dict, held: dict) -> str:
    """The first weight of `whole` that `held` lacks or holds in another shape ('' if none)."""
    for node_id, params in whole.items():
        for param, value in params.items():
            got = held.get(node_id, {}).get(param)
            if got is None:
                return f"node '{node_id}' weight '{param}' is missing"
            if np.shape(got) != np.shape(value):
                return f"node '{node_id}' weight '{param}' has shape {list(np.shape(got))}, not {list(np.shape(value))}"
    return ""


def _multi_node_refused(backend, seed: int) -> Outcome:
    """A backend without multi-node support refuses a layout of 2 nodes in one line, before training,
    quoting its declared reason."""
    from aiperf_core.replica_nodes import free_port

    why = backend.parallelism().multi_node_why_not.strip()
    if not why:
        return Outcome(False, "", "a reason", None, f"backend '{backend.name}' declares no multi-node support and "
                                                    f"gives no reason in Parallelism.multi_node_why_not")
    device = backend.devices()[0]
    # Nothing listens at the coordinator: a backend that tried to meet its peers would wait there.
    layout = ReplicaLayout(nodes=NODES, devices_per_node=1, local_devices=(device,), coordinator_addr=ADDR,
                           coordinator_port=free_port(ADDR), timeout_s=REFUSAL_TIMEOUT_S)
    return _refused(backend, _resnet(), SCENARIOS["uneven_last_batch"], seed,
                    TrainConfig(epochs=1, batch_size=BATCH, devices=(device,), layout=layout),
                    f"a replica of {NODES} nodes", f"a replica of {NODES} nodes refused",
                    f"backend '{backend.name}' declares no multi-node support but trained with a layout of {NODES} "
                    f"nodes", quoting=("Parallelism.multi_node_why_not", why))


def _single_device(backend, name: str, scenario: Scenario | None, seed: int, tol: float) -> Outcome:
    devices = list(backend.devices())
    declared = backend.parallelism()
    if name == "one_device_matches_default":
        explicit = train_scenario(backend, scenario, seed, (devices[0],))
        bad = _counts(explicit[0], scenario, f"devices=({devices[0]},)")
        if bad:
            return bad
        if len(devices) > 1:  # devices=None would mean all of them, which the contract refuses
            try:
                train_scenario(backend, scenario, seed, None)
            except BackendError as exc:
                return Outcome(True, "refused", "refused", None,
                               f"{scenario.train} training images counted exactly on {devices[0]}; "
                               f"devices=None with {len(devices)} visible refused: {exc}")
            return Outcome(False, "trained", "BackendError", None, f"devices=None trained on {len(devices)} "
                                                                   f"devices without data parallelism")
        default = train_scenario(backend, scenario, seed, None)
        bad = _counts(default[0], scenario, "devices=None")
        if bad:
            return bad
        outcome = _agree(explicit, default, tol, f"devices=({devices[0]},) vs devices=None")
        if outcome.passed:
            outcome.message += f"; {scenario.train} training images counted exactly (last batch {scenario.train % BATCH})"
        return outcome
    if declared.synchronized_batch_norm:
        return Outcome(False, True, False, None, f"backend '{backend.name}' declares synchronised batch norm "
                                                 f"without data parallelism")
    asked = (devices[0], devices[1] if len(devices) > 1 else "second-device")
    return _refused(backend, _resnet(), SCENARIOS["uneven_last_batch"], seed,
                    TrainConfig(epochs=1, batch_size=BATCH, devices=asked), "two devices",
                    f"single device ({len(devices)} visible: {', '.join(devices)}); two devices refused",
                    f"backend '{backend.name}' declares no data parallelism but trained on devices {list(asked)}")


def run_scenarios(backend, seed: int, quick: bool, tol: float, stderr_path: str | None = None,
                  workloads: list[str] | None = None) -> dict:
    """Every outcome of the level for `backend` (of the checks of `workloads`, None: all), as
    JSON-ready dicts by check name (an exception in one scenario is that check's 'error', never the
    others'). With `stderr_path` (the file this process's stderr goes to), an error also records the
    span [start, end) of that file written during its scenario, by this process and the ones it
    spawned."""
    data_parallel = backend.parallelism().data_parallel
    names = [name for name in _names(backend.parallelism()) if workloads is None or _workload(name) in workloads]
    across_nodes = [name for name in names if name in MULTI_NODE_CHECKS + (MULTI_NODE_EXPERT_CHECK,)]
    trained_across_nodes: dict[str, Outcome] | Exception | None = None  # one launch for all of them
    ones: dict = {}  # each scenario trained on one device, once (_one_device)
    out: dict[str, dict] = {}
    for name in names:
        sys.stderr.flush()
        start = output_size(stderr_path) if stderr_path else 0
        try:
            if name == EXPERT_PARALLEL_REFUSED:
                outcome = _expert_parallel_refused(backend, seed)
            elif name == MULTI_NODE_REFUSED:
                outcome = _multi_node_refused(backend, seed)
            elif name in across_nodes:
                if trained_across_nodes is None:
                    try:
                        trained_across_nodes = _multi_node(backend, across_nodes, seed, tol, quick, ones)
                    except Exception as exc:  # every check of the launch reports it
                        trained_across_nodes = exc
                if isinstance(trained_across_nodes, Exception):
                    raise trained_across_nodes
                outcome = trained_across_nodes[name]
            else:
                if data_parallel:
                    outcome = _data_parallel(backend, name, scenario_of(name, quick), seed, tol, ones)
                else:
                    outcome = _single_device(backend, name, scenario_of(name, quick), seed, tol)
            out[name] = {"passed": bool(outcome.passed), "measured": _plain(outcome.measured),
                         "expected": _plain(outcome.expected), "tolerance": outcome.tolerance,
                         "message": outcome.message}
        except Exception as exc:
            # Framework errors span lines (TensorFlow's: a header, the traceback of the graph, the
            # cause); keep the text without the traceback, on one line.
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            text = " ".join(line for line in lines if not line.startswith('File "'))
            out[name] = {"error": f"{type(exc).__name__}: {text}"[:600]}
            if stderr_path:
                sys.stderr.flush()
                out[name]["stderr"] = [start, output_size(stderr_path)]
    return out


def _names(declared) -> tuple[str, ...]:
    """The checks of a backend that declares `declared` (a Parallelism)."""
    if declared.multi_node:
        nodes = MULTI_NODE_CHECKS + ((MULTI_NODE_EXPERT_CHECK,) if declared.expert_parallel else ())
    else:
        nodes = (MULTI_NODE_REFUSED,)
    if not declared.data_parallel:
        return SINGLE_DEVICE_CHECKS + nodes
    experts = EXPERT_PARALLEL_CHECK if declared.expert_parallel else EXPERT_PARALLEL_REFUSED
    return DATA_PARALLEL_CHECKS + (experts,) + nodes


ALL_CHECKS = (DATA_PARALLEL_CHECKS + (EXPERT_PARALLEL_CHECK, EXPERT_PARALLEL_REFUSED) + SINGLE_DEVICE_CHECKS
              + MULTI_NODE_CHECKS + (MULTI_NODE_EXPERT_CHECK, MULTI_NODE_REFUSED))
_APPLIES_TO = {
    **dict.fromkeys(DATA_PARALLEL_CHECKS, "data-parallel backends"),
    EXPERT_PARALLEL_CHECK: "expert-parallel backends",
    EXPERT_PARALLEL_REFUSED: "data-parallel backends without expert parallelism",
    **dict.fromkeys(SINGLE_DEVICE_CHECKS, "single-device backends"),
    **dict.fromkeys(MULTI_NODE_CHECKS, "multi-node backends"),
    MULTI_NODE_EXPERT_CHECK: "multi-node expert-parallel backends",
    MULTI_NODE_REFUSED: "backends without multi-node support",
}


def applies_to(name: str) -> str:
    """Which backends check `name` certifies (the vendor guide's check table)."""
    return _APPLIES_TO[name]


def _workload(name: str) -> str:
    return "lm" if name in LM_CHECKS else "cnn"


def _plain(value):
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- where the work runs --------------------------------------------------------------------------


class ParallelLevelError(Exception):
    """The level's work raised, here or in its child process."""


def _class_path(backend) -> str:
    cls = type(backend)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise AiperfError(f"the parallel level trains backend '{backend.name}' in a child process, which must "
                          f"import its class: define {cls.__qualname__} in an importable module")
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_accelerator(device: str) -> bool:
    return device.split(":")[0].split(" ")[0].lower() != "cpu"


class _Child:
    """The level's work in a child process that sees CHILD_DEVICES CPU devices, started when made;
    `outcomes` awaits it. Its outcomes come back as JSON (the frameworks print to stdout and stderr,
    so the results travel in a file), each error with the account of its scenario's stderr."""

    def __init__(self, ctx: Context):
        env = dict(os.environ, **{CPU_DEVICES_ENV: str(CHILD_DEVICES)})
        if _is_accelerator(ctx.device or ""):
            env["CUDA_VISIBLE_DEVICES"] = ""  # one accelerator cannot train on two: certify the path on CPUs
        self.what = f"the child process ({CPU_DEVICES_ENV}={CHILD_DEVICES})"
        backend_class = _class_path(ctx.backend)
        self.tmp = tempfile.TemporaryDirectory(prefix="aiperf-parallel-")
        spec_path, self.out_path = os.path.join(self.tmp.name, "spec.json"), os.path.join(self.tmp.name, "outcomes.json")
        self.stderr_path = os.path.join(self.tmp.name, "stderr.txt")
        spec = {"backend_class": backend_class, "seed": ctx.seed, "quick": ctx.quick,
                "tolerance": ctx.tolerance("parallel"), "sys_path": [p for p in sys.path if p],
                "stderr": self.stderr_path, "workloads": None if ctx.workloads is None else list(ctx.workloads)}
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        code = "import sys; from aiperf_conformance.levels.parallel import child_main; sys.exit(child_main(sys.argv[1:]))"
        try:
            self.run = ChildRun([sys.executable, "-c", code, spec_path, self.out_path], env, CHILD_TIMEOUT,
                                self.stderr_path, self.what)
        except BaseException:
            self.tmp.cleanup()
            raise

    def outcomes(self) -> dict:
        try:
            self.run.wait()
            if not os.path.exists(self.out_path):
                raise ChildProcessFailed(f"{self.what} exited 0 without writing its outcomes\n"
                                         + child_account(read_text(self.stderr_path)))
            with open(self.out_path) as f:
                found = json.load(f)
            for outcome in found["outcomes"].values():
                span = outcome.pop("stderr", None)
                if span is not None:
                    outcome["account"] = child_account(read_text(self.stderr_path, *span))
            return found
        finally:
            self.tmp.cleanup()


def _needs_child(backend) -> bool:
    return backend.parallelism().data_parallel and len(backend.devices()) < CHILD_DEVICES


def start_early(ctx: Context) -> None:
    """Start the level's child process now, for a kit run that will reach the level later: its
    training then runs beside the levels before it (their work is mostly one thread: compiling,
    small ops), not after them. Nothing starts where the level runs in this process (two devices
    visible) or was started already; a backend whose class the child cannot import reports that
    when the level runs."""
    if ctx.backend is None or "parallel" in ctx.cache or "parallel_child" in ctx.cache:
        return
    try:
        if _needs_child(ctx.backend):
            ctx.cache["parallel_child"] = _Child(ctx)
    except AiperfError:
        pass  # _outcomes meets it again and reports it as every check's error


def backend_from_spec(spec: dict):
    """An instance of the backend class a child's spec names (`_class_path`), found on the parent's
    sys.path (`sys_path`)."""
    import importlib

    for entry in spec["sys_path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    module, qualname = spec["backend_class"].split(":")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls()


def child_main(argv: list[str]) -> int:
    """The child process: load the backend class, run every scenario, write the outcomes."""
    from aiperf_core.atomic import write_text_atomic

    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    backend = backend_from_spec(spec)
    devices = list(backend.devices())
    outcomes = run_scenarios(backend, spec["seed"], spec["quick"], spec["tolerance"], spec.get("stderr"),
                             spec.get("workloads"))
    write_text_atomic(out_path, json.dumps({"devices": devices, "outcomes": outcomes}))
    return 0


def _outcomes(ctx: Context) -> dict:
    if "parallel" not in ctx.cache:
        backend = ctx.backend
        try:
            if _needs_child(backend):
                found = (ctx.cache.pop("parallel_child", None) or _Child(ctx)).outcomes()
                where = f"child process with {CPU_DEVICES_ENV}={CHILD_DEVICES}: {', '.join(found['devices'])}"
                ctx.cache["parallel"] = (found["outcomes"], where)
            else:
                ctx.cache["parallel"] = (run_scenarios(backend, ctx.seed, ctx.quick, ctx.tolerance("parallel"),
                                                       workloads=None if ctx.workloads is None else list(ctx.workloads)),
                                         ", ".join(backend.devices()))
        except (AiperfError, ParallelLevelError, ChildProcessFailed) as exc:
            ctx.cache["parallel"] = exc
    found = ctx.cache["parallel"]
    if isinstance(found, Exception):  # every check of the level reports it
        raise (ChildProcessFailed if isinstance(found, ChildProcessFailed) else ParallelLevelError)(str(found))
    return found


def _check(ctx: Context, name: str) -> Outcome:
    outcomes, where = _outcomes(ctx)
    if name not in outcomes:
        raise ParallelLevelError(f"the check applies to {applies_to(name)}: no outcome for '{name}'")
    found = outcomes[name]
    if "error" in found and "account" in found:
        raise ChildProcessFailed(f"on {where}: {found['error']}\n{found['account']}")
    if "error" in found:
        raise ParallelLevelError(f"on {where}: {found['error']}")
    return Outcome(found["passed"], found["measured"], found["expected"], found["tolerance"],
                   found["message"], device=where)


def checks(ctx: Context):
    names = ALL_CHECKS if ctx.backend is None else _names(ctx.backend.parallelism())  # None: --list, every check
    for name in names:
        graph = _gpt_moe() if name in MOE_CHECKS else _gpt()
        lm = dict(workload="lm", ops=new_ops(graph)) if _workload(name) == "lm" else {}
        yield Check("parallel", name, partial(_check, name=name), **lm)
