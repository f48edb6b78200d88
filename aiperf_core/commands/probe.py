"""aiperf probe network: nccl-tests' all-reduce and all-to-all over the ranks of one or more nodes.

    aiperf probe network --hostfile FILE [--launcher TEMPLATE] [--nodes N] [--max-bytes 64M] [--out FILE]
    aiperf probe network --nodes N --node-rank K --coordinator HOST:PORT [--max-bytes 64M] [--out FILE]
    srun -N2 --ntasks-per-node=1 aiperf probe network        (SLURM's step gives nodes, rank, coordinator)

Every node runs it once, as a replica's nodes do; node 0 prints the table and writes the record
(aiperf_core/network/probe.py has the figures and the schema). With --hostfile the command, run on
the submit host, starts it on the first N hosts itself through the hosts executor's launcher
(aiperf_core/workflow/executors/hosts.py), relays node 0's output and waits for every node.
docs/workflow.md, "Probing the network", tells the rest.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from aiperf_core.errors import AiperfError

HELP = ("measure the network between nodes, as nccl-tests does: all-reduce and all-to-all from 8 B to 256 MiB "
        "over every rank of the nodes, with the backend's own collectives (aiperf probe network)")
DEFAULT_OUT = "network-probe.json"
# Under SLURM the coordinator's port is derived from the job id, so that every node of a step computes
# the same one without talking, and two jobs sharing a node rarely collide. With --hostfile the submit
# host picks it for every node, from its own process id in the same range: two probes started at
# once from one host (or several) rarely take the same port.
PORT_BASE, PORT_SPAN = 20000, 10000
# The flags that shape the measurement, given to every node started from a hostfile as given here.
MEASUREMENT_FLAGS = ("--min-bytes", "--max-bytes", "--step-factor", "--iterations", "--warmup", "--seconds-per-size",
                     "--timeout")
STOP_GRACE_S = 5.0  # how long a node's launcher has to end after SIGTERM, before SIGKILL
POLL_S = 0.2
_SIZE = re.compile(r"(\d+)\s*([KMG]i?B?|B)?", re.IGNORECASE)


def add_arguments(p) -> None:
    from aiperf_core.network import probe
    from aiperf_core.workflow.executors.hosts import DEFAULT_LAUNCHER
    from aiperf_core.replica_layout import NODE_TIMEOUT_S

    sub = p.add_subparsers(dest="probe_command", metavar="WHAT", parser_class=type(p))
    sub.required = True
    n = sub.add_parser("network", help="all-reduce and all-to-all latency, algbw and busbw per size, over every "
                                       "rank of the nodes (nccl-tests' figures); node 0 writes the record",
                       description="Run on every node (the same command; under srun SLURM gives the place of "
                                   "each), or once on the submit host with --hostfile, which starts it on the "
                                   "hosts through --launcher. Node 0 prints latency, algbw and busbw per size and "
                                   "writes the JSON record, with the alpha-beta fit of each collective.")
    n.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    n.add_argument("--backend", default=None, metavar="NAME",
                   help="backend (default: $AIPERF_BACKEND, else the config file's 'backend', else tensorflow); "
                        "torch and jax can probe")
    n.add_argument("--hostfile", default=None, metavar="FILE",
                   help="start the probe on the first --nodes hosts of FILE ('HOST slots=K' a line, as "
                        "--executor hosts reads it) through --launcher, from this host; the first host coordinates")
    n.add_argument("--launcher", default=None, metavar="TEMPLATE",
                   help=f"with --hostfile: what starts a node's command on {{host}} (default {DEFAULT_LAUNCHER!r})")
    n.add_argument("--coordinator-port", type=_port, default=None, metavar="PORT",
                   help=f"with --hostfile: the port on the first host where the nodes meet (default "
                        f"{PORT_BASE} + this process's id modulo {PORT_SPAN})")
    n.add_argument("--nodes", type=_whole(1), default=None, metavar="N",
                   help="nodes taking part (default: every host of --hostfile, SLURM_STEP_NUM_NODES under srun, "
                        "else 1)")
    n.add_argument("--node-rank", type=_whole(0), default=None, metavar="K",
                   help="this node's place, 0 to N-1; node 0 leads (default: SLURM_NODEID under srun, else 0)")
    n.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="node 0's address and a free port of it, where the nodes meet (default under srun: the "
                        "step's first node, a port derived from the job id)")
    n.add_argument("--min-bytes", type=_size, default=probe.MIN_BYTES, metavar="SIZE",
                   help=f"smallest buffer per rank (default {probe.MIN_BYTES}; suffixes K, M, G are powers of 1024)")
    n.add_argument("--max-bytes", type=_size, default=probe.MAX_BYTES, metavar="SIZE",
                   help=f"largest buffer per rank (default {probe.format_bytes(probe.MAX_BYTES).replace(' ', '')})")
    n.add_argument("--step-factor", type=_whole(2), default=probe.STEP_FACTOR, metavar="F",
                   help=f"each size is F times the one before (default {probe.STEP_FACTOR})")
    n.add_argument("--iterations", type=_whole(1), default=probe.ITERATIONS, metavar="N",
                   help=f"timed iterations per size, at most (default {probe.ITERATIONS})")
    n.add_argument("--warmup", type=_whole(1), default=probe.WARMUP, metavar="N",
                   help=f"warm-up iterations per size, at most (default {probe.WARMUP})")
    n.add_argument("--seconds-per-size", type=_seconds, default=probe.SECONDS_PER_SIZE, metavar="S",
                   help=f"time bound on a size's timed iterations: a slow size runs fewer, at least one "
                        f"(default {probe.SECONDS_PER_SIZE:g})")
    n.add_argument("--timeout", type=_seconds, default=NODE_TIMEOUT_S, metavar="S",
                   help=f"how long a node waits on the others, to meet and in each collective (default "
                        f"{NODE_TIMEOUT_S:g})")
    n.add_argument("--out", default=DEFAULT_OUT, metavar="FILE",
                   help=f"where node 0 writes the record (default ./{DEFAULT_OUT})")
    n.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    n.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: $AIPERF_CONFIG, else ./aiperf.toml if present)")


def _whole(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
        return value
    return parse


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"must be a port 1-65535, got {text!r}")
    return int(text)


def _size(text: str) -> int:
    """Bytes: 8, 4096, 64K, 16MiB, 1G (K, M, G: powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"must be a size in bytes such as 8, 64K or 256M, got {text!r}")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get((match.group(2) or "b")[0].lower(), 1)
    return int(match.group(1)) * scale


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def parse_coordinator(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AiperfError(f"--coordinator: must be HOST:PORT with a port 1-65535, got {text!r}")
    return host, int(port)


def _slurm_step() -> dict[str, str] | None:
    """The srun step's variables, or None outside one (a batch script's own shell is not a step of N nodes)."""
    names = ("SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_JOB_ID")
    values = {name: os.environ.get(name) for name in names}
    return values if all(values.values()) else None


def _slurm_coordinator(step: dict[str, str]) -> tuple[str, int]:
    try:
        listed = subprocess.run(["scontrol", "show", "hostnames", step["SLURM_STEP_NODELIST"]], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AiperfError(f"--coordinator: not given, and scontrol could not name the step's first node ({exc}): "
                          f"give --coordinator HOST:PORT") from None
    hosts = listed.stdout.split()
    if listed.returncode != 0 or not hosts:
        raise AiperfError(f"--coordinator: not given, and scontrol could not name the step's first node "
                          f"({(listed.stderr.strip().splitlines() or ['no output'])[0]}): give --coordinator HOST:PORT")
    return hosts[0], PORT_BASE + int(step["SLURM_JOB_ID"]) % PORT_SPAN


def _check_out(out, force: bool) -> None:
    """Refuse, before the nodes meet, a record that cannot be written (node 0 checks again when it writes)."""
    from aiperf_core.commands.options import writable_file
    from aiperf_core.network import probe

    if out.exists() and not force:
        raise probe.ProbeError(f"{out}: exists (give --force to overwrite it)")
    writable_file("--out", out)


def placement(args) -> tuple[int, int, str, int]:
    """(nodes, node rank, coordinator address, port) from the flags, else from SLURM's step."""
    step = _slurm_step()
    nodes = args.nodes if args.nodes is not None else int(step["SLURM_STEP_NUM_NODES"]) if step else 1
    node_rank = args.node_rank if args.node_rank is not None else int(step["SLURM_NODEID"]) if step else 0
    if node_rank >= nodes:
        raise AiperfError(f"--node-rank: must be below --nodes ({nodes}), got {node_rank}")
    if args.coordinator is not None:
        addr, port = parse_coordinator(args.coordinator)
    elif nodes == 1:
        addr, port = "127.0.0.1", 0
    elif step:
        addr, port = _slurm_coordinator(step)
    else:
        raise AiperfError(f"--coordinator: {nodes} nodes need HOST:PORT, node 0's address and a free port of it")
    return nodes, node_rank, addr, port


def run(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from aiperf_core.network import probe
    from aiperf_core.backend import Backend
    from aiperf_core.config_file import load_config
    from aiperf_core.registry import load_backend, resolve_backend_name
    from aiperf_core.replica_layout import ReplicaLayout

    if args.hostfile is not None:
        return run_on_hosts(args)
    for flag, value in (("--launcher", args.launcher), ("--coordinator-port", args.coordinator_port)):
        if value is not None:
            raise AiperfError(f"{flag}: only with --hostfile (without it, start the probe on every node with "
                              f"--coordinator HOST:PORT)")
    nodes, node_rank, addr, port = placement(args)
    sizes = probe.probe_sizes(args.min_bytes, args.max_bytes, args.step_factor)
    out = Path(args.out)
    if node_rank == 0:
        _check_out(out, args.force)
    backend = load_backend(resolve_backend_name(args.backend, config=load_config(args.config)))
    if type(backend).probe_collectives is Backend.probe_collectives:
        backend.probe_collectives(None, (), [], 1, 1, 1.0)  # the contract's one-line refusal, before the nodes meet
    layout = ReplicaLayout(nodes=nodes, node_rank=node_rank, coordinator_addr=addr, coordinator_port=port,
                           timeout_s=args.timeout)
    if layout.multi_node:
        backend.start_node(layout)  # before any device is touched (jax joins its processes here)
    devices = backend.devices()
    layout = replace(layout, devices_per_node=len(devices), local_devices=tuple(devices))
    if layout.world < 2:
        raise probe.ProbeError("--nodes: a probe needs at least two ranks: give --nodes 2 or more, or run on a node "
                               "with several devices (on a CPU: AIPERF_CPU_DEVICES=2)")
    if node_rank == 0:
        print(f"probing {', '.join(probe.COLLECTIVES)} over {layout.world} rank(s) on {nodes} node(s), "
              f"{probe.format_bytes(sizes[0])} to {probe.format_bytes(sizes[-1])}, at most {args.iterations} "
              f"iterations or {args.seconds_per_size:g} s per size", file=sys.stderr, flush=True)
    try:
        timings = backend.probe_collectives(layout, probe.COLLECTIVES, sizes, args.iterations, args.warmup,
                                            args.seconds_per_size)
    except AiperfError:
        raise
    except Exception as exc:  # the framework's own error: a peer that never came, or was lost (--timeout)
        if getattr(args, "debug", False):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise probe.ProbeError(f"node {node_rank} ({socket.gethostname()}): the collectives failed with "
                               f"{nodes} node(s) meeting at {addr}:{port}: {first}") from None
    if node_rank != 0:
        return 0
    record = probe.make_record(backend.name, backend.framework_version(), timings, nodes, args.iterations,
                               args.seconds_per_size)
    probe.write_probe(record, out, force=args.force)
    print(probe.render(record))
    print(f"wrote {out}")
    return 0


def run_on_hosts(args) -> int:
    """--hostfile: start the probe on each of the first --nodes hosts through the launcher, the first
    host coordinating; node 0's output comes out here. Ends when every node has: AiperfError naming
    the first node that failed, or one still running --timeout after another ended (the rest stopped)."""
    from pathlib import Path

    from aiperf_core.config_file import load_config
    from aiperf_core.network import probe
    from aiperf_core.registry import resolve_backend_name
    from aiperf_core.workflow.executors.base import aiperf_argv, stop_processes
    from aiperf_core.workflow.executors.hosts import DEFAULT_LAUNCHER, check_launcher, launcher_argv, read_hostfile

    for flag, value in (("--node-rank", args.node_rank), ("--coordinator", args.coordinator)):
        if value is not None:
            raise AiperfError(f"{flag}: not with --hostfile, which gives every node its place (the first host "
                              f"coordinates, at --coordinator-port)")
    launcher = check_launcher(args.launcher if args.launcher is not None else DEFAULT_LAUNCHER)
    hosts = read_hostfile(args.hostfile)
    nodes = args.nodes if args.nodes is not None else len(hosts)
    if nodes > len(hosts):
        raise AiperfError(f"--nodes {nodes}: the hostfile {args.hostfile} names {len(hosts)} host(s)")
    hosts = hosts[:nodes]
    probe.probe_sizes(args.min_bytes, args.max_bytes, args.step_factor)  # refused here, not on every node
    out = Path(os.path.abspath(args.out))  # node 0 writes it: the same path on a shared filesystem
    _check_out(out, args.force)
    backend = resolve_backend_name(args.backend, config=load_config(args.config))
    port = args.coordinator_port if args.coordinator_port is not None else PORT_BASE + os.getpid() % PORT_SPAN
    coordinator = f"{hosts[0].name}:{port}"
    shared = ["--backend", backend, "--nodes", str(nodes), "--coordinator", coordinator, "--out", str(out),
              *(word for flag in MEASUREMENT_FLAGS for word in (flag, str(getattr(args, flag[2:].replace("-", "_"))))),
              *(["--force"] if args.force else []), *(["--debug"] if getattr(args, "debug", False) else [])]
    print(f"starting the probe on {nodes} host(s) ({', '.join(h.name for h in hosts)}), meeting at {coordinator}",
          file=sys.stderr, flush=True)
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="aiperf-probe-") as folder:
        logs = [Path(folder, f"node-{rank}.log") for rank in range(nodes)]
        try:
            for rank, host in enumerate(hosts):
                argv = launcher_argv(launcher, host.name, aiperf_argv(
                    "probe", "network", "--node-rank", str(rank), *shared), {})
                # Node 0's output is the probe's: its stdout and stderr are this command's. The
                # others' go to a log, whose last line names what went wrong on a node that fails.
                log = open(logs[rank], "wb") if rank else None
                try:
                    processes.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                      stderr=subprocess.STDOUT if log else None,
                                                      start_new_session=True))
                except OSError as exc:
                    raise AiperfError(f"--launcher {launcher!r}: cannot start it for {host.name}: "
                                      f"{exc.strerror or exc}") from None
                finally:
                    if log is not None:
                        log.close()
            _wait_for_nodes(processes, [h.name for h in hosts], logs, args.timeout)
        finally:
            stop_processes(processes, STOP_GRACE_S)
    return 0


