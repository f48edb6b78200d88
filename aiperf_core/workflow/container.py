"""Replicas inside an aiperf image: the wrapping of a command for a container runtime, the checks
made before any replica starts, and the image's identity that run.json and every replica_start
record (docs/deploy.md).

An aiperf image (the repository's Containerfile, built by `make image`) holds aiperf in a venv at
/opt/aiperf and a stamp, /etc/aiperf/image.json, that the build's last step writes: the image's
name, the extras it installed, and its digest, the SHA-256 of the image's /usr and /opt trees
(tree_digest). Every form a runtime keeps the image in (Charliecloud's directory, a SquashFS file,
Apptainer's SIF, podman's layers) holds the same files, so the digest is the same in all of them,
and a replica reads it from inside its container, cheaply, at every start: a node that ran another
copy of the image says so in its replica_start, and `aiperf check` flags the run (image_reasons).

The wrapping (wrap_argv) is one function from a command's argv to the argv that runs it in the
image, so that it composes with whatever launches a replica: the local, SLURM and hosts executors
(each node of a replica across nodes), the backend probe. A command that starts with this Python (sys.executable) runs
with the image's Python instead, isolated (-I: no PYTHONPATH, no user site, nothing from the
working directory), so the image's aiperf runs, never the host's.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from aiperf_core.errors import AiperfError

RUNTIMES = ("charliecloud", "apptainer", "podman", "pyxis")
RUNTIME_TOOLS = {"charliecloud": "ch-run", "apptainer": "apptainer", "podman": "podman", "pyxis": "srun"}
DEFAULT_ORDER = ("charliecloud", "apptainer", "podman")  # pyxis only when asked: it needs a SLURM allocation
IMAGE_PYTHON = "/opt/aiperf/bin/python"  # the Containerfile's venv
STAMP = Path("/etc/aiperf/image.json")
DIGEST_TREES = ("usr", "opt")  # what the digest covers: the OS's programs and libraries, and aiperf's venv
IMAGE_ENV, RUNTIME_ENV = "AIPERF_CONTAINER_IMAGE", "AIPERF_CONTAINER_RUNTIME"
REGISTRY_SCHEMES = ("docker://", "oras://", "library://", "shub://", "docker-daemon:")
# Folders of the image a Charliecloud bind must never cover: mounting a host folder there would hide
# the image's own programs.
SYSTEM_FOLDERS = frozenset({"/", "/usr", "/opt", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/var", "/boot", "/proc",
                            "/sys", "/dev", "/run"})
# Accelerators found by their device nodes (no framework is imported here), and which runtimes pass
# them into a container: NVIDIA GPUs with each runtime's own mechanism (Apptainer --nv, podman's
# CDI device, enroot's hook under pyxis, Charliecloud's ch-fromhost --nvidia into the image); Ascend
# NPUs with none, since none binds the CANN driver (unverified here: this machine has neither).
HOST_DEVICES = {"NVIDIA GPU": "nvidia[0-9]*", "Ascend NPU": "davinci[0-9]*"}
PASSES_THROUGH = {runtime: frozenset({"NVIDIA GPU"}) for runtime in RUNTIMES}
DEV = Path("/dev")
# The variables podman is told to pass in, by prefix: aiperf's, and the thread and device settings of
# the numerical libraries and frameworks (the other runtimes pass the whole environment).
FORWARDED_PREFIXES = ("AIPERF_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "NVIDIA_", "ASCEND_", "TF_", "XLA_", "JAX_",
                      "GLOG_")
PROBE_TIMEOUT_S = 300  # a runtime's first start of an image (podman unpacking it, pyxis importing it) is slow


@dataclass(frozen=True)
class Bind:
    path: str  # the same path on the host and in the image
    read_only: bool = False


@dataclass(frozen=True)
class ContainerSpec:
    """How replicas run in an image: the runtime, the image as the runtime names it, the digest its
    stamp records, the host folders bound into it, and whether NVIDIA GPUs are passed through."""

    runtime: str
    image: str
    digest: str | None = None
    binds: tuple[Bind, ...] = ()
    gpus: bool = False

    def record(self) -> dict[str, Any]:
        """run.json's `container` (and a replica_start's): {image, digest, runtime}."""
        return {"image": self.image, "digest": self.digest, "runtime": self.runtime}

    def environment(self) -> dict[str, str]:
        """What a replica needs to say which image it runs in (running_image)."""
        return {IMAGE_ENV: self.image, RUNTIME_ENV: self.runtime}


def wrap_argv(argv: Sequence[str], spec: ContainerSpec) -> list[str]:
    """The argv that runs `argv` inside the image, with the environment of whatever starts it."""
    inner = list(argv)
    if inner and inner[0] == sys.executable:
        inner = [IMAGE_PYTHON, "-I", *inner[1:]]
    binds = spec.binds
    if spec.runtime == "charliecloud":
        # ch-run 0.31 binds read-write only; the image itself is mounted read-only. It passes the
        # environment through: host library paths would reach the image's programs, so they go.
        launcher = ["ch-run", "--unset-env=LD_LIBRARY_PATH", "--unset-env=LD_PRELOAD",
                    *[f"--bind={b.path}" for b in binds], spec.image, "--", *inner]
        if not os.environ.get("USER"):  # ch-run refuses to start without $USER (a cron job, a bare container)
            launcher = ["env", f"USER={getpass.getuser()}", *launcher]
        return launcher
    if spec.runtime == "apptainer":
        return ["apptainer", "exec", *(["--nv"] if spec.gpus else []),
                *[a for b in binds for a in ("--bind", f"{b.path}:{b.path}{':ro' if b.read_only else ''}")],
                spec.image, *inner]
    if spec.runtime == "podman":
        # The node's own pid, network, IPC and host name: leases and heartbeats name the host and
        # the process, and the primary signals the process it launched. `--env PREFIX*` passes
        # the variables with that prefix that the launching process has, whenever they were set.
        return ["podman", "run", "--rm", "-i", "--network=host", "--pid=host", "--ipc=host", "--uts=host",
                "--security-opt=label=disable", *(["--device=nvidia.com/gpu=all"] if spec.gpus else []),
                *[a for prefix in FORWARDED_PREFIXES for a in ("--env", f"{prefix}*")],
                *[a for b in binds for a in ("--volume", f"{b.path}:{b.path}{':ro' if b.read_only else ''}")],
                spec.image, *inner]
    if spec.runtime == "pyxis":
        # A job step of the replica's own allocation, in the image (pyxis imports it through enroot);
        # --overlap: the step that runs the replica's launcher already holds the allocation's CPUs.
        mounts = ",".join(f"{b.path}:{b.path}{':ro' if b.read_only else ''}" for b in binds)
        return ["srun", "--overlap", "--ntasks=1", f"--container-image={spec.image}",
                *([f"--container-mounts={mounts}"] if mounts else []), "--no-container-mount-home", *inner]
    raise ValueError(f"unknown container runtime {spec.runtime!r}")


def launch_command(spec: ContainerSpec | None, argv: Sequence[str], env: Mapping[str, str]) -> tuple[
        list[str], dict[str, str]]:
    """The argv and environment of a command launched in the image (as given without one)."""
    if spec is None:
        return list(argv), dict(env)
    return wrap_argv(argv, spec), {**env, **spec.environment()}


# -- the checks before any replica starts ----------------------------------------------------------
def choose_runtime(asked: str | None, image: str) -> str:
    """--container-runtime, else the first of DEFAULT_ORDER whose tool is on PATH."""
    if asked is not None:
        return asked
    for runtime in DEFAULT_ORDER:
        if shutil.which(RUNTIME_TOOLS[runtime]):
            return runtime
    raise AiperfError(f"--container {image}: no container runtime on PATH (looked for "
                      f"{', '.join(RUNTIME_TOOLS[r] for r in DEFAULT_ORDER)}); install one or give --container-runtime")


def check_runtime(runtime: str, executor: str) -> None:
    tool = RUNTIME_TOOLS[runtime]
    if shutil.which(tool) is None:
        raise AiperfError(f"--container-runtime {runtime}: '{tool}' is not on PATH")
    if runtime != "pyxis":
        return
    if executor != "slurm":
        raise AiperfError("--container-runtime pyxis: replicas run as SLURM job steps (srun --container-image); "
                          "give --executor slurm")
    try:
        answer = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AiperfError(f"--container-runtime pyxis: 'srun --help' failed: {exc}") from None
    if "--container-image" not in answer.stdout + answer.stderr:
        raise AiperfError("--container-runtime pyxis: this srun has no --container-image (the pyxis plugin is not "
                          "installed on this cluster)")


def resolve_image(runtime: str, image: str) -> str:
    """The image as every node will name it: a local file or folder as an absolute path (which
    must exist here: on a cluster, on the shared filesystem), a registry reference as given."""
    if runtime == "podman":
        answer = subprocess.run(["podman", "image", "exists", image], capture_output=True, text=True, timeout=60)
        if answer.returncode != 0:
            raise AiperfError(f"--container {image}: podman has no such image (podman image exists: exit code "
                              f"{answer.returncode})")
        return image
    if image.startswith(REGISTRY_SCHEMES) or (runtime == "pyxis" and not _looks_like_path(image)):
        return image
    path = Path(image).expanduser()
    if not path.exists():
        raise AiperfError(f"--container {image}: no such image (for {runtime}: "
                          f"{'a folder or SquashFS file' if runtime == 'charliecloud' else 'a file'}; "
                          "`make image` writes build/image/aiperf)")
    return str(path.resolve())


def _looks_like_path(image: str) -> bool:
    return image.startswith(("/", ".", "~")) or image.endswith((".sqsh", ".sqfs", ".squashfs"))


# Run with the image's Python: the stamp, whether the backend's entry point loads and says its
# framework is there, and for each path the deepest folder of it that the image has.
_IMAGE_PROBE = """
import json, os, sys
paths, backend = json.loads(sys.argv[1]), sys.argv[2]
facts = {"python": sys.version.split()[0]}
try:
    facts["stamp"] = json.loads(open(sys.argv[3]).read())
