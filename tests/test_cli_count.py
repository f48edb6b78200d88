"""`aiperf count`: readable and JSON output, and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.cli import main
from aiperf_core.ir import save_graph


def run_json(capsys, *argv):
    assert main(["count", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_count_resnet50_shows_table3(capsys):
    assert main(["count", "resnet50"]) == 0
    out = capsys.readouterr().out
    assert "conv1_conv" in out and "conv5_block3_3_conv" in out
    assert "Convolutional            7.71e+09   1.52e+10   1.9755   2.29e+10" in out
    assert "Total                    7.81e+09   1.52e+10   1.9531   2.31e+10" in out
    assert "Batch normalization      7.41e+07   1.91e+03  0.00003   7.41e+07" in out


def test_count_json_keys(capsys):
    data = run_json(capsys, "resnet50", "--train-images", "1281167", "--val-images", "50000")
    assert data["fp"] == 7_806_585_352 and data["bp"] == 15_246_874_820
    assert data["total"] == data["fp"] + data["bp"]
    assert isinstance(data["fp"], int)
    assert set(data["by_category"]) == {"conv", "dense", "attention", "moe", "embedding", "norm", "activation", "pool",
                                        "elementwise", "softmax", "update"}
    assert all(set(v) == {"fp", "bp"} for v in data["by_category"].values())
    node = data["nodes"][1]
    assert {"id", "op", "shape", "fp", "bp"} <= set(node) and node["shape"] == [112, 112, 64]
    assert data["epoch"] == {
        "train_images": 1281167, "val_images": 50000,
        "fp_train": data["fp"] * 1281167, "bp_train": data["bp"] * 1281167,
        "fp_val": data["fp"] * 50000, "total": data["total"] * 1281167 + data["fp"] * 50000,
    }


def test_count_options(capsys, tmp_path):
    small = run_json(capsys, "resnet50", "--input", "64x64x3", "--classes", "10")
    assert small["nodes"][-1]["shape"] == [10]
    valid = run_json(capsys, "resnet50", "--convention", "valid")
    assert valid["fp"] < 7_806_585_352
    path = tmp_path / "small.json"
    save_graph(resnet_small(), path)
    data = run_json(capsys, str(path))
    assert data["graph"] == "resnet_small"


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["count", "missing.json"], "missing.json: no such file"),
        (["count", "resnet50", "--input", "224x224"], "--input"),
        (["count", "resnet50", "--classes", "zero"], "--classes"),
        (["count", "nosuchmodel"], "neither a builder"),
        (["count", "resnet50", "--input", "16x16x3"], "at least 32x32"),
    ],
)
def test_count_errors_are_one_line(capsys, argv, pattern):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert pattern in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_json_file_subprocess(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "nodes": [{"id": "x", "op": "input", "attrs": {"shape": [8,8,3]}},'
                   '{"id": "y", "op": "warp", "inputs": ["x"]}]}')
    proc = subprocess.run([sys.executable, "-m", "aiperf_core", "count", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("node 'y': unknown op 'warp'") and proc.stderr.count("\n") == 1
    proc = subprocess.run([sys.executable, "-m", "aiperf_core", "--debug", "count", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_count_onnx_file_and_unsupported_op(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    from aiperf_core.onnx import export_onnx

    path = tmp_path / "small.onnx"
    export_onnx(resnet_small(), path=path)
    data = run_json(capsys, str(path))
    assert data["fp"] > 0 and data["nodes"][-1]["shape"] == [10]
    node = helper.make_node("Sigmoid", ["input"], ["y"], name="norm1")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])])
    bad = tmp_path / "sigmoid.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), bad)
    assert main(["count", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Sigmoid" in err and "norm1" in err and err.count("\n") == 1
