"""The demo list behind docs/img/list.png: made-up verdicts of six made-up systems, ranked and rendered.

    .venv/bin/python docs/img/make_list_demo.py /tmp/list.html
    chromium --headless --no-sandbox --hide-scrollbars --window-size=1400,1800 \
        --screenshot=docs/img/list.png file:///tmp/list.html
"""

import hashlib
import sys

from aiperf_core.atomic import write_text_atomic
from aiperf_core.submission.ranking import rank, render_html


def verdict(file, name, site, country, model, nodes, per_node, peak, score, hours, date, precision,
            official=True, measured_peak=None, watts=None, level=None, accuracy=0.76, kind="gpu",
            backend=("torch", "torch 2.3.1"), status="ACCEPTED", reasons=(), digests=None, submitter=None):
    digest = hashlib.sha256(file.encode()).hexdigest()
    count = nodes * per_node
    metered = watts is not None
    return {
        "file": file, "submission_id": f"aiperf-{digest[:20]}", "verdict": status, "official": official,
        "reasons": list(reasons), "findings": [], "run_id": f"run-{digest[20:28]}",
        "log_digests": digests or [hashlib.sha256(f"{file}/{r}".encode()).hexdigest() for r in range(nodes)],
        "system": {"system_name": name, "site": site, "country": country, "submitter": submitter,
                   "nodes": nodes, "accelerator_kind": kind, "accelerator_model": model,
                   "accelerators_per_node": per_node},
        "accelerators": count, "backend": backend[0], "framework_version": backend[1], "precisions": [precision],
        "score_ops": score, "regulated_ops": score * 0.93, "best_accuracy": accuracy, "elapsed_s": hours * 3600,
        "start_time": None, "date": date, "declared_peak_ops": peak * count,
        "measured_peak_ops": measured_peak and measured_peak * count,
        "efficiency_declared": score / (peak * count),
        "efficiency_measured": measured_peak and score / (measured_peak * count),
        "energy": {"measured": metered, "joules": watts * hours * 3600 if metered else None,
                   "ops_per_watt": score / watts if metered else None, "node_coverage": 1.0 if metered else None,
                   "time_coverage": 0.99 if metered else None, "level": level,
                   "statement": f"metered, level {level}" if metered else "not measured"},
    }


DIGITS = ["run on the embedded digits data set, not ImageNet"]

VERDICTS = [
    verdict("lakeside-pod-2024-05.tar.gz", "Lakeside DGX pod", "Lakeside University HPC", "DE", "NVIDIA H100 SXM5",
            16, 8, 989.4e12, 1.98e16, 12, "2024-05-02", "bf16", measured_peak=720e12, watts=104e3, level="L3",
            accuracy=0.771, submitter="M. Weber"),
    verdict("ascend-cluster.tar.gz", "Ascend training cluster", "Example AI Computing Center", "CN", "Ascend 910",
            512, 8, 256e12, 1.9453e17, 12, "2024-03-18", "fp16", measured_peak=205e12, watts=1.62e6, level="L2",
            accuracy=0.781, backend=("mindspore", "mindspore 2.2.14"), submitter="L. Wang"),
    verdict("lakeside-pod-2024-06.tar.gz", "Lakeside DGX pod", "Lakeside University HPC", "DE", "NVIDIA H100 SXM5",
            16, 8, 989.4e12, 2.35e16, 12, "2024-06-11", "bf16", measured_peak=720e12, watts=103e3, level="L3",
            accuracy=0.779, submitter="M. Weber"),
    verdict("campus-node.tar.gz", "Campus GPU node", "Example Polytechnic", "US", "NVIDIA A100-SXM4-40GB",
            1, 4, 312e12, 2.1e14, 12, "2024-04-27", "fp16", measured_peak=265e12, watts=1.55e3, level="L1",
            accuracy=0.765, submitter="J. Rivera"),
    verdict("vision-lab.tar.gz", "Vision lab workstation", "Example Vision Lab", "JP", "NVIDIA GeForce RTX 4090",
            1, 1, 165.2e12, 4.3e13, 1, "2024-06-20", "fp16", official=False, reasons=DIGITS, accuracy=0.982,
            backend=("tensorflow", "tensorflow 2.16.1"), submitter="K. Sato"),
    verdict("robotics-laptop.tar.gz", "Robotics dev laptop", "Example Robotics Group", "FR", "Intel Core i7-1365U",
            1, 1, 0.7e12, 4.2e10, 1, "2024-06-03", "fp32", official=False, reasons=DIGITS, watts=15.0, level="L1",
            accuracy=0.974, kind="cpu", backend=("numpy", "numpy 1.26.4"),
            submitter="C. Martin"),
    verdict("club-laptop.tar.gz", "Data club laptop", "Example Data Science Club", "BR", "AMD Ryzen 7 7840U",
            1, 1, 0.85e12, 6.1e10, 1, "2024-06-09", "fp32", official=False, reasons=DIGITS, accuracy=0.977,
            kind="cpu", backend=("jax", "jax 0.4.30"), submitter="A. Souza"),
    verdict("overclocked.tar.gz", "Overclocked rig", "Example Garage", "US", "NVIDIA GeForce RTX 4090", 1, 1,
            165.2e12, 3.1e14, 1, "2024-06-21", "fp16", status="REJECTED", official=False,
            reasons=["backend torch 2.3.1 is not certified on NVIDIA GeForce RTX 4090 at fp16: "
                     "the conformance report is from a quick run",
                     "score 3.1e+14 OPS exceeds the declared peak 1.652e+14 OPS (1 accelerator)"],
            submitter="B. Jones"),
]
# The robotics laptop's run sent again under another name: a duplicate.
VERDICTS.append(verdict("robotics-laptop-v2.tar.gz", "Robotics laptop (new name)", "Example Robotics Group", "FR",
                        "Intel Core i7-1365U", 1, 1, 0.7e12, 4.2e10, 1, "2024-06-03", "fp32", official=False,
                        reasons=DIGITS, kind="cpu", backend=("numpy", "numpy 1.26.4"),
                        digests=VERDICTS[5]["log_digests"], submitter="C. Martin"))


if __name__ == "__main__":
    write_text_atomic(sys.argv[1] if len(sys.argv) > 1 else "list.html",
                      render_html(rank(VERDICTS), title="aiperf list (demo: made-up systems and results)"))