except (OSError, ValueError) as exc:
    facts["stamp"] = None
def folder(path):
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path
facts["folders"] = {p: folder(p) for p in paths}
try:
    from aiperf_core.entry_points import backend_entry_points
    points = {ep.name: ep for ep in backend_entry_points()}
    facts["backends"] = sorted(points)
    if backend not in points:
        facts["backend_error"] = "no backend named '%s' (it has %s)" % (backend, ", ".join(sorted(points)) or "none")
    else:
        availability = points[backend].load().availability()
        if not availability.available:
            facts["backend_error"] = "backend '%s' is unavailable: %s" % (backend, availability.reason)
except Exception as exc:
    facts["backend_error"] = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
print(json.dumps(facts))
"""


@dataclass(frozen=True)
class ImageFacts:
    stamp: dict[str, Any] | None
    folders: dict[str, str]  # path -> the deepest folder of it that the image has
    backend_error: str | None = None
    python: str | None = None
    backends: list[str] = field(default_factory=list)


def probe_image(spec: ContainerSpec, backend: str, paths: Iterable[str]) -> ImageFacts:
    """Run _IMAGE_PROBE in the image (no binds: they are decided from its answer)."""
    argv = wrap_argv([sys.executable, "-c", _IMAGE_PROBE, json.dumps(list(paths)), backend, str(STAMP)],
                     replace(spec, binds=()))
    try:
        answer = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AiperfError(f"--container {spec.image}: {spec.runtime} did not run it within {PROBE_TIMEOUT_S} s"
                          ) from None
    try:
        facts = json.loads(answer.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (answer.stderr.strip().splitlines() or [f"exit code {answer.returncode}"])[-1]
        raise AiperfError(f"--container {spec.image}: not an aiperf image, or {spec.runtime} cannot start it: "
                          f"{last}") from None
    return ImageFacts(stamp=facts.get("stamp"), folders=facts.get("folders") or {},
                      backend_error=facts.get("backend_error"), python=facts.get("python"),
                      backends=facts.get("backends") or [])


def check_image(facts: ImageFacts, image: str, backend: str) -> str:
    """The image's digest, once its stamp and the asked backend are there."""
    stamp = facts.stamp
    if not isinstance(stamp, dict) or not isinstance(stamp.get("digest"), str):
        raise AiperfError(f"--container {image}: not an aiperf image: no {STAMP} with a digest (build it with "
                          "make image)")
    if facts.backend_error is not None:
        raise AiperfError(f"--container {image}: the image cannot run --backend {backend}: {facts.backend_error} "
                          f"(built with extras {stamp.get('extras')!r})")
    return stamp["digest"]


