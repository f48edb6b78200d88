"""Shared helpers for benchmark scripts: timing, one JSON line per figure, the paired
lowered-against-hand-written comparison of every *_throughput.py, a GEMM peak measured between its
pairs and the utilisation against it (never above 1: InterleavedPeak, report_fraction_of_peak), and
the folder a benchmark writes in."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def best_of(fn, repeat: int = 20) -> float:
    """Best wall time of `repeat` calls, in seconds (the least disturbed run)."""
    return min(timed(fn) for _ in range(repeat))


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call; `fn` must wait for its own result (asynchronous devices)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def report(name: str, value: float, unit: str, goal: float | None = None, lower_is_better: bool = True) -> dict:
    met = None if goal is None else (value <= goal if lower_is_better else value >= goal)
    row = {"name": name, "value": value, "unit": unit, "goal": goal, "met": met}
    status = "" if met is None else ("  goal met" if met else "  GOAL MISSED")
    goal_text = "" if goal is None else f" (goal {'<=' if lower_is_better else '>='} {goal:g} {unit})"
    print(f"{name:<48} {value:10.3f} {unit}{goal_text}{status}")
    print("BENCH " + json.dumps(row))
    return row


def training_ops_per_image(graph, convention: str = "paper") -> int:
    """Analytic FP+BP operations of one training image: the paper's convention (as scored), or
    `valid` (padded taps and causally masked attention pairs not counted; docs/counting.md)."""
    from aiperf_opcount import count
    totals = count(graph, convention)
    return totals.fp + totals.bp


# -- a fraction of the peak ------------------------------------------------------------------------
PEAK_UNDER_MEASURED = "peak under-measured"
SPREAD_WARNING = 0.10  # a peak's products further apart than this: the machine's load varied


class InterleavedPeak:
    """A dense-GEMM peak measured where it is used: each probe() times one product of every shape,
    and a paired comparison calls it between its timed pairs (compare_training_throughput's
    `between`), so the products run under the load the steps ran under, from the first pair to
    the last, not once at the end. The peak is the best rate of them all.

    `products`: name -> (operations of one product, a callable that runs one product and returns
    its seconds). A shape's spread is (slowest - fastest) / fastest of its products."""

    def __init__(self, products: dict[str, tuple[int, Callable[[], float]]]):
        if not products:
            raise ValueError("an interleaved peak needs at least one product")
        self.products = products
        self.seconds: dict[str, list[float]] = {name: [] for name in products}

    def probe(self) -> None:
        for name, (_, one_product) in self.products.items():
            self.seconds[name].append(float(one_product()))

    @property
    def probes(self) -> int:
        return min(len(times) for times in self.seconds.values())

    def rate(self, name: str) -> float:
        return self.products[name][0] / min(self.seconds[name])

    def spread(self, name: str) -> float:
        times = self.seconds[name]
        return (max(times) - min(times)) / min(times)

    def best(self) -> tuple[str, float]:
        """(the shape of the best rate, that rate in operations per second)."""
        if not self.probes:
            raise ValueError("the peak was never probed")
        name = max(self.products, key=self.rate)
        return name, self.rate(name)

    def report(self, label: str) -> float:
        """Print each shape's best rate (GOPS) and spread, then the peak; return the peak."""
        best, peak = self.best()
        for name in self.products:
            spread = self.spread(name)
            warning = (f"  warning: spread above {SPREAD_WARNING:.0%}, the load varied"
                       if spread > SPREAD_WARNING else "")
            print(f"  GEMM {name}: best {self.rate(name) / 1e9:.1f} GOPS of {len(self.seconds[name])} products "
                  f"interleaved with the steps, spread {spread:.0%}{warning}", flush=True)
        report(f"{label} ({best}, best of {self.probes} probes)", peak / 1e9, "GOPS", None, lower_is_better=False)
        return peak


def square_product_peak(matmul: Callable[[], Any], n: int = 2048, timer: Callable[[Callable[[], Any]], float] = timed,
                        ) -> InterleavedPeak:
    """An InterleavedPeak of one n x n product: `matmul` runs it to completion (synchronised). It
    runs once here, untimed (compilation, first-touch pages)."""
    matmul()
    return InterleavedPeak({f"{n}x{n}": (2 * n ** 3, lambda: timer(matmul))})


def report_fraction_of_peak(name: str, value: float, goal: float | None = None) -> dict:
    """A fraction of a measured peak: a model-FLOP utilisation, an efficiency. Above 1 it is no
    utilisation but a failed measurement (the peak was under-measured: its products ran slower
    than the work divided by it): printed as such, its row `met` False with `failed` saying why,
    never a met goal."""
    if not value > 1.0:
        return report(name, value, "fraction", goal, lower_is_better=False)
    row = {"name": name, "value": value, "unit": "fraction", "goal": goal, "met": False, "failed": PEAK_UNDER_MEASURED}
    print(f"{name:<48} {value:10.3f} fraction  FAILED MEASUREMENT: above 1, the {PEAK_UNDER_MEASURED}")
    print("BENCH " + json.dumps(row))
    return row


