"""The rules of a scored run (paper section 4.5, Table 4): what makes a run official.

A CNN run is valid only if it trained on ImageNet, every replica reading the copy of it that the
run recorded (the dataset digest), started from ResNet-50, searched by network morphism and
Bayesian optimisation, trained every trial at FP16 or above, reached a validation error of at most
30%, and changed no fixed setting. An LM run: the same, on enwik8 from the small GPT, reaching at
most 4 validation bits per byte. Anything else is labelled unofficial, with every reason listed.
The limits are the fixed items' defaults of the run's workload (Table 4's for the CNN), never the
run's configuration: a run cannot pass by loosening its own rules.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from aiperf_core import workloads
from aiperf_core.policy import BY_NAME, Policy, PolicyError, items_of, precision_allowed
from aiperf_core.rundir import RunDirError

MIN_PRECISION = BY_NAME["min_precision"].default
# Each workload's rules, numbered: a list ranks the results of one version, and a run made under
# another is unofficial in it (run.json `rules_version`; none recorded: version 1). lm 2
# (2026-12-07): replicas of 2 nodes where the machine has 2 or more, and HPO's batch bounds
# [32, 256] so that a step still asks a teraflop of each device of two 8-accelerator nodes
# (docs/search.md, "The official LM track").
RULES_VERSIONS = {"cnn": 1, "lm": 2}
# How the reasons name the official dataset and seed of each workload.
OFFICIAL_NAMES = {"imagenet": "ImageNet", "resnet50": "ResNet-50", "enwik8": "enwik8",
                  "gpt2_small": "GPT-2 small's shape"}


def official(workload: str) -> dict[str, Any]:
    """The fixed items' values an official run of `workload` keeps: its rules."""
    return {item.name: item.default_for(workload) for item in items_of(workload) if item.fixed}


def quality_rules(policy: Policy) -> dict[str, Any]:
    """The rules a run's quality is judged by: its workload's official ones, with the quality limit
    the run's own. A corpus sized for a CPU has its own (the embedded text's 4 bits per byte,
    aiperf_core.workflow.plan.EMBEDDED_LM_DEFAULTS), and any limit other than the official one is
    itself a reason (a changed fixed item), so no run passes as official on an easier rule."""
    workload = workloads.get(policy["workload"])
    item = workload.validity.limit_item
    return {**official(workload.name), item: policy[item]}


def run_policy(run: dict[str, Any]) -> Policy:
    """The policy recorded in run.json; a malformed one is an error naming the item."""
    values = run.get("policy", {})
    if not isinstance(values, dict):
        raise RunDirError(f"run.json: policy must be an object, got {type(values).__name__}")
    try:
        return Policy(values, source="run.json: policy")
    except PolicyError as exc:
        raise RunDirError(str(exc)) from None


def _short(digest: Any) -> str:
    return f"{digest[:16]}..." if isinstance(digest, str) else repr(digest)


def first_differing_starts(replicas: Mapping[int, Any], value: Callable[[dict], Any],
                           expected: Any) -> list[tuple[int, dict, Any]]:
    """(replica, its replica_start, value(start)) for each replica's first attempt whose value
    differs from `expected`. `replicas` map replica ids to objects whose .starts are their
    replica_start events."""
    found = []
    for replica, state in sorted(replicas.items()):
        start = next((s for s in state.starts if value(s) != expected), None)
        if start is not None:
            found.append((replica, start, value(start)))
    return found


def dataset_digest_reasons(run: dict[str, Any], replicas: Mapping[int, Any]) -> list[str]:
    """One reason per replica that read other data than the run's: an attempt whose
    replica_start.dataset_digest (the digest of the copy that replica read) differs from run.json's
    dataset.digest. `replicas` map replica ids to objects whose .starts are their replica_start events."""
    dataset = run.get("dataset")
    expected = dataset.get("digest") if isinstance(dataset, dict) else None
    reasons = []
    for replica, start, digest in first_differing_starts(replicas, lambda s: s.get("dataset_digest"), expected):
        attempt = start.get("attempt")
        if digest is None:
            reasons.append(f"replica {replica} recorded no dataset digest (attempt {attempt}), not the run's "
                           f"{_short(expected)}")
        elif expected is None:
            reasons.append(f"replica {replica} read dataset digest {_short(digest)} (attempt {attempt}), but "
                           "run.json records none")
        else:
            reasons.append(f"replica {replica} read dataset digest {_short(digest)} (attempt {attempt}), not the "
                           f"run's {_short(expected)}")
    return reasons