def host_accelerators(dev: Path | None = None) -> dict[str, list[str]]:
    """This node's accelerators by kind, from their device nodes: {"NVIDIA GPU": ["/dev/nvidia0"]}."""
    dev = DEV if dev is None else dev
    found = {kind: sorted(str(p) for p in dev.glob(pattern)) for kind, pattern in HOST_DEVICES.items()}
    return {kind: paths for kind, paths in found.items() if paths}


def check_devices(runtime: str, backend: str, accelerators: Mapping[str, list[str]]) -> None:
    """Refuse a container whose runtime cannot pass this node's accelerators through: the backend
    would train on the CPU beside them."""
    for kind, paths in sorted(accelerators.items()):
        if kind not in PASSES_THROUGH[runtime]:
            shown = ", ".join(paths[:2]) + (", ..." if len(paths) > 2 else "")
            raise AiperfError(f"--container-runtime {runtime}: this node's {kind}s ({shown}) cannot pass through a "
                              f"container (no runtime aiperf wraps binds their driver); run --backend {backend} "
                              "without --container, from a venv")


def charliecloud_binds(wanted: Sequence[Bind], folders: Mapping[str, str], image: str) -> tuple[Bind, ...]:
    """ch-run 0.31 mounts onto folders the image already has, and cannot make one in a read-only
    image: each wanted path is bound at the deepest folder of it that the image has (its own host
    folder of that name, whole). The host's /tmp is bound already (ch-run's default)."""
    binds: dict[str, bool] = {}
    for bind in wanted:
        folder = folders.get(bind.path, "/")
        if folder == "/tmp" or folder.startswith("/tmp/"):
            continue
        if folder in SYSTEM_FOLDERS:
            raise AiperfError(f"--container {image}: charliecloud cannot bind {bind.path}: the image has no folder "
                              f"to mount it on (only {folder}); build the image with IMAGE_MOUNTS="
                              f"/{Path(bind.path).parts[1]} (docs/deploy.md)")
        binds[folder] = binds.get(folder, True) and bind.read_only
    return tuple(Bind(path, read_only) for path, read_only in sorted(binds.items()))


