"""`aiperf data stage` throughput against a plain `cp -r` of the same tree.

The tree is generated: random bytes (staging never decodes) in ImageNet's folder layout, file sizes
drawn around ImageNet's mean JPEG of about 110 kB (uniform 55-165 kB), a few hundred MB in all,
with its manifest. Two cases:
- warm source: the tree is in the page cache (it was just written), so what is compared is the
  copying itself, CPU-bound (stage: read, SHA-256, write to a partial name, rename; cp:
  copy_file_range): the worst case for the stage, which does the SHA-256 on top;
- cold source: the tree's pages are dropped from the cache before each run (posix_fadvise
  DONTNEED on its files only), so both read it from the disk, as a stage reads a shared filesystem.

The two alternate, best of `--repeat` each, because the load of a shared machine drifts; each run
starts after a sync, into an empty folder. The stage ends with a sync of its own (its manifest
says the files are on disk), which `cp -r` does not: "cp -r + sync" is printed beside it for that
reason. Goal: stage >= 0.8x `cp -r`. Also timed: a rerun on the verified copy (sizes and the
manifest's digest: what a node does when the copy is already there).

    .venv/bin/python benchmarks/data_stage.py [--mb 330] [--workers 8] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import numpy as np  # noqa: E402

from _common import report  # noqa: E402
from aiperf_core.data.manifest import Manifest, file_entry, write_manifest  # noqa: E402
from aiperf_core.data.stage import DEFAULT_WORKERS, stage  # noqa: E402

MEAN_FILE = 110_000
CLASSES = 50


def generate(root: Path, total_bytes: int, seed: int = 0) -> Manifest:
    rng = np.random.default_rng(seed)
    files, per_class, written, i = {}, {"train": {}, "val": {}}, 0, 0
    while written < total_bytes:
        split = "val" if i % 25 == 0 else "train"
        wnid = f"n{i % CLASSES:08d}"
        name = f"{split}/{wnid}/{wnid}_{i:06d}.JPEG"
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(int(rng.integers(MEAN_FILE // 2, MEAN_FILE * 3 // 2))))
        files[name] = file_entry(path)
        per_class[split][wnid] = per_class[split].get(wnid, 0) + 1
        written += files[name].size
        i += 1
    manifest = Manifest("folder", sorted(per_class["train"]), per_class, files)
    write_manifest(root, manifest)
    return manifest


def evict(root: Path) -> None:
    """Drop these files (clean after the generation's sync) from the page cache, and no others."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_run(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=330, help="size of the generated tree in MB (default 330)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=f"stage workers (default {DEFAULT_WORKERS})")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to generate and copy (default: the system's temp folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="aiperf-stage-bench-") as scratch:
        root = Path(scratch)
        src = root / "src"
        manifest = generate(src, args.mb * 1_000_000)
        total = sum(e.size for e in manifest.files.values())
        print(f"tree: {len(manifest.files):,} files, {total / 1e6:,.0f} MB (mean {total / len(manifest.files) / 1e3:.0f} kB)"
              f", in {root}; {os.cpu_count()} CPUs")
        print(f"load before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")

        def cp():
            subprocess.run(["cp", "-r", str(src), str(root / "cp")], check=True)

        def cp_sync():
            cp()
            os.sync()

        copies = (("cp -r", cp), ("cp -r + sync", cp_sync),
                  ("stage", lambda: stage(src, root / "st", workers=args.workers)))
        for source in ("warm", "cold"):
            times: dict[str, list[float]] = {name: [] for name, _ in copies}
            for _ in range(args.repeat):
                for name, fn in copies:
                    if source == "cold":
                        evict(src)
                    times[name].append(timed_run(fn))
                    shutil.rmtree(root / "cp", ignore_errors=True)
                    if name == "stage":
                        rerun = timed_run(lambda: stage(src, root / "st", workers=args.workers))
                        shutil.rmtree(root / "st")
            best = {name: min(values) for name, values in times.items()}
            for name, seconds in best.items():
                report(f"{source} source: {name} (best of {args.repeat})", total / seconds / 1e6, "MB/s", None,
                       lower_is_better=False)
            report(f"{source} source: stage ({args.workers} workers) / cp -r", best["cp -r"] / best["stage"], "x",
                   0.8, lower_is_better=False)
            report(f"{source} source: stage / (cp -r + sync)", best["cp -r + sync"] / best["stage"], "x", None,
                   lower_is_better=False)
        report("rerun on a verified copy (sizes + digest)", len(manifest.files) / rerun, "files/s", None,
               lower_is_better=False)
        print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
