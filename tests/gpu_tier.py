"""The GPU test tier (`make test-gpu`): on a CUDA machine, in the current Python environment.

It installs nothing and makes no .venv, because the CUDA machines we are lent cannot download.
Steps, each reported, all run even when one fails:

1. the tests marked `gpu` (pytest -m gpu);
2. the conformance kit at --level all for every available backend that sees an accelerator; the kit
   itself runs each level at every precision the backend declares on that device.

The steps are independent, so they run at once (a lent GPU is paid by the minute); each step's
output goes to its own log in the report folder and is printed whole when the step ends. Their
processes share the GPU, so none of them may take all of its memory up front: jax's preallocation
is off unless the caller set it.

It exits 1 when no accelerator is visible (a GPU tier that checked nothing must not pass), and
non-zero when any step failed. Reports go to $AIPERF_GPU_TIER_OUT (default gpu-tier/).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def accelerators() -> list[str]:
    """What the frameworks here see, e.g. ['torch: NVIDIA H100 80GB HBM3 x1', 'jax: cuda x1']."""
    seen = []
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count():
            seen.append(f"torch: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    except Exception:  # a missing or broken framework just does not see a device
        pass
    try:
        import jax

        gpus = [d for d in jax.devices() if d.platform != "cpu"]
        if gpus:
            seen.append(f"jax: {gpus[0].platform} x{len(gpus)}")
    except Exception:
        pass
    return seen


def gpu_test_files() -> list[str]:
    """The test modules marked `gpu`. Only these are collected: the CPU suite's modules hold
    frameworks that `make test` installs and a CUDA image may lack (TensorFlow, MindSpore), and one
    failed collection would stop pytest before any GPU test ran."""
    return [str(path) for path in sorted((ROOT / "tests").glob("test_*.py"))
            if "pytestmark = pytest.mark.gpu" in path.read_text()]


def run_steps(steps: dict[str, list[str]], out: Path) -> dict[str, int]:
    """Start every step at once; print each one's log whole as it ends. {name: exit status}."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    running = {}
    for name, argv in steps.items():
        log = out / (name.replace(" ", "-") + ".log")
        print(f"== {name}: {' '.join(argv)} (log: {log})", flush=True)
        with log.open("wb") as sink:
            running[name] = (subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT),
                             log, time.monotonic())
    results = {}
    while running:
        for name, (process, log, start) in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            results[name] = process.returncode
            print(f"== {name}: exit {process.returncode} after {time.monotonic() - start:.0f} s", flush=True)
            print(log.read_text(errors="replace"), flush=True)
        time.sleep(0.5)
    return results


def main() -> int:
    seen = accelerators()
    if not seen:
        print("gpu tier: no accelerator is visible to torch or jax; nothing was checked", file=sys.stderr)
        return 1
    print("gpu tier: accelerators: " + "; ".join(seen), flush=True)
    out = Path(os.environ.get("AIPERF_GPU_TIER_OUT", ROOT / "gpu-tier"))
    out.mkdir(parents=True, exist_ok=True)
    steps = {"pytest -m gpu": [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               *gpu_test_files()]}
    from aiperf_core.registry import list_backends

    for info in list_backends():
        if not info.available:
            print(f"== conformance {info.name}: skipped, unavailable here ({info.reason})", flush=True)
            continue
        if all(d.split(":")[0].split(" ")[0].lower() == "cpu" for d in info.devices):
            print(f"== conformance {info.name}: skipped, it sees no accelerator ({', '.join(info.devices)})",
                  flush=True)
            continue
        steps[f"conformance {info.name}"] = [sys.executable, "-m", "aiperf_core", "conformance", "--backend",
                                             info.name, "--level", "all", "--report",
                                             str(out / f"conformance-{info.name}.json")]
    results = run_steps(steps, out)
    failed = [name for name, rc in results.items() if rc != 0]
    ran = [name for name in results if name.startswith("conformance")]
    if not ran:
        print("gpu tier: no backend sees the accelerator; the kit certified nothing", file=sys.stderr)
        return 1
    print(f"gpu tier: {len(results) - len(failed)} of {len(results)} steps passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