def prepare(image: str, runtime: str | None, backend: str, executor: str, run_root: str, data: str | None,
            gpus: bool | None = None) -> ContainerSpec:
    """Every check before a replica starts in the image, in order (each refusal one line): the
    runtime on PATH, the image there, the image an aiperf image with the backend's framework, this
    node's accelerators able to pass through (local executor: the primary's node is where replicas
    run). `gpus`: pass NVIDIA GPUs through (None: where this node has some)."""
    runtime = choose_runtime(runtime, image)
    check_runtime(runtime, executor)
    resolved = resolve_image(runtime, image)
    accelerators = host_accelerators() if executor == "local" else {}
    check_devices(runtime, backend, accelerators)
    wanted = [Bind(str(Path(run_root).resolve()))] + ([Bind(str(Path(data).resolve()), read_only=True)] if data else [])
    spec = ContainerSpec(runtime, resolved, gpus=bool(accelerators.get("NVIDIA GPU")) if gpus is None else gpus)
    facts = probe_image(spec, backend, [b.path for b in wanted])
    digest = check_image(facts, image, backend)
    binds = charliecloud_binds(wanted, facts.folders, image) if runtime == "charliecloud" else tuple(wanted)
    return replace(spec, digest=digest, binds=binds)


def from_flags(image: str | None, runtime: str | None, backend: str, executor: str, run_root: str | os.PathLike,
               data: str | None, gpus_per_node: int | None) -> ContainerSpec | None:
    """The image a fresh run's replicas run in (--container, --container-runtime), checked; None
    without --container."""
    if image is None:
        if runtime is not None:
            raise AiperfError(f"--container-runtime {runtime}: give --container IMAGE too")
        return None
    gpus = bool(gpus_per_node) if executor == "slurm" else None  # SLURM: the compute nodes' GPUs, as asked
    return prepare(image, runtime, backend, executor, str(run_root), data, gpus=gpus)


