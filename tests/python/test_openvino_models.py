"""Models on OpenVINO (backend "openvino"), as Triton's openvino backend takes them:

- a small graph as OpenVINO IR (model.xml + model.bin) and as ONNX (default_model_filename)
  answers KServe with the values the graph computes, at every batch size up to the config's
  (one that flattens by a reshape to batch 1 too), with OpenVINO found where the set-up installed it (no flag, no variable);
- an IR whose .bin is missing or cut short, a graph whose tensors disagree with the config,
  an ONNX file whose tensors keep their data outside it, a file
  of another format and parameters visiongate cannot honour each fail their own load (400
  over the control API, naming the model, the file and what is wrong) while the models that
  loaded keep serving;
- the bundled classifier's IR agrees with the Python reference and the TorchScript server
  (test_export_fidelity.py), and OpenVINO bf16 with OpenVINO FP32
  (test_precision_fidelity.py).
"""

import os

import numpy as np
import pytest
import requests

from conftest import Server, require_module
from user_models import load_is_refused

CONFIG = """
name: "{name}"
backend: "openvino"
max_batch_size: 8
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
"""
ADMIN_HEADER, ADMIN_KEY = "x-admin-key", "openvino-test-key"
HEADERS = {ADMIN_HEADER: ADMIN_KEY}


def tiny_graph(onnx, helper, numpy_helper, input_name="input", fixed_batch=False):
    """input [N, 3, 8, 8] -> average pool -> flatten -> matmul [3, 4] -> output [N, 4];
    `fixed_batch` flattens with a reshape to [1, 3], as an export traced at batch 1 may."""
    x = helper.make_tensor_value_info(input_name, onnx.TensorProto.FLOAT, ["N", 3, 8, 8])
    y = helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["N", 4])
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    shape = numpy_helper.from_array(np.array([1, 3], dtype=np.int64), "shape")
    flatten = (helper.make_node("Reshape", ["pooled", "shape"], ["flat"]) if fixed_batch
               else helper.make_node("Flatten", ["pooled"], ["flat"]))
    nodes = [
        helper.make_node("GlobalAveragePool", [input_name], ["pooled"]),
        flatten,
        helper.make_node("MatMul", ["flat", "w"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "tiny", [x], [y], [w, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def as_ir(model, directory):
    """`model` converted to IR in `directory` (model.xml, model.bin), FP32 weights."""
    ov = require_module("openvino")
    directory.mkdir(parents=True, exist_ok=True)
    onnx_path = directory / "source.onnx"
    onnx_path.write_bytes(model.SerializeToString())
    ov.save_model(ov.convert_model(str(onnx_path)), str(directory / "model.xml"), compress_to_fp16=False)
    onnx_path.unlink()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    onnx = require_module("onnx")
    from onnx import external_data_helper, helper, numpy_helper

    repo = tmp_path_factory.mktemp("openvino") / "models"
    good = tiny_graph(onnx, helper, numpy_helper)
    onnx_file = 'default_model_filename: "model.onnx"'

    def model(name, extra=""):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
        return repo / name / "1"

    as_ir(good, model("ir"))
    model("onnx", onnx_file).joinpath("model.onnx").write_bytes(good.SerializeToString())

    as_ir(good, model("no_bin"))
    (repo / "no_bin" / "1" / "model.bin").unlink()
    as_ir(good, model("short_bin"))
    weights = repo / "short_bin" / "1" / "model.bin"
    weights.write_bytes(weights.read_bytes()[:8])
    as_ir(tiny_graph(onnx, helper, numpy_helper, input_name="pixels"), model("other_name"))
    # Flattened by a reshape to [1, 3], as an export traced at batch 1 may: OpenVINO's
    # reshape to the config's batches carries the new batch through it.
    as_ir(tiny_graph(onnx, helper, numpy_helper, fixed_batch=True), model("batch_one_reshape"))
    # The weights in a file beside the graph: OpenVINO would read whatever the location names.
    external = tiny_graph(onnx, helper, numpy_helper)
    external_data_helper.convert_model_to_external_data(external, location="w.data", size_threshold=0)
    directory = model("external_data", onnx_file)
    onnx.save_model(external, str(directory / "model.onnx"))
    model("other_format", 'default_model_filename: "model.pt"').joinpath("model.pt").write_bytes(b"x")
    as_ir(good, model("fp16", 'parameters { key: "precision" value: { string_value: "fp16" } }'))
    as_ir(good, model("gpu_device", 'parameters { key: "TARGET_DEVICE" value: { string_value: "GPU" } }'))

    # Neither the flag nor its variable: the binary finds OpenVINO where the set-up
    # installed it (recorded when it was built).
    env = {k: v for k, v in os.environ.items() if k != "VISIONGATE_OPENVINO_LIBRARY"}
    s = Server(
        "--model-repository", str(repo), "--model-control-mode=explicit",
        "--load-model=ir", "--load-model=onnx", "--load-model=batch_one_reshape",
        "--repository-control-key", f"{ADMIN_HEADER}={ADMIN_KEY}", repository=False, env=env,
    )
    s.repo = repo
    yield s
    s.stop()


def infer(server, model, rows):
    x = np.arange(rows * 192, dtype=np.float32).reshape(rows, 3, 8, 8) / 100
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = requests.post(server.base + f"/v2/models/{model}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [rows, 4], out
    want = x.mean(axis=(2, 3)) @ (np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    return np.array(out["data"]).reshape(rows, 4), want


@pytest.mark.parametrize("model", ["ir", "onnx", "batch_one_reshape"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_ir_and_onnx_answer_what_the_graph_computes_at_every_batch_size(server, model, rows):
    got, want = infer(server, model, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    meta = requests.get(server.base + f"/v2/models/{model}", timeout=10).json()
    assert meta["platform"] == "openvino", meta


@pytest.mark.parametrize(
    "name, file, says",
    [
        ("no_bin", "model.bin", ["is missing", ".bin beside its .xml"]),
        ("short_bin", "model.xml", ["Incorrect weights in bin file"]),
        ("other_name", "model.xml", ["field 'input'", "'pixels'"]),
        ("external_data", "model.onnx", ["external_data", "must hold its weights"]),
        ("other_format", "", ["default_model_filename", "IR (.xml with its .bin) or ONNX"]),
        ("fp16", "model.xml", ["fp16 is not offered for OpenVINO"]),
        ("gpu_device", "", ["TARGET_DEVICE", "CPU only"]),
    ],
)
def test_a_model_openvino_cannot_serve_fails_alone_saying_what_and_where(server, name, file, says):
    if file:
        load_is_refused(server, name, file, says, HEADERS)
    else:  # a config error names the field, not a file
        r = requests.post(server.base + f"/v2/repository/models/{name}/load", json={}, timeout=120, headers=HEADERS)
        assert r.status_code == 400, r.text
        for part in says:
            assert part in r.json()["error"], (part, r.text)
    got, want = infer(server, "ir", 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
