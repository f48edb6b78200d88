"""aiperf probe network: nccl-tests' figures over a replica's ranks (aiperf_core/network/probe.py).

The arithmetic (busbw factors, sizes, the iteration bound, the alpha-beta fit, the table, the record
read back) runs in process. One run of torch across the two nodes of a namespace cluster
(tests/netns_cluster.py), started from here through the cluster's launcher (--hostfile), and one of
jax, started on each node with its place given, both links shaped at SHAPED_MBIT, check that the
busbw of the largest sizes follows the shaped rate; the refusals, and --hostfile's launching with a
stand-in launcher, run without a cluster.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest

from aiperf_core.network import probe
from aiperf_core.cli import main
from netns_cluster import netns_cluster  # noqa: F401 (the fixture)

SHAPED_MBIT = 50
MAX_BYTES = 2 << 20  # 2 MiB: 0.35 s per all-reduce at 50 Mbit/s, the largest three sizes well above the bucket
RECORD_KEYS = {"kind", "version", "backend", "framework_version", "nodes", "ranks", "ranks_per_node", "hosts",
               "device", "collectives", "fit"}
ROW_KEYS = {"bytes", "iterations", "latency_s", "algbw_bytes_per_s", "busbw_bytes_per_s"}


# -- in process ------------------------------------------------------------------------------------

def test_bus_factors_are_nccl_tests():
    assert probe.bus_factor("all_reduce", 2) == 1.0
    assert probe.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert probe.bus_factor("all_to_all", 2) == 0.5
    assert probe.bus_factor("all_to_all", 8) == pytest.approx(0.875)


def test_sizes_run_from_min_to_max_and_end_at_max():
    assert probe.probe_sizes()[0] == 8 and probe.probe_sizes()[-1] == 256 << 20 and len(probe.probe_sizes()) == 26
    assert probe.probe_sizes(8, 100, 4) == [8, 32, 100]
    assert probe.element_count("all_to_all", 8, 4) == 4  # one float32 per rank at least
    assert probe.element_count("all_to_all", 1000, 3) == 249  # whole shares: 83 per rank
    with pytest.raises(probe.ProbeError, match="--max-bytes"):
        probe.probe_sizes(64, 64)


def test_iteration_plan_bounds_a_slow_size_by_its_time():
    assert probe.iteration_plan(0.001, 20, 5, 2.0) == (4, 20)
    assert probe.iteration_plan(0.5, 20, 5, 2.0) == (1, 4)
    assert probe.iteration_plan(30.0, 20, 5, 2.0) == (0, 1)  # 256 MB over a slow link: one timed iteration


def _synthetic_timings(alpha, beta, ranks=2, sizes=(8, 1024, 1 << 20, 8 << 20)):
    return {"device": "cpu", "hosts": ["node1", "node2"], "ranks_per_node": ranks // 2,
            "collectives": {c: [{"bytes": s, "seconds": [alpha + s * probe.bus_factor(c, ranks) / beta] * 3}
                                for s in sizes] for c in probe.COLLECTIVES}}


def test_record_arithmetic_and_the_fit_recovers_alpha_and_beta(tmp_path):
    alpha, beta = 50e-6, 6.25e6
    record = probe.make_record("torch", "2.x", _synthetic_timings(alpha, beta, ranks=4), 2, 3, 2.0)
    assert RECORD_KEYS <= set(record) and record["kind"] == "aiperf-probe-network" and record["version"] == 1
    assert record["ranks"] == 4 and record["ranks_per_node"] == 2
    for collective, rows in record["collectives"].items():
        for row in rows:
            assert ROW_KEYS <= set(row) and row["iterations"] == 3 and not row["bounded"]
            assert row["algbw_bytes_per_s"] == pytest.approx(row["bytes"] / row["latency_s"])
            assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"] * probe.bus_factor(collective, 4))
        assert record["fit"][collective]["latency_s"] == pytest.approx(alpha)
        assert record["fit"][collective]["busbw_bytes_per_s"] == pytest.approx(beta)
    path = tmp_path / "probe.json"
    probe.write_probe(record, path)
    assert probe.load_probe(path) == json.loads(path.read_text())
    with pytest.raises(probe.ProbeError, match="exists"):
        probe.write_probe(record, path)
    table = probe.render(record)
    assert "all-reduce" in table and "all-to-all" in table and "busbw (GB/s)" in table
    assert "0.0063 GB/s" in table  # the fitted beta, 6.25 MB/s
    shown = probe.summary(record)
    assert shown["all_reduce"]["largest_bytes"] == 8 << 20
    assert shown["all_reduce"]["largest_busbw_bytes_per_s"] == pytest.approx(
        (8 << 20) / (alpha + (8 << 20) * 1.5 / beta) * 1.5)


def test_a_fit_whose_alpha_would_be_negative_takes_the_smallest_size_latency():
    rows = [{"bytes": 8, "latency_s": 1e-4}, {"bytes": 1000, "latency_s": 1e-4}, {"bytes": 2000, "latency_s": 3e-3}]
    fit = probe.fit_alpha_beta("all_reduce", rows, 2)
    assert fit["latency_s"] == 1e-4
    assert fit["busbw_bytes_per_s"] == pytest.approx((8 ** 2 + 1000 ** 2 + 2000 ** 2) / (2000 * 2.9e-3))


def test_times_that_do_not_grow_with_the_size_make_a_flat_fit_not_a_failure():
    rows = [probe.entry("all_to_all", size, [t], 2, 1) for size, t in ((8, 3e-4), (64, 1e-4), (512, 2e-4))]
    fit = probe.fit_alpha_beta("all_to_all", rows, 2)
    assert fit == {"latency_s": 2e-4, "busbw_bytes_per_s": pytest.approx(512 / 2e-4 / 2), "flat": True}


def test_a_bad_record_is_one_line_naming_the_field(tmp_path):
    record = probe.make_record("torch", "2.x", _synthetic_timings(1e-5, 1e9), 2, 20, 2.0)
    del record["fit"]["all_to_all"]["busbw_bytes_per_s"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(record))
    with pytest.raises(probe.ProbeError, match=r"bad.json: fit.all_to_all.busbw_bytes_per_s: must be a number"):
        probe.load_probe(path)


@pytest.mark.parametrize("argv, field", [
    (["--max-bytes", "lots"], "--max-bytes"),
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "2", "--node-rank", "2", "--coordinator", "h:1"], "--node-rank"),
    (["--nodes", "2"], "--coordinator"),
    (["--nodes", "2", "--coordinator", "h:99999"], "--coordinator"),
    (["--min-bytes", "64", "--max-bytes", "8"], "--max-bytes"),
    (["--seconds-per-size", "0"], "--seconds-per-size"),
    (["--out", "/proc/nope/out"], "--out"),  # refused before the backend loads and the nodes meet
])
def test_bad_input_is_one_line_naming_the_field(argv, field, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_STEP_NUM_NODES", raising=False)
    assert main(["probe", "network", "--backend", "torch", "--out", str(tmp_path / "p.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "3"], "--nodes 3: the hostfile"),
    (["--node-rank", "1"], "--node-rank: not with --hostfile"),
    (["--coordinator", "a:7000"], "--coordinator: not with --hostfile"),
    (["--launcher", "ssh"], "--launcher 'ssh': give a command with {host}"),
    (["--coordinator-port", "0"], "--coordinator-port"),
])
def test_bad_hostfile_input_is_one_line_naming_the_flag(argv, message, capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=1\n")
    assert main(["probe", "network", "--backend", "torch", "--hostfile", str(hostfile), "--out",
                 str(tmp_path / "p.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("flag", ["--launcher", "--coordinator-port"])
def test_launcher_flags_without_a_hostfile_are_refused(flag, capsys, tmp_path):
    assert main(["probe", "network", "--backend", "torch", flag, "7000", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: only with --hostfile" in err and len(err.strip().splitlines()) == 1, err


def _fake_launcher(tmp_path, behaviour):
    """A launcher template, `launch {host}`, that records the words it was given per host (as ssh
    would run them: joined into one shell line) and then does what `behaviour` (shell) says."""
    script = tmp_path / "launch"
    script.write_text(f'#!/bin/sh\nhost="$1"; shift\nprintf "%s" "$*" > {tmp_path}/"$host".argv\n'
                      f'echo $$ > {tmp_path}/"$host".pid\n{behaviour}\n')
    script.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=1  # the second\nc slots=1\n")
    return f"{script} {{host}}", hostfile


def test_a_hostfile_starts_each_node_through_the_launcher_with_its_place(tmp_path, monkeypatch, capsys):
    import shlex

    launcher, hostfile = _fake_launcher(tmp_path, "exit 0")
    monkeypatch.chdir(tmp_path)
    assert main(["probe", "network", "--backend", "torch", "--hostfile", str(hostfile), "--launcher", launcher,
                 "--nodes", "2", "--coordinator-port", "29600", "--max-bytes", "64K", "--seconds-per-size", "0.5",
                 "--out", "probe.json"]) == 0
    assert "starting the probe on 2 host(s) (a, b), meeting at a:29600" in capsys.readouterr().err
    assert not (tmp_path / "c.argv").exists()  # --nodes 2: the first two hosts
    for rank, host in enumerate("ab"):
        words = shlex.split((tmp_path / f"{host}.argv").read_text())
        assert words[:5] == ["env", sys.executable, "-u", "-m", "aiperf_core"]
        flags = dict(zip(words[7::2], words[8::2]))
        assert words[5:7] == ["probe", "network"] and flags["--node-rank"] == str(rank)
        assert (flags["--nodes"], flags["--coordinator"], flags["--backend"]) == ("2", "a:29600", "torch")
        assert (flags["--max-bytes"], flags["--seconds-per-size"], flags["--out"]) == (
            str(64 << 10), "0.5", str(tmp_path / "probe.json"))


@pytest.mark.parametrize("behaviour, timeout, named", [
    ('[ "$host" = b ] && { echo "ssh: connect to host b: No route to host" >&2; exit 255; }; exec sleep 30', "30",
     "node 1 (b) failed (exit code 255): ssh: connect to host b: No route to host"),
    ('[ "$host" = b ] && exec sleep 30; exit 0', "0.5", "node 1 (b) still ran 0.5 s (--timeout) after node 0 (a)"),
])
def test_a_node_that_fails_or_outstays_is_named_and_the_others_stopped(behaviour, timeout, named, tmp_path, capsys):
    import os
    import time

    launcher, hostfile = _fake_launcher(tmp_path, behaviour)
    started = time.monotonic()
    assert main(["probe", "network", "--backend", "torch", "--hostfile", str(hostfile), "--launcher", launcher,
                 "--timeout", timeout, "--out", str(tmp_path / "p.json")]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1] and err[0].startswith("starting the probe on 3 host(s)") and len(err) == 2, err
    # Every launcher has ended: the sleeping ones were stopped (one stopped at once may not have
    # written its pid yet).
    for path in tmp_path.glob("*.pid"):
        if path.read_text().strip():
            with pytest.raises(ProcessLookupError):
                os.kill(int(path.read_text()), 0)


def test_under_srun_the_step_gives_nodes_rank_and_coordinator(tmp_path, monkeypatch):
    import argparse
    import os

    from aiperf_core.commands.probe import PORT_BASE, placement

    scontrol = tmp_path / "scontrol"  # as SLURM's: the step's node list expanded, one host a line
    scontrol.write_text("#!/bin/sh\n[ \"$3\" = 'node[1-2]' ] && printf 'node1\\nnode2\\n'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for name, value in (("SLURM_STEP_NUM_NODES", "2"), ("SLURM_NODEID", "1"), ("SLURM_STEP_NODELIST", "node[1-2]"),
                        ("SLURM_JOB_ID", "12345")):
        monkeypatch.setenv(name, value)
    flags = argparse.Namespace(nodes=None, node_rank=None, coordinator=None)
    assert placement(flags) == (2, 1, "node1", PORT_BASE + 2345)
    assert placement(argparse.Namespace(nodes=3, node_rank=0, coordinator="head:7000")) == (3, 0, "head", 7000)
    monkeypatch.delenv("SLURM_STEP_NUM_NODES")  # a batch script's own shell: not a step across the nodes
    assert placement(flags) == (1, 0, "127.0.0.1", 0)


def test_a_backend_without_collectives_refuses_in_one_line(tmp_path):
    answer = subprocess.run([sys.executable, "-m", "aiperf_core", "probe", "network", "--backend", "numpy",
                             "--out", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=60)
    assert answer.returncode == 2 and "cannot probe the network" in answer.stderr, answer.stderr
    assert len(answer.stderr.strip().splitlines()) == 1


def _written_record(tmp_path, name="network-probe.json"):
    record = probe.make_record("torch", "2.x", _synthetic_timings(50e-6, 6.25e6), 2, 20, 2.0)
    path = tmp_path / name
    probe.write_probe(record, path, force=True)
    return record, path


def test_the_simulation_reads_the_record():
    from aiperf_core.network.model import Network

    record = probe.make_record("torch", "2.x", _synthetic_timings(50e-6, 6.25e6), 2, 20, 2.0)
    Network.from_probe(record)


def test_system_describe_records_the_probe_beside_the_interconnect(tmp_path, capsys):
    import tomllib

    from aiperf_core.submission.system import load_system

    _, path = _written_record(tmp_path)
    out = tmp_path / "system.toml"
    assert main(["system", "describe", "--probe-network", str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.index("interconnect =") < text.index("[network_probe]") < text.index("[nodes]")
    table = tomllib.loads(text)["network_probe"]
    assert (table["backend"], table["nodes"], table["ranks"]) == ("torch", 2, 2)
    assert table["all_reduce_busbw_bytes_per_s"] == pytest.approx(6.25e6)
    assert table["all_to_all_latency_s"] == pytest.approx(50e-6)
    assert table["all_reduce_largest_bytes"] == 8 << 20
    load_system(out, allow_placeholders=True)  # the schema knows the table
    out.write_text(text.replace("all_to_all_busbw_bytes_per_s = ", "all_to_all_busbw_bytes_per_s = -"))
    with pytest.raises(Exception, match=r"network_probe.all_to_all_busbw_bytes_per_s: must be a number of bytes"):
        load_system(out, allow_placeholders=True)
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "something else"}))
    assert main(["system", "describe", "--probe-network", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.json: kind:" in err and len(err.strip().splitlines()) == 1


def test_the_report_shows_a_probe_in_the_run_directory(tmp_path):
    from aiperf_core.report import write_report
    from test_score import standard_run

    b = standard_run(tmp_path)
    b.finish(1960)
    html_path, summary_path = write_report(tmp_path)
    assert json.loads(summary_path.read_text())["network_probe"] is None
    assert "Network probe" not in html_path.read_text()
    _written_record(tmp_path)
    html_path, summary_path = write_report(tmp_path)
    shown = json.loads(summary_path.read_text())["network_probe"]
    assert shown["all_reduce"]["busbw_bytes_per_s"] == pytest.approx(6.25e6) and shown["ranks"] == 2
    html = html_path.read_text()
    assert "Network probe" in html and "all-to-all bus bandwidth at 8388608 bytes" in html


@pytest.mark.slow
def test_torch_two_ranks_on_one_node_run_as_spawned_processes(tmp_path):
    # A node with several devices (a GPU node's path) runs one spawned process per device; here two
    # CPU devices, meeting on the loopback. Not beside the namespace tests: it would share the cores
    # with their measurement.
    import os

    out = tmp_path / "p.json"
    answer = subprocess.run([sys.executable, "-m", "aiperf_core", "probe", "network", "--backend", "torch",
                             "--max-bytes", "64K", "--step-factor", "8", "--seconds-per-size", "0.2", "--out", str(out)],
                            env={**os.environ, "AIPERF_CPU_DEVICES": "2"}, capture_output=True, text=True, timeout=180)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    record = json.loads(out.read_text())
    assert (record["nodes"], record["ranks"], record["ranks_per_node"], len(record["hosts"])) == (1, 2, 2, 1)
    assert [row["bytes"] for row in record["collectives"]["all_to_all"]] == [8, 64, 512, 4096, 32768, 65536]
    assert "all-to-all" in answer.stdout and f"wrote {out}" in answer.stdout


# -- across two namespace nodes --------------------------------------------------------------------

@contextlib.contextmanager
def _shaped(cluster):
    """Both links of the cluster shaped at SHAPED_MBIT, for the block."""
    for node in cluster.nodes:
        cluster.shape(node, SHAPED_MBIT)
    try:
        yield
    finally:
        for node in cluster.nodes:
            cluster.shape(node, None)


def _probe_across(cluster, out, backend, *options):
    """`aiperf probe network` started on each node with its place given, both links shaped at
    SHAPED_MBIT: node 0's output."""
    coordinator = f"{cluster.address('node1')}:29517"
    with _shaped(cluster):
        processes = [cluster.run_on(node, [
            sys.executable, "-m", "aiperf_core", "probe", "network", "--backend", backend, "--nodes", "2",
            "--node-rank", str(rank), "--coordinator", coordinator, "--timeout", "30", "--out", str(out), *options],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank, node in enumerate(cluster.nodes)]
        outputs = [p.communicate(timeout=180)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    return outputs[0]


def _check_across(record, cluster, backend, sizes, fit_checked=True):
    assert RECORD_KEYS <= set(record)
    assert (record["backend"], record["nodes"], record["ranks"], record["ranks_per_node"], record["device"]) == (
        backend, 2, 2, 1, "cpu")
    assert record["hosts"] == list(cluster.nodes)
    rate = SHAPED_MBIT * 1e6 / 8  # bytes per second each way on each link
    # Two ranks: per collective each sends its whole buffer (all-reduce) or half of it (all-to-all)
    # over its link, busbw's bytes, so a large size's busbw is at most the link's rate. gloo's
    # all-reduce reaches 94% of it here (torch's, and jax's through XLA); its all-to-all only 50-53%
    # (at 200 Mbit/s too), though the links carry exactly the bytes it implies, without
    # retransmissions (docs/workflow.md, "Probing the network"): the bound below holds what was
    # measured, not what a better collective would do.
    lowest = {"all_reduce": 0.75, "all_to_all": 0.35}
    for collective, rows in record["collectives"].items():
        assert [row["bytes"] for row in rows] == sizes
        largest = rows[-1]
        assert lowest[collective] * rate < largest["busbw_bytes_per_s"] < 1.05 * rate, (collective, largest, rate)
        fitted = record["fit"][collective]["busbw_bytes_per_s"]
        assert not fit_checked or lowest[collective] * rate < fitted < 1.1 * rate, (collective, record["fit"])


@pytest.mark.slow
def test_torch_across_two_nodes_through_a_hostfile_busbw_follows_the_shaped_rate(netns_cluster, tmp_path):
    # One command here starts both nodes through the cluster's launcher, as ssh would; --out is
    # relative to this folder and reaches node 0 as an absolute path.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(netns_cluster.hostfile())
    out = tmp_path / "network-probe.json"
    with _shaped(netns_cluster):
        answer = subprocess.run([
            sys.executable, "-m", "aiperf_core", "probe", "network", "--hostfile", str(hostfile), "--launcher",
            netns_cluster.launcher_template(), "--backend", "torch", "--timeout", "30", "--out", out.name,
            "--max-bytes", str(MAX_BYTES), "--seconds-per-size", "0.5"], cwd=tmp_path, env=netns_cluster.env,
            capture_output=True, text=True, timeout=180)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    record = json.loads(out.read_text())
    _check_across(record, netns_cluster, "torch", probe.probe_sizes(max_bytes=MAX_BYTES))
    assert "busbw (GB/s)" in answer.stdout and f"wrote {out}" in answer.stdout  # node 0's table, relayed
    assert "meeting at node1:" in answer.stderr and "over 2 rank(s) on 2 node(s)" in answer.stderr, answer.stderr
    print(probe.render(record))


@pytest.mark.slow
def test_jax_across_two_nodes_busbw_follows_the_shaped_rate(netns_cluster, tmp_path):
    # Large sizes only, few iterations: jax's start and compiling each size's collectives cost more
    # than torch's, and the small sizes are the torch test's. Four sizes of few iterations each make
    # a noisy fit (its beta 0.96 to 1.15 of the rate in three runs): the largest size's busbw is checked.
    out = tmp_path / "network-probe.json"
    _probe_across(netns_cluster, out, "jax", "--min-bytes", "128K", "--max-bytes", "1M", "--iterations", "4",
                  "--warmup", "2", "--seconds-per-size", "0.5")
    record = json.loads(out.read_text())
    _check_across(record, netns_cluster, "jax", [128 << 10, 256 << 10, 512 << 10, 1 << 20], fit_checked=False)
    print(probe.render(record))
