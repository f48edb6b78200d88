import json

from aiperf_core.builders import resnet_small
from aiperf_core.rundir import EventLog, RunDir, sha256_bytes
from aiperf_core.search.arch import encode
from aiperf_core.search.history import SharedHistory


def finish(run_dir: RunDir, log: EventLog, replica: int, seq: int, target: float, status: str = "ok") -> None:
    trial = f"r{replica:04d}-t{seq:05d}"
    info = {"round": seq + 1, "target": target, "best_val_accuracy": target,
            "hyper": {"batch_size": 32, "kernel_size": 3}, "hpo_point": {"batch_size": 32, "kernel_size": 3},
            "arch": encode(resnet_small()).to_json(),
            "signature": f"sig-{trial}"}
    text = json.dumps(info).encode()
    (run_dir.trial_dir(trial)).mkdir(parents=True, exist_ok=True)
    (run_dir.trial_dir(trial) / "trial.json").write_bytes(text)
    log.append("trial_end", replica=replica, trial=trial, status=status,
               files={"trial.json": sha256_bytes(text), "weights.npz": "0" * 64, "graph.json": "0" * 64})


def test_the_history_reads_every_replica_incrementally_and_trusts_only_matching_files(tmp_path):
    run_dir = RunDir(tmp_path)
    logs = [EventLog(run_dir.replica_log(i)).open() for i in (0, 1)]
    finish(run_dir, logs[0], 0, 0, 0.5)
    finish(run_dir, logs[1], 1, 0, 0.6)
    finish(run_dir, logs[1], 1, 1, 0.7, status="failed")
    history = SharedHistory(run_dir)
    assert sorted(r.trial for r in history.refresh()) == ["r0000-t00000", "r0001-t00000"]
    assert history.refresh() == []
    finish(run_dir, logs[0], 0, 1, 0.8)
    joined = history.refresh()
    assert [(r.trial, r.round, r.target) for r in joined] == [("r0000-t00001", 2, 0.8)]
    assert history.summaries().shape == (3, 3)
    # A trial.json changed after its trial ended is not trusted.
    finish(run_dir, logs[1], 1, 2, 0.9)
    (run_dir.trial_dir("r0001-t00002") / "trial.json").write_text("{}")
    assert history.refresh() == []
    # A torn line waits until it is complete.
    with open(run_dir.replica_log(0), "ab") as f:
        f.write(b'{"event": "trial_end"')
    assert history.refresh() == []
    for log in logs:
        log.close()