def for_resume(run: Mapping[str, Any], root: Path, image: str | None, runtime: str | None,
               gpus_per_node: int | None) -> ContainerSpec | None:
    """The image a resumed run's replicas run in: the one run.json records, checked again, and
    still holding the same digest (a run whose replicas ran two images is flagged by aiperf check).
    --container and --container-runtime, given again, must name it."""
    recorded = run.get("container")
    if not isinstance(recorded, dict) or recorded.get("runtime") is None:
        if image is not None or runtime is not None:
            raise AiperfError(f"--container: the run at {root} was started without --container; resume it without")
        return None
    if image is not None and recorded["image"] not in (image, str(Path(image).expanduser().resolve())):
        raise AiperfError(f"--container {image}: the run's replicas run in {recorded['image']} (run.json container)")
    if runtime is not None and runtime != recorded["runtime"]:
        raise AiperfError(f"--container-runtime {runtime}: the run's replicas run under {recorded['runtime']} "
                          "(run.json container)")
    dataset = run.get("dataset") if isinstance(run.get("dataset"), dict) else {}
    spec = from_flags(recorded["image"], recorded["runtime"], str(run.get("backend")), str(run.get("executor")),
                      root, dataset.get("path"), gpus_per_node)
    if spec.digest != recorded.get("digest"):
        raise AiperfError(f"--resume {root}: {recorded['image']} now holds image {spec.digest}, but the run's "
                          f"replicas ran {recorded.get('digest')} (run.json container); resume with that image")
    return spec


