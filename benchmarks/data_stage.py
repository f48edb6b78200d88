"""`aiperf data stage` throughput against a plain `cp -r` of the same tree.

The tree is generated: random bytes (staging never decodes) in ImageNet's folder layout, file sizes
drawn around ImageNet's mean JPEG of about 110 kB (uniform 55-165 kB), a few hundred MB in all,
with its manifest. Two cases:
- warm source: the tree is in the page cache (read whole before each run), so what is compared is the
  copying itself, CPU-bound (stage: read, SHA-256, write to a partial name, rename; cp:
  copy_file_range): the worst case for the stage, which does the SHA-256 on top;
- cold source: the tree's pages are dropped from the cache before each run (posix_fadvise
  DONTNEED on its files only), so both read it from the disk, as a stage reads a shared filesystem.

Each source runs `--repeat` rounds; a round times every copy once, each in turn first, after a
sync, into a new folder. No copy is deleted before the end: on ext4, creating a file scans past
every inode freed in the last 30 seconds (`recently_deleted` in its inode allocator: 38% of a
stage's samples under `perf` right after a 3,000-file tree was removed), which made each copy
that followed a deletion up to 6x slower than one that did not. For the same reason, leave 30 s
after deleting a large tree on the same filesystem before running this. The goal figure is the
median over the rounds of `cp -r` / stage in the same round, so that both meet the same state of
a shared machine; the best of each is printed too. The stage ends with a sync of its own (its
manifest says the files are on disk), which `cp -r` does not: "cp -r + sync" is printed beside it
for that reason. Goal: stage >= 0.8x `cp -r`. Also timed: a rerun on the verified copy (sizes and
the manifest's digest: what a node does when the copy is already there).

The ceiling: any copy that verifies checksums and is on disk when it ends must at least hash every
byte (timed alone: SHA-256 of SRC over the stage's threads, nothing written) and wait for the disk
to take every byte (the sync after `cp -r`: "cp -r + sync" less "cp -r"). With the two perfectly
overlapped, such a copy takes at least the longer of them, so `cp -r` / that is the most any
verifying, durable copy could reach against `cp -r` in that round's machine state. When the
ceiling is under 0.8 the goal cannot be met then by any stage, whatever its code.

    .venv/bin/python benchmarks/data_stage.py [--mb 330] [--workers 8] [--repeat 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import numpy as np  # noqa: E402

from _common import report  # noqa: E402
from aiperf_core.data.manifest import Manifest, file_entry, file_sha256, write_manifest  # noqa: E402
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


def read_all(paths: list[Path]) -> None:
    """Every file into the page cache (a page of a tree written minutes ago may have been reclaimed)."""
    for path in paths:
        path.read_bytes()


def _listed(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def timed_run(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=330, help="size of the generated tree in MB (default 330)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=f"stage workers (default {DEFAULT_WORKERS})")
    p.add_argument("--repeat", type=int, default=5, help="rounds per source (default 5)")
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

        copies_kept = 3 * 2 * args.repeat  # cp -r, cp -r + sync and stage, per round and source
        free = shutil.disk_usage(root).free
        if free < copies_kept * total * 1.1:
            sys.exit(f"data_stage.py: {root}: {free / 1e9:.1f} GB free, the {copies_kept} copies this run keeps need "
                     f"{copies_kept * total * 1.1 / 1e9:.1f} GB: lower --mb or --repeat, or give --dir")
        runs = itertools.count()

        def fresh() -> Path:
            return root / f"copy-{next(runs)}"

        def cp():
            subprocess.run(["cp", "-r", str(src), str(fresh())], check=True)

        def cp_sync():
            cp()
            os.sync()

        paths = [src / name for name in manifest.files]

        def hash_alone():
            with ThreadPoolExecutor(args.workers) as pool:
                list(pool.map(file_sha256, paths))

        staged: list[Path] = []

        def stage_fresh():
            staged.append(fresh())
            stage(src, staged[-1], workers=args.workers)

        copies = [("cp -r", cp), ("cp -r + sync", cp_sync), ("SHA-256 of SRC alone", hash_alone),
                  ("stage", stage_fresh)]
        for source in ("warm", "cold"):
            times: dict[str, list[float]] = {name: [] for name, _ in copies}
            for round_ in range(args.repeat):
                turn = round_ % len(copies)  # each takes each place in a round in turn
                for name, fn in copies[turn:] + copies[:turn]:
                    if source == "cold":
                        evict(src)
                    else:
                        read_all(paths)
                    times[name].append(timed_run(fn))
            for name, values in times.items():
                report(f"{source} source: {name} (best of {args.repeat})", total / min(values) / 1e6, "MB/s", None,
                       lower_is_better=False)
            rounds = [dict(zip(times, values)) for values in zip(*times.values())]
            ratio = [r["cp -r"] / r["stage"] for r in rounds]
            synced = [r["cp -r + sync"] / r["stage"] for r in rounds]
            ceiling = [r["cp -r"] / max(r["SHA-256 of SRC alone"], r["cp -r + sync"] - r["cp -r"]) for r in rounds]
            print(f"{source} source, round by round: stage / cp -r {_listed(ratio)}; ceiling {_listed(ceiling)}")
            report(f"{source} source: stage ({args.workers} workers) / cp -r, median of rounds",
                   statistics.median(ratio), "x", 0.8, lower_is_better=False)
            report(f"{source} source: stage / (cp -r + sync), median of rounds", statistics.median(synced), "x",
                   None, lower_is_better=False)
            report(f"{source} source: ceiling of a verified durable copy / cp -r, median",
                   statistics.median(ceiling), "x", None, lower_is_better=False)
        rerun = timed_run(lambda: stage(src, staged[-1], workers=args.workers))
        report("rerun on a verified copy (sizes + digest)", len(manifest.files) / rerun, "files/s", None,
               lower_is_better=False)
        print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