def _wait_for_nodes(processes: list[subprocess.Popen], hosts: list[str], logs: list, timeout_s: float) -> None:
    """Return once every node's launcher has ended well; ProbeError naming the first that failed, or
    one still running timeout_s after another ended (a node waits that long on the others itself)."""
    from aiperf_core.network import probe
    from aiperf_core.workflow.executors.base import describe_exit_code

    first_end = None
    while True:
        codes = [process.poll() for process in processes]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                said = _last_line(logs[rank]) if rank else ""
                ended = describe_exit_code(code).description
                raise probe.ProbeError(f"--hostfile: node {rank} ({hosts[rank]}) failed ({ended})"
                                       f"{': ' + said if said else ''}; the other nodes were stopped")
        if all(code == 0 for code in codes):
            return
        if first_end is None and 0 in codes:
            first_end = time.monotonic()
        if first_end is not None and time.monotonic() - first_end > timeout_s:
            rank = codes.index(None)
            raise probe.ProbeError(f"--hostfile: node {rank} ({hosts[rank]}) still ran {timeout_s:g} s (--timeout) "
                                   f"after node {codes.index(0)} ({hosts[codes.index(0)]}) ended; it was stopped")
        time.sleep(POLL_S)


def _last_line(path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip()[:400] if lines else ""
