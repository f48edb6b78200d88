"""`aiperf data stage SRC DST`: copy a prepared dataset (SRC/manifest.json) to node-local storage
and verify it against SRC's manifest; `verify_folder`, the check `aiperf data check` runs on a
folder with a manifest.

Why it is safe to start anywhere, any number of times:
- Each file is copied to a hidden partial name beside its final one (`.NAME.aiperf-partial`),
  its SHA-256 computed on the bytes as they are copied, and renamed to its final name only when
  size and checksum match the manifest: a final name never holds a partial or unverified file.
- DST/manifest.json is written last, after every file is in place (and a sync), so its presence
  with SRC's digest means a verified complete copy. A rerun on such a copy checks quickly (every
  file's size, no file beyond the manifest's, the manifest's digest equal to SRC's) and copies
  nothing; `deep` checksums every file too and replaces any that differ.
- An interrupted stage resumes: files already present are checksummed and kept when they match,
  partial files are removed, the rest is copied.
- One stage per DST at a time: the stager holds DST/.aiperf-stage.lease (a rundir.Lease), renewed
  by a thread every RENEW_S while it works. Others started meanwhile wait while the lease is
  renewed, then find the verified copy and copy nothing.
- A waiter never waits forever. A holder on this node whose process is gone is taken over at once.
  One whose process is alive but has not renewed its lease for `wait_s` (stopped by SIGSTOP, hung
  in the interpreter) is left alone: the waiter gives up with one line naming it (its host, pid,
  since when, its last renewal), since taking a live process's lease would put two copiers in
  DST. One on another host, whose process cannot be seen, is taken over once unrenewed for
  `wait_s`. Takeovers go through Lease's rename aside, so of several waiters exactly one wins.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from aiperf_core.data.manifest import (MANIFEST, Manifest, ManifestError, file_sha256, read_manifest,
                                       verify_files, write_manifest)
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import LEASE_RENEW_S, Lease, LeaseHeld
from aiperf_core.workflow.duration import format_duration

LEASE = ".aiperf-stage.lease"
PARTIAL = ".aiperf-partial"  # suffix of a file being copied: `.NAME.aiperf-partial` beside NAME
# Copy threads: two per core, at most 8. Two per core keep a cold source's reads in flight (hashlib
# and file I/O release the GIL); more only contend for the interpreter. On 2 cores, paired rounds
# from a warm source: 4 threads 0.63-0.75 s for 330 MB where 8 took 0.76-0.79 s, the same from a
# cold one (benchmarks/data_stage.py, docs/performance.md).
DEFAULT_WORKERS = min(8, 2 * (os.cpu_count() or 1))
WAIT_POLL_S = 0.5
RENEW_S = LEASE_RENEW_S  # the holder rewrites its lease this often
# A waiter gives up on a live holder (or takes over one of another host) whose lease has gone this
# long unrenewed. Minutes, not seconds: a renewal is an fsync'd write to DST, which a node flushing
# gigabytes of copied files can hold up for tens of seconds.
DEFAULT_WAIT_S = 300.0
MIN_WAIT_RENEWALS = 2  # a wait shorter than two renewals would take a working holder for a hung one
BUFFER = 1 << 20  # per thread; 4 MiB buffers (8 threads: 32 MiB touched afresh) were 7% of a stage's samples
BATCH_BYTES = 8 << 20  # a unit of parallel work: files up to this many bytes...
BATCH_FILES = 64       # ... or this many files

# (phase, files done, files in the phase, bytes done, bytes in the phase); phase: "verify" or "copy"
Progress = Callable[[str, int, int, int, int], None]


class StageError(AiperfError):
    pass


@dataclass
class StageResult:
    src: str
    dst: str
    digest: str
    files: int                  # in the manifest
    bytes: int
    copied: int = 0             # files this invocation copied
    copied_bytes: int = 0
    kept: int = 0               # files already in DST and kept
    kept_by: str = "checksum"   # how they were checked: "checksum" (a resume, or deep), "size" (a copy verified before)
    replaced: list[str] = field(default_factory=list)   # files in DST that were wrong and were copied again
    complete_before: bool = False  # DST already held a verified copy (its manifest, SRC's digest)
    deep: bool = False
    waited_s: float = 0.0       # waiting for another stage of the same DST
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FolderCheck:
    """`verify_folder`'s answer: the problems of a folder against its own manifest."""
    path: str
    manifest: Manifest
    deep: bool
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        m = self.manifest
        return {"path": self.path, "manifest": True, "layout": m.layout, "digest": m.digest, "official": m.official,
                "classes": len(m.classes), "images": m.images, "files": len(m.files),
                "bytes": sum(e.size for e in m.files.values()),
                "checked": "sizes and checksums" if self.deep else "sizes", "problems": list(self.problems),
                "ok": self.ok}