def official_nodes_per_replica(run: dict[str, Any]) -> int:
    """The lm rules' nodes per replica for the machine a run used: 2 where it used 2 or more nodes,
    else 1 (docs/search.md, "The official LM track"). The local executor's node processes share one
    machine, so its machine is one node whatever they are."""
    nodes = run_policy(run)["nodes_per_replica"]
    if run.get("executor", "local") == "local" or not isinstance(nodes, int):
        return 1
    return 2 if (run.get("replicas") or 1) * nodes >= 2 else 1


def replica_nodes_reasons(run: dict[str, Any]) -> list[str]:
    """An lm run whose replicas span other than the rules' nodes: one reason, naming both."""
    if run_policy(run).workload != "lm":
        return []
    nodes, official_nodes = run_policy(run)["nodes_per_replica"], official_nodes_per_replica(run)
    if nodes in (official_nodes, "auto"):  # auto is the rules' value by definition (plan.resolve_nodes_per_replica)
        return []
    machine = ("one machine (the local executor)" if run.get("executor", "local") == "local" else
               f"{(run.get('replicas') or 1) * nodes} node(s)")
    return [f"nodes_per_replica is {nodes!r} on {machine}, not {official_nodes} (the lm rules: 2 nodes a replica "
            f"where the machine has 2 or more, so that every step's gradients cross the network)"]


def validity_reasons(run: dict[str, Any], trials: Iterable[Any], best_error: float | None,
                     replicas: Mapping[int, Any] | None = None) -> list[str]:
    """Every reason the run is unofficial; empty for a valid run. `trials` have .id and .precision;
    `replicas` (the ledger's, each with its .starts) are checked for the dataset digest."""
    reasons: list[str] = []
    covered: set[str] = set()  # fixed items a fact-based reason already names
    policy = run_policy(run)
    workload = workloads.get(policy["workload"])
    rules = official(workload.name)

    dataset = run.get("dataset")
    name = dataset.get("name") if isinstance(dataset, dict) else None
    official_data = OFFICIAL_NAMES[rules["dataset"]]
    if name != rules["dataset"]:
        reasons.append(f"run.json records no dataset name ({official_data} required)" if name is None else
                       f"dataset is {name!r}, not {official_data} ({rules['dataset']!r})")
        covered.add("dataset")
    elif isinstance(dataset, dict) and dataset.get("official") is False:
        # A prepared text names itself enwik8 whatever its member held; its manifest says whether
        # that was the 100,000,000-byte enwik8 (docs/data.md).
        reasons.append(f"dataset {name!r} is not the official one: its manifest records official = false")
    reasons += dataset_digest_reasons(run, replicas or {})
    model = run.get("model")
    official_model = OFFICIAL_NAMES[rules["initial_architecture"]]
    if model != rules["initial_architecture"]:
        reasons.append(f"run.json records no initial model ({official_model} required)" if model is None else
                       f"initial architecture is {model!r}, not {official_model} ({rules['initial_architecture']!r})")
        covered.add("initial_architecture")

    low: dict[str, list[str]] = {}
    for trial in trials:
        if not precision_allowed(str(trial.precision), MIN_PRECISION):
            low.setdefault(str(trial.precision), []).append(trial.id)
    for precision, ids in sorted(low.items()):
        what = "no precision recorded" if precision == "None" else f"precision {precision} is below the minimum"
        reasons.append(f"{what} ({MIN_PRECISION} or above required): {len(ids)} trial(s), "
                       f"e.g. {', '.join(sorted(ids)[:3])}")

    reasons += workload.validity.reasons(quality_rules(policy), best_error)
    reasons += replica_nodes_reasons(run)
    made_under = run.get("rules_version", 1)
    if made_under != RULES_VERSIONS[workload.name]:
        reasons.append(f"made under the {workload.name} rules version {made_under!r}, not the current "
                       f"{RULES_VERSIONS[workload.name]} (run.json rules_version)")

    overridden = set(policy.overridden_fixed())
    recorded = run.get("policy_overridden_fixed") or []
    if not isinstance(recorded, list):
        raise RunDirError("run.json: policy_overridden_fixed must be a list")
    overridden.update(str(item) for item in recorded)
    for item in items_of(workload.name):  # Table 4's order
        if item.name in overridden and item.name not in covered:
            reasons.append(f"fixed setting {item.name} changed to {policy[item.name]!r} "
                           f"({'Table 4' if workload.name == 'cnn' else 'the lm rules'}: "
                           f"{item.default_for(workload.name)!r})")
    for name in sorted(overridden - set(BY_NAME)):
        reasons.append(f"fixed setting {name} changed (recorded in run.json)")
    return reasons
