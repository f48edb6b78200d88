"""Collective timing on torch.distributed, for `aiperf probe network` (Backend.probe_collectives).

One rank per device of each node, every node's ranks in one process group met at the layout's
coordinator (distributed.init_process_group: gloo on CPUs, NCCL on GPUs, the same group training
uses). A node with one device runs its rank in this process; with several, one process per device
(distributed.start_ranks), as train_data_parallel does, and global rank 0 sends the timings back through a queue.

all-reduce is dist.all_reduce (SUM) of a float32 buffer of zeros (zeros stay zeros: the values never
overflow, whatever the iterations); all-to-all is dist.all_to_all_single, each rank sending an equal
share of its buffer to every rank. Each timed iteration: a barrier, the clock, the collective, the
device synchronised (CUDA launches are asynchronous), the clock. After the size's iterations one
all-reduce (MAX) of their times gives every iteration's slowest rank. NCCL is unverified here (no
GPU).
"""

from __future__ import annotations

import socket
import time
from typing import Any

from aiperf_core.network.probe import element_count, iteration_plan
from aiperf_core.replica_layout import ReplicaLayout


def _time_collectives(job: dict[str, Any], local_rank: int) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from aiperf_backends.torch.distributed import end_rank, init_process_group, set_worker_threads
    from aiperf_backends.torch.lowering import torch_device

    device = torch_device(job["devices"][local_rank])
    rank, world = job["first_rank"] + local_rank, job["world"]
    set_worker_threads(len(job["devices"]))
    outcome = None
    try:
        init_process_group(rank, world, device, job["master_addr"], job["master_port"], job["timeout_s"])
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())

        def synchronise() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def slowest(values: list[float]) -> list[float]:
            t = torch.tensor(values, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()

        results: dict[str, list[dict[str, Any]]] = {}
        for collective in job["collectives"]:
            rows = []
            for size in job["sizes"]:
                count = element_count(collective, size, world)
                send = torch.zeros(count, dtype=torch.float32, device=device)
                if collective == "all_reduce":
                    def once() -> None:
                        dist.all_reduce(send, op=dist.ReduceOp.SUM)
                else:
                    received = torch.empty_like(send)

                    def once() -> None:
                        dist.all_to_all_single(received, send)

                def timed() -> float:
                    dist.barrier()
                    start = time.perf_counter()
                    once()
                    synchronise()
                    return time.perf_counter() - start

                first = slowest([timed()])[0]
                extra_warmup, iterations = iteration_plan(first, job["iterations"], job["warmup"],
                                                          job["seconds_per_size"])
                for _ in range(extra_warmup):
                    once()
                synchronise()
                seconds = slowest([timed() for _ in range(iterations)])
                rows.append({"bytes": count * send.element_size(), "seconds": seconds})
                del send
            results[collective] = rows
        timings = {"device": device.type, "hosts": hosts[::len(job["devices"])], "ranks_per_node": len(job["devices"]),
                   "collectives": results}
        return timings if rank == 0 else None
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        end_rank(outcome)


def _spawned_rank(local_rank: int, job: dict[str, Any]) -> None:
    timings = _time_collectives(job, local_rank)
    if timings is not None:
        job["results"].put(timings)
        job["results"].close()
        job["results"].join_thread()  # the feeder thread has written everything before the rank ends


def probe_collectives(layout: ReplicaLayout, devices: list[str], collectives: tuple[str, ...], sizes: list[int],
                      iterations: int, warmup: int, seconds_per_size: float) -> dict[str, Any] | None:
    """Backend.probe_collectives on torch; `devices` this node's."""
    from aiperf_backends.torch.distributed import (MASTER_ADDR, free_port, rank_messages, rank_queue, start_ranks,
                                                   terminate_ranks)

    if layout.multi_node:
        meeting = {"world": layout.world, "first_rank": layout.global_rank(0), "master_addr": layout.coordinator_addr,
                   "master_port": layout.coordinator_port, "timeout_s": layout.timeout_s}
    else:
        meeting = {"world": len(devices), "first_rank": 0, "master_addr": MASTER_ADDR, "master_port": free_port(),
                   "timeout_s": layout.timeout_s}
    job = {**meeting, "devices": list(devices), "collectives": tuple(collectives), "sizes": list(sizes),
           "iterations": iterations, "warmup": warmup, "seconds_per_size": seconds_per_size}
    if len(devices) == 1:
        return _time_collectives(job, 0)
    job["results"] = results = rank_queue()
    processes = start_ranks(_spawned_rank, job, len(devices))
    timings = None
    try:
        for timings in rank_messages(processes, results):  # rank 0's one message
            pass
    except BaseException:
        terminate_ranks(processes)
        raise
    finally:
        results.close()
    return timings