def _own(name: str) -> bool:
    """Top-level files of the stage itself, not of the dataset: the manifest and the lease, with
    the temporary names under which each is written."""
    return name == MANIFEST or name.startswith(f".{MANIFEST}.") or LEASE in name


def scan(root: Path) -> tuple[dict[str, int], list[str], list[str]]:
    """(relative POSIX path -> size of every regular file of the dataset, partial copies, other
    entries that are neither: links, devices). The stage's own files are left out."""
    files: dict[str, int] = {}
    partial: list[str] = []
    odd: list[str] = []
    pending = [("", root)]
    while pending:
        prefix, folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                name = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append((name + "/", Path(entry.path)))
                elif entry.name.endswith(PARTIAL):
                    partial.append(name)
                elif not prefix and _own(entry.name):
                    continue
                elif entry.is_file(follow_symlinks=False):
                    files[name] = entry.stat(follow_symlinks=False).st_size
                else:
                    odd.append(name)
    return files, partial, odd


def _size_problems(manifest: Manifest, present: dict[str, int], odd: list[str]) -> list[str]:
    problems = []
    for name, entry in sorted(manifest.files.items()):
        size = present.get(name)
        if size is None:
            problems.append(f"{name}: missing")
        elif size != entry.size:
            problems.append(f"{name}: {size:,} bytes, manifest says {entry.size:,}")
    problems += [f"{name}: not in the manifest" for name in sorted(set(present) - set(manifest.files))]
    problems += [f"{name}: not a regular file" for name in sorted(odd)]
    return problems


