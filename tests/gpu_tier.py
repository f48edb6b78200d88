"""The GPU test tier (`make test-gpu`): on a CUDA machine, in the current Python environment.

It installs nothing and makes no .venv, because the CUDA machines we are lent cannot download.
Steps, each reported, all run even when one fails:

1. the tests marked `gpu` (pytest -m gpu);
2. the conformance kit at --level all for every available backend that sees an accelerator; the kit
   itself runs each level at every precision the backend declares on that device.

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


def step(name: str, argv: list[str]) -> int:
    print(f"== {name}: {' '.join(argv)}", flush=True)
    start = time.monotonic()
    rc = subprocess.run(argv, cwd=ROOT).returncode
    print(f"== {name}: exit {rc} after {time.monotonic() - start:.0f} s", flush=True)
    return rc


def main() -> int:
    seen = accelerators()
    if not seen:
        print("gpu tier: no accelerator is visible to torch or jax; nothing was checked", file=sys.stderr)
        return 1
    print("gpu tier: accelerators: " + "; ".join(seen), flush=True)
    out = Path(os.environ.get("AIPERF_GPU_TIER_OUT", ROOT / "gpu-tier"))
    out.mkdir(parents=True, exist_ok=True)
    results = {"pytest -m gpu": step("pytest -m gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q",
                                                        "-p", "no:cacheprovider", str(ROOT / "tests")])}
    from aiperf_core.registry import list_backends

    for info in list_backends():
        if not info.available:
            print(f"== conformance {info.name}: skipped, unavailable here ({info.reason})", flush=True)
            continue
        if all(d.split(":")[0].split(" ")[0].lower() == "cpu" for d in info.devices):
            print(f"== conformance {info.name}: skipped, it sees no accelerator ({', '.join(info.devices)})",
                  flush=True)
            continue
        results[f"conformance {info.name}"] = step(
            f"conformance {info.name}", [sys.executable, "-m", "aiperf_core", "conformance", "--backend", info.name,
                                         "--level", "all", "--report", str(out / f"conformance-{info.name}.json")])
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