# Run with the image's Python, the data bound in: run.json's `dataset` as the replicas' reader sees it.
_DESCRIBE = """
import json, sys
from aiperf_core.errors import AiperfError
from aiperf_core.workflow.plan import describe_dataset
name, path, policy = json.loads(sys.argv[1])
try:
    print(json.dumps({"dataset": describe_dataset(name, path, policy)}))
except AiperfError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def describe_in_image(spec: ContainerSpec, name: str, path: str | None, policy: Mapping[str, Any]) -> dict[str, Any]:
    """workflow.plan.describe_dataset, run in the image: its digest is then the one the replicas
    find (the lm workload's embedded corpus is the Python's own pydoc text, which differs between
    the host's Python and the image's)."""
    argv, env = launch_command(spec, [sys.executable, "-c", _DESCRIBE, json.dumps([name, path, dict(policy)])],
                               os.environ)
    try:
        answer = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                                timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AiperfError(f"--data {path or name}: describing it in the image took more than {PROBE_TIMEOUT_S} s"
                          ) from None
    try:
        result = json.loads(answer.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (answer.stderr.strip().splitlines() or [f"exit code {answer.returncode}"])[-1]
        raise AiperfError(f"--data {path or name}: describing it in the image failed: {last}") from None
    if "error" in result:
        raise AiperfError(result["error"])
    return result["dataset"]


# -- what a process records about the image it runs in -----------------------------------------------
def read_stamp(path: Path | None = None) -> dict[str, Any] | None:
    try:
        stamp = json.loads((STAMP if path is None else path).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def running_image(environ: Mapping[str, str] | None = None, stamp_path: Path | None = None) -> dict[str, Any] | None:
    """{image, digest, runtime} of the image this process runs in, None outside any: the digest
    from the image's own stamp, the image's name and the runtime as the launcher passed them
    (ContainerSpec.environment), or the stamp's name and null where this process was started in
    the image by hand."""
    environ = os.environ if environ is None else environ
    stamp = read_stamp(stamp_path)
    runtime = environ.get(RUNTIME_ENV) or None
    if stamp is None and runtime is None:
        return None
    stamp = stamp or {}
    return {"image": environ.get(IMAGE_ENV) or stamp.get("name"), "digest": stamp.get("digest"), "runtime": runtime}


def _short(digest: Any) -> str:
    return f"{digest[:19]}..." if isinstance(digest, str) else "none"


def image_reasons(run: Mapping[str, Any], replicas: Mapping[int, Any]) -> list[str]:
    """One reason per replica that ran another image than run.json records (or ran in one where the
    run records none, or outside one where it records one): the first such replica_start of each.
    `replicas` map replica ids to objects whose .starts are their replica_start events."""
    from aiperf_core.scoring.rules import first_differing_starts

    recorded = run.get("container")
    wanted = f"image {_short(recorded.get('digest'))}" if isinstance(recorded, dict) else "no image"
    reasons = []
    for replica, start, digest in first_differing_starts(replicas, _digest_of, _digest_of(run)):
        ran = f"image {_short(digest)}" if isinstance(start.get("container"), dict) else "outside any image"
        reasons.append(f"replica {replica} ran {ran} (attempt {start.get('attempt')}), but run.json records {wanted}")
    return reasons


def _digest_of(record: Mapping[str, Any]) -> str | None:
    """The image digest a run.json or a replica_start records (None: no image)."""
    container = record.get("container")
    return container.get("digest") if isinstance(container, dict) else None


# -- the image's digest, written into the image by its build ------------------------------------------
def tree_digest(root: Path, trees: Sequence[str] = DIGEST_TREES) -> str:
    """'sha256:<hex>' over the trees under `root`: every entry's path and kind in sorted order, a
    file's mode and content, a link's target. Times and owners are left out, so a copy of the image
    in any form (a folder, a SquashFS, a SIF) has the same digest."""
    from aiperf_core.rundir import sha256_file

    total = hashlib.sha256()
    for tree in trees:
        top = root / tree
        if not top.is_dir():
            continue
        for folder, folders, files in os.walk(top):
            folders.sort()
            names = sorted(files + [d for d in folders if os.path.islink(os.path.join(folder, d))])
            folders[:] = [d for d in folders if not os.path.islink(os.path.join(folder, d))]
            total.update(f"d {Path(folder).relative_to(root)}\n".encode("utf-8", "surrogateescape"))
            for name in names:
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, root)
                info = os.lstat(path)
                if stat.S_ISLNK(info.st_mode):
                    entry = f"l {relative} {os.readlink(path)}\n"
                elif stat.S_ISREG(info.st_mode):
                    entry = f"f {relative} {stat.S_IMODE(info.st_mode):o} {sha256_file(path)}\n"
                else:
                    entry = f"o {relative} {stat.S_IFMT(info.st_mode):o}\n"
                total.update(entry.encode("utf-8", "surrogateescape"))
    return f"sha256:{total.hexdigest()}"


def write_stamp(name: str, extras: str, root: Path = Path("/")) -> dict[str, Any]:
    """The build's last step, run in the image being built: STAMP with the digest of what is there."""
    from importlib.metadata import version

    from aiperf_core.atomic import write_text_atomic

    stamp = {"name": name, "extras": extras, "digest": tree_digest(root), "aiperf_version": version("aiperf"),
             "python": sys.version.split()[0]}
    write_text_atomic(root / STAMP.relative_to("/"), json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    return stamp


def main(argv: Sequence[str] | None = None) -> int:
    """`python -B -m aiperf_core.workflow.container stamp|digest` (the Containerfile; checking an
    image folder on the host against its stamp). -B: importing this must write no bytecode into
    the trees being hashed."""
    parser = argparse.ArgumentParser(prog="python -m aiperf_core.workflow.container")
    sub = parser.add_subparsers(dest="command", required=True)
    stamp = sub.add_parser("stamp", help=f"write {STAMP} into the image being built (its last step)")
    stamp.add_argument("--name", required=True)
    stamp.add_argument("--extras", required=True)
    digest = sub.add_parser("digest", help="the digest of an image folder, and whether its stamp agrees")
    digest.add_argument("root", type=Path)
    args = parser.parse_args(argv)
    if args.command == "stamp":
        print(json.dumps(write_stamp(args.name, args.extras)))
        return 0
    computed = tree_digest(args.root)
    recorded = (read_stamp(args.root / STAMP.relative_to("/")) or {}).get("digest")
    print(computed)
    if recorded != computed:
        print(f"{args.root}: its stamp records {recorded}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