def verify_folder(path, deep: bool = False, workers: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> FolderCheck | None:
    """Check a prepared or staged folder against its own manifest: every file present at its size,
    no file beyond the manifest's (a stray image would be trained on) and, with `deep`, every
    checksum. None when the folder has no manifest.json."""
    root = Path(path)
    if not root.is_dir():
        raise AiperfError(f"{root}: no such folder")
    manifest = read_manifest(root)
    if manifest is None:
        return None
    present, partial, odd = scan(root)
    problems = _size_problems(manifest, present, odd)
    problems += [f"{name}: a partial copy left by an interrupted stage" for name in sorted(partial)]
    if deep:
        right_size = [n for n, e in manifest.files.items() if present.get(n) == e.size]
        problems += verify_files(root, manifest, deep=True, names=right_size, workers=workers, progress=progress)
    return FolderCheck(str(root), manifest, deep, problems)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_arguments(src: Path, dst: Path) -> Manifest:
    if not src.is_dir():
        raise StageError(f"{src}: no such folder")
    manifest = read_manifest(src)
    if manifest is None:
        raise StageError(f"{src}: no {MANIFEST}: not a prepared dataset (run `aiperf data prepare` to make one)")
    real_src, real_dst = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
    if real_dst == real_src or real_src in real_dst.parents:
        raise StageError(f"{dst}: is inside SRC {src}: stage to another folder")
    if dst.exists() and not dst.is_dir():
        raise StageError(f"{dst}: exists and is not a folder")
    return manifest


def _check_space(dst: Path, needed: int, files: int) -> None:
    free = shutil.disk_usage(_nearest_existing(dst)).free
    if needed > free:
        raise StageError(f"{dst}: not enough free space: {files:,} file(s) to copy need {needed / 1e9:,.2f} GB, "
                         f"{free / 1e9:,.2f} GB free")


class _Held:
    """The stage lease: waited for while its holder renews it, then held and renewed in a thread
    every `renew_s` while the copy runs (see the module's docstring for what a waiter does with a
    lease unrenewed for `wait_s`)."""

    def __init__(self, dst: Path, on_wait: Callable[[str], None] | None, wait_s: float, renew_s: float):
        self.lease = Lease(dst / LEASE, "aiperf data stage", stale_s=wait_s)  # another host's: taken over then
        self.on_wait = on_wait
        self.wait_s = wait_s
        self.renew_s = renew_s
        self.waited_s = 0.0
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def __enter__(self) -> "_Held":
        started = time.monotonic()
        told = False
        while True:
            judged = time.time()  # no later than the Lease's own judgement of the holder's age
            try:
                self.lease.acquire()
                break
            except LeaseHeld as exc:
                renewed = exc.holder.get("renewed")
                unrenewed_s = judged - renewed if type(renewed) in (int, float) else 0.0
                # A lease of another host this old would have been taken over: its process runs here.
                if unrenewed_s > self.wait_s:
                    raise StageError(self._hung(exc.holder, judged)) from None
                if not told and self.on_wait is not None:
                    self.on_wait(f"{exc}; waiting while it renews its lease (unrenewed for "
                                 f"{format_duration(self.wait_s)}, it is taken over if its process is gone, "
                                 f"or this stage gives up)")
                    told = True
                time.sleep(WAIT_POLL_S)
        self.waited_s = time.monotonic() - started
        self._keeper = threading.Thread(target=self._keep, name="stage-lease", daemon=True)
        self._keeper.start()
        return self

    def _hung(self, holder: dict, now: float) -> str:
        def moment(t) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"

        pid = holder.get("pid", "?")
        return (f"{self.lease.path}: held by {holder.get('owner', '?')} pid {pid} on host {holder.get('host', '?')} "
                f"since {moment(holder.get('acquired'))}, last renewed {moment(holder.get('renewed'))} "
                f"({now - holder['renewed']:.0f} s ago, past --wait {format_duration(self.wait_s)}): its process "
                f"is alive but not renewing its lease (stopped or hung), so it is not taken over; end it "
                f"(kill {pid}) and stage again")

    def _keep(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                if not self.lease.renew():
                    self.lost.set()
                    return
            except OSError as exc:
                print(f"aiperf: the stage lease was not renewed: {exc}", file=sys.stderr, flush=True)

    def check(self) -> None:
        if self.lost.is_set():
            raise StageError(f"{self.lease.path}: another stage took this DST over (this one's lease went stale)")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()
        self.lease.release()


def _copy_one(src: str, dst: str, name: str, expected, buffer: bytearray) -> str | None:
    """Copy one file through its partial name, checksumming the bytes copied; rename it into place
    only when it matches the manifest's entry. The problem (SRC differs from its manifest), or None.
    Its folder exists. Plain strings and os calls: this runs once per image."""
    target = os.path.join(dst, name)
    folder, base = os.path.split(target)
    partial = os.path.join(folder, f".{base}{PARTIAL}")
    digest = hashlib.sha256()
    size = 0
    view = memoryview(buffer)
    with open(os.path.join(src, name), "rb", buffering=0) as fin, open(partial, "wb", buffering=0) as fout:
        while n := fin.readinto(buffer):
            chunk = view[:n]
            digest.update(chunk)
            fout.write(chunk)
            size += n
    if size != expected.size or digest.hexdigest() != expected.sha256:
        os.unlink(partial)
        what = f"{size:,} bytes" if size != expected.size else f"checksum {digest.hexdigest()[:12]}..."
        return f"{os.path.join(src, name)}: {what} differs from SRC's manifest"
    os.replace(partial, target)
    return None


def _sync_filesystem(folder: Path) -> None:
    """syncfs(2) of the filesystem holding `folder` (only DST's, not every mounted one: a node's
    shared filesystem may hold other jobs' writes); sync(2) where there is no syncfs."""
    import ctypes

    fd = os.open(folder, os.O_RDONLY)
    try:
        syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
        if syncfs is not None and syncfs(fd) == 0:
            return
    finally:
        os.close(fd)
    os.sync()


def _batches(items: list[str], sizes: dict[str, int]) -> list[list[str]]:
    """Units of parallel work of about BATCH_BYTES (at least one file): few enough tasks for 1.3 M
    files, small enough for an even spread over the workers and a smooth progress line."""
    batches, batch, size = [], [], 0
    for name in items:
        batch.append(name)
        size += sizes[name]
        if size >= BATCH_BYTES or len(batch) >= BATCH_FILES:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    return batches


def _run_parallel(work, items: list[str], sizes: dict[str, int], workers: int, phase: str,
                  progress: Progress | None, held: _Held) -> list:
    """[(name, work(name, buffer))] for every item, over `workers` threads (each with its own
    buffer), a bounded number of batches in flight; progress by files and bytes."""
    if not items:
        return []
    total_bytes = sum(sizes[n] for n in items)
    results: list = []
    done_files = done_bytes = 0
    if progress is not None:
        progress(phase, 0, len(items), 0, total_bytes)
    local = threading.local()

    def job(batch: list[str]) -> list:
        held.check()
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(BUFFER)
        return [(name, work(name, local.buffer)) for name in batch]

    pending = iter(_batches(items, sizes))
    with ThreadPoolExecutor(max(1, workers)) as pool:
        running = {pool.submit(job, b) for b in itertools.islice(pending, 4 * max(1, workers))}
        while running:
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                batch = future.result()
                results.extend(batch)
                done_files += len(batch)
                done_bytes += sum(sizes[name] for name, _ in batch)
                following = next(pending, None)
                if following is not None:
                    running.add(pool.submit(job, following))
            if progress is not None:
                progress(phase, done_files, len(items), done_bytes, total_bytes)
    return results


def stage(src, dst, workers: int = DEFAULT_WORKERS, deep: bool = False, progress: Progress | None = None,
          on_wait: Callable[[str], None] | None = None, wait_s: float = DEFAULT_WAIT_S,
          renew_s: float | None = None) -> StageResult:
    """Copy the prepared dataset at `src` to `dst` and verify it (see the module's docstring).
    `renew_s`: how often this stage renews its lease while it holds it (default RENEW_S)."""
    started = time.monotonic()
    renew_s = RENEW_S if renew_s is None else renew_s
    if not wait_s >= MIN_WAIT_RENEWALS * renew_s:
        raise StageError(f"--wait {wait_s:g} s: must be at least {MIN_WAIT_RENEWALS * renew_s:g} s: a stage renews "
                         f"its lease every {renew_s:g} s, and a shorter wait would take a working one for a hung one")
    src, dst = Path(os.path.abspath(src)), Path(os.path.abspath(dst))
    manifest = _check_arguments(src, dst)
    sizes = {name: e.size for name, e in manifest.files.items()}
    result = StageResult(str(src), str(dst), manifest.digest, len(sizes), sum(sizes.values()), deep=deep)
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StageError(f"{dst}: cannot make the folder: {exc.strerror or exc}") from None
    with _Held(dst, on_wait, wait_s, renew_s) as held:
        result.waited_s = held.waited_s
        try:
            staged = read_manifest(dst)
        except ManifestError:
            staged = None  # damaged: the copy is verified again as on a resume, and the manifest rewritten
        complete = staged is not None and staged.digest == manifest.digest
        present, partial, odd = scan(dst)
        strays = sorted(set(present) - set(sizes)) + sorted(odd)
        if strays:
            raise StageError(f"{dst}: holds {len(strays):,} file(s) that are not part of SRC's dataset (e.g. "
                             f"{strays[0]}): give a new or empty folder, or one staged from this dataset")
        wrong = [n for n in sizes if present.get(n) != sizes[n]]
        _check_space(dst, sum(sizes[n] for n in wrong), len(wrong))
        if complete and not wrong and not partial and not deep:
            result.complete_before = True
            result.kept, result.kept_by = result.files, "size"
            result.seconds = time.monotonic() - started
            return result
        # A copy verified before is trusted where its sizes hold, unless `deep`; a resumed one is not.
        to_check = [] if complete and not deep else sorted(n for n in sizes if present.get(n) == sizes[n])
        result.kept_by = "size" if complete and not deep else "checksum"
        checked = _run_parallel(lambda name, _: file_sha256(dst / name), to_check, sizes, workers, "verify",
                                progress, held)
        bad = sorted(name for name, digest in checked if digest != manifest.files[name].sha256)
        result.kept = len(sizes) - len(wrong) - len(bad)
        result.replaced = sorted(bad + [n for n in wrong if n in present])
        to_copy = sorted(set(wrong) | set(bad))
        if complete and not to_copy and not partial:  # `deep` found nothing wrong
            result.complete_before = True
            result.seconds = time.monotonic() - started
            return result
        # From here on DST is not a verified copy until its manifest is written again.
        (dst / MANIFEST).unlink(missing_ok=True)
        for name in partial:
            (dst / name).unlink(missing_ok=True)
        for folder in sorted({os.path.dirname(name) for name in to_copy}):
            (dst / folder).mkdir(parents=True, exist_ok=True)
        source, target = str(src), str(dst)
        copied = _run_parallel(lambda name, buffer: _copy_one(source, target, name, manifest.files[name], buffer),
                               to_copy, sizes, workers, "copy", progress, held)
        problems = sorted(problem for _, problem in copied if problem)
        if problems:
            raise StageError(f"{problems[0]}" + (f" (and {len(problems) - 1} more file(s))" if len(problems) > 1
                                                 else "") + f": SRC is damaged; {dst} is left incomplete")
        result.copied = len(to_copy)
        result.copied_bytes = sum(sizes[n] for n in to_copy)
        present, partial, odd = scan(dst)
        problems = _size_problems(manifest, present, odd) + partial
        if problems:  # something else wrote into DST meanwhile
            raise StageError(f"{dst}: {problems[0]} after the copy ({len(problems)} problem(s)); run the stage again")
        held.check()
        _sync_filesystem(dst)  # the files are on disk before the manifest says they are complete
        write_manifest(dst, manifest)
    result.seconds = time.monotonic() - started
    return result