def report_utilisation(label: str, samples_per_s: float, ops: dict[str, int], peak: float,
                       goal: float | None = None, model: str = "resnet50") -> list[str]:
    """The achieved analytic OPS and the model-FLOP utilisation (achieved / peak) in each counting
    convention of `ops` (convention -> analytic operations of one training sample: `paper`, as
    scored, then `valid`); `goal` applies to the paper's. Returns a line per convention whose
    utilisation is above 1 (a failed measurement, the peak under-measured)."""
    failed = []
    for convention, per_sample in ops.items():
        achieved = samples_per_s * per_sample
        report(f"{label} {model} train, achieved analytic OPS ({convention})", achieved / 1e9, "GOPS", None,
               lower_is_better=False)
        row = report_fraction_of_peak(f"{label} {model} model-FLOP utilisation ({convention})", achieved / peak,
                                      goal if convention == "paper" else None)
        if row.get("failed"):
            failed.append(f"{label}: model-FLOP utilisation ({convention}) {achieved / peak:.3f} is above 1: "
                          f"the {PEAK_UNDER_MEASURED}")
    return failed


def report_peak_fraction(framework: str, images_per_s: float, ops_per_image: int, matmul, n: int = 2048,
                         valid_ops_per_image: int | None = None) -> list[str]:
    """Achieved analytic OPS of a training run as a fraction of the framework's own dense-GEMM peak.

    `matmul` is an InterleavedPeak already probed between the timed steps (square_product_peak,
    compare_training_throughput's `between`), or a callable that runs one n x n fp32 matrix product
    to completion (synchronised) in the framework, then timed here, ten times, after the steps.
    The peak is the best product, at 2 n^3 operations each, so the fraction says how much of what
    the framework's matrix product does on this machine the lowered network turns into counted
    work, in the paper's convention and, given `valid_ops_per_image`, the valid one. Above 1 it is a
    failed measurement (report_fraction_of_peak): a framework whose convolutions use a faster
    library than its matrix product (torch on AMD CPUs: oneDNN convolutions, MKL matmul;
    docs/performance.md) has no peak in its matrix product. Returns the failed lines."""
    if isinstance(matmul, InterleavedPeak):
        peak = matmul
    else:
        peak = square_product_peak(matmul, n)
        for _ in range(10):
            peak.probe()
    rate = peak.report(f"{framework} dense GEMM peak, fp32")
    ops = {"paper": ops_per_image} | ({} if valid_ops_per_image is None else {"valid": valid_ops_per_image})
    return report_utilisation(framework, images_per_s, ops, rate)


def compare_training_throughput(framework: str, batch: int, lowered_step: Callable[[], Any],
                                hand_steps: dict[str, Callable[[], Any]], pairs: int, probe_steps: int = 1,
                                timer: Callable[[Callable[[], Any]], float] = timed, model: str = "resnet50",
                                unit: str = "images/s", between: Callable[[], Any] | None = None) -> float:
    """Time one training step at a time of the IR-lowered model and of the hand-written one, report
    both rates and their ratio (goal >= 0.97), and return the lowered model's samples per second.

    With several hand-written variants (memory formats, execution modes) the fastest over
    `probe_steps` steps each is the reference, so a variant choice cannot flatter the ratio. The
    timed steps come in `pairs` (one step of each model, in alternating order) and the ratio is
    the median of the pairs' ratios: on a shared machine a step's time varies by 10-20%, and a
    pair's two steps see the same load. Warm-up and compilation are the caller's, before this.
    `between` runs after each pair, untimed: an InterleavedPeak's probe, so that a peak that a
    utilisation divides by is measured under the load the steps ran under."""
    probe = {}
    if len(hand_steps) > 1:
        probe = {name: statistics.median(timer(step) for _ in range(probe_steps)) for name, step in hand_steps.items()}
        for name, seconds in probe.items():
            print(f"hand-written ({name}) step {seconds:.3f} s", flush=True)
    best = min(probe, key=probe.get) if probe else next(iter(hand_steps))
    hand_step = hand_steps[best]
    low_times, hand_times, ratios = [], [], []
    for i in range(pairs):
        if i % 2:
            hand, low = timer(hand_step), timer(lowered_step)
        else:
            low, hand = timer(lowered_step), timer(hand_step)
        low_times.append(low)
        hand_times.append(hand)
        ratios.append(hand / low)
        print(f"pair {i + 1}: lowered {low:.3f} s, hand-written {hand:.3f} s", flush=True)
        if between is not None:
            between()
    lowered_rate = batch / statistics.median(low_times)
    report(f"{framework} {model} train, IR-lowered", lowered_rate, unit, None, lower_is_better=False)
    report(f"{framework} {model} train, hand-written ({best})", batch / statistics.median(hand_times), unit,
           None, lower_is_better=False)
    for name, seconds in probe.items():
        if name != best:
            report(f"{framework} {model} train, hand-written ({name})", batch / seconds, unit, None,
                   lower_is_better=False)
    report(f"{framework} lowered / hand-written ({best})", statistics.median(ratios), "ratio", 0.97,
           lower_is_better=False)
    return lowered_rate


@contextlib.contextmanager
def benchmark_folder(keep: Path | None, prefix: str, parent: Path | None = None):
    """The folder a benchmark writes its runs in: `keep` (left in place), else a new temporary one,
    removed at the end. The load average is printed at the start and at a normal end: the machine is
    shared, and a figure means little without it."""
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    work = keep or Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
