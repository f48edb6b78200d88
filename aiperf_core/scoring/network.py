"""What the network cost a run: reported beside the score, never part of it (docs/scoring.md, "What the
network cost").

A replica's steps wait on communication for the seconds its backend measured in the gradient all-reduce
and the experts' all-to-all (epoch_end.all_reduce.seconds and epoch_end.all_to_all.seconds). With W those
waits summed over every replica:

- `share`: W over the replicas' time in train and eval steps (epoch_end.step_seconds summed): the share of
  step time spent waiting on communication;
- `efficiency` (the network efficiency): the score over the score an ideal network would have given.
  An ideal network would have given each replica back its waits, and the communication a backend ran
  outside the steps only to price their waits (epoch_end.pricing_seconds, P summed over every replica:
  jax times its collectives apart from the steps). With W' = W + P the replicas' time would have been
  L - W' of L, L their lives summed (from each one's first replica_start to its last event, as the busy
  fraction's). The run's time T (the score's) shortens by the waits of the replicas that ran at once:
  by W' / c, c = L / span their mean concurrency, span from the first replica_start to the last replica
  event. So efficiency = (T - W' / c) / T. Only the span shortens, not the primary's time before and
  after it (starting, launching, the report): in a one-replica run the time less the waits is T - W'. In
  a run to its deadline, whose replicas span its time (span = T), it is 1 - W' / L: the replicas would
  have run the same operations in (L - W') / L of their time;
- `ideal_score_ops`: the score over the network efficiency, the same operations over the time less the
  waits.

A trial's figures are the same over its own time in steps: share W_t / S_t, efficiency 1 - W_t / S_t, its
rate its operations over its time in steps, and its ideal-network rate the same over that time less its
waits (its pricing, outside its steps, is in none of them).

Where a backend measured no all-reduce seconds (it cannot: docs/backends/<name>.md), those epochs' waits
are unknown, and `complete` is false: the efficiency is then an upper bound.
"""

from __future__ import annotations

from typing import Any

from aiperf_core.scoring.ledger import AR_BYTES, AR_TIMED_BYTES, RunLedger, Trial


def waits(ledger: RunLedger) -> tuple[float, float, float, float, float]:
    """(seconds the steps waited on communication, seconds of communication outside the steps that priced
    those waits, seconds in steps, seconds of the replicas' lives, seconds of their span: from the first
    replica_start to the last replica event), every replica."""
    waited = ledger.all_to_all_seconds + ledger.all_reduce_seconds
    steps = sum(state.step_seconds for state in ledger.replicas.values())
    lived = [state for state in ledger.replicas.values() if state.life_seconds()]
    lives = sum(state.life_seconds() for state in lived)
    span = (max(s.last_time for s in lived) - min(s.starts[0]["time"] for s in lived)) if lived else 0.0
    return waited, ledger.pricing_seconds, steps, lives, span


def efficiency(waited: float, time: float) -> float | None:
    """1 - waited / time: the share of `time` an ideal network would still have taken; None without time."""
    return max(0.0, 1.0 - waited / time) if time > 0 else None


def run_efficiency(waited: float, lives: float, span: float, run_seconds: float) -> float | None:
    """The run's network efficiency (the module's docstring): its time less the waits over the replicas'
    mean concurrency (lives / span), over its time; None before a replica lived or the run's clock ran."""
    if lives <= 0 or span <= 0:
        return None
    return efficiency(waited * span / lives, run_seconds)


def run_network(ledger: RunLedger, score_ops: float, run_seconds: float) -> dict[str, Any] | None:
    """The run's network cost (the module's docstring), `run_seconds` the score's time; None when no trial
    communicated."""
    if not ledger.all_reduce_trials and not ledger.all_to_all_trials:
        return None
    waited, priced, steps, lives, span = waits(ledger)
    ratio = run_efficiency(waited + priced, lives, span, run_seconds)
    return {"wait_seconds": waited, "pricing_seconds": priced, "step_seconds": steps,
            "share": waited / steps if steps > 0 else None, "efficiency": ratio, "score_ops": score_ops,
            "ideal_score_ops": score_ops / ratio if ratio else None,
            "complete": ledger.all_reduce_timed_bytes == ledger.all_reduce_bytes}


def trial_network(trial: Trial, operations: int | None = None) -> dict[str, Any]:
    """A trial's network cost over its own time in steps (the module's docstring); `operations`, those of
    its epochs (None: its graph could not be counted)."""
    waited, steps = trial.wait_seconds(), trial.step_seconds
    complete = trial.all_reduce is None or trial.all_reduce[AR_TIMED_BYTES] == trial.all_reduce[AR_BYTES]
    known = operations is not None and steps > 0
    return {"wait_seconds": waited, "step_seconds": steps, "share": waited / steps if steps > 0 else None,
            "efficiency": efficiency(waited, steps), "complete": complete,
            "ops_per_second": operations / steps if known else None,
            "ideal_ops_per_second": operations / (steps - waited) if known and steps > waited else None}
