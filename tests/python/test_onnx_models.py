"""ONNX models on ONNX Runtime (platform "onnxruntime_onnx"), as Triton users bring them:

- a user's own torch.onnx export behind Triton's onnxruntime image-classifier config answers
  `tritonclient` http and grpc with the exporting framework's outputs (within 1e-4), and
  behind the image ensemble serves /predict;
- the bundled classifier's ONNX export agrees with the Python reference on the 283 photos
  (test_export_fidelity.py);
- an ONNX file that is not one, is cut short, or declares other names, types, ranks or a
  fixed batch dimension than its config, or uses an operator ONNX Runtime lacks, fails its
  own load (400 over the control API, naming the model, the file and the field) while the
  models that loaded keep serving; tensors of the wrong type or shape get the same 400 as
  for a TorchScript model;
- without the ONNX Runtime library, an ONNX model's load says what to install, and the
  TorchScript pipeline serves.
"""

import os
import shutil

import numpy as np
import pytest
import requests

from conftest import PHOTOS, ROOT, Server, link_file, require_module
from user_models import (add_image_ensemble, answers_tritonclient_as_torch_does, load_is_refused,
                         serves_predict_as_torch_does, user_model)

# Triton's onnxruntime image classifier, as its guides write it: FP32 [3, 224, 224] in,
# [classes] out, two CPU instances, dynamic batching.
USER_CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [ {{ name: "input" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ {classes} ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
dynamic_batching {{ }}
"""


def export_onnx(torch, model, path, example, input_name="input", output_name="output", batch=True):
    """torch.onnx's dynamo export, the batch dimension dynamic unless `batch` is False."""
    kwargs = {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1, max=1024)},)} if batch else {}
    with torch.no_grad():
        program = torch.onnx.export(
            model, (example,), input_names=[input_name], output_names=[output_name], dynamo=True,
            verbose=False, **kwargs,
        )
    program.save(str(path), external_data=False)


@pytest.fixture(scope="module")
def user_repository(tmp_path_factory):
    """The bundled preprocessor and an ensemble around the user's ONNX classifier."""
    import torch

    repo = tmp_path_factory.mktemp("onnx-user") / "models"
    model = user_model(torch)
    (repo / "image_classifier" / "1").mkdir(parents=True)
    export_onnx(torch, model, repo / "image_classifier" / "1" / "model.onnx", torch.rand(2, 3, 224, 224))
    (repo / "image_classifier" / "config.pbtxt").write_text(USER_CONFIG.format(name="image_classifier", classes=10))
    add_image_ensemble(repo, "image_classifier", "input", "output")
    return repo, model


@pytest.fixture(scope="module")
def user_server(user_repository):
    repo, _ = user_repository
    s = Server("--model-repository", str(repo), repository=False)
    yield s
    s.stop()


def test_a_users_onnx_export_answers_tritonclient_as_torch_does(user_server, user_repository):
    _, model = user_repository
    answers_tritonclient_as_torch_does(user_server, model, "image_classifier", "onnxruntime_onnx", "input", "output")


def test_a_users_onnx_export_serves_predict_behind_the_image_ensemble(user_server, user_repository):
    _, model = user_repository
    serves_predict_as_torch_does(user_server, model)


# --- broken models -------------------------------------------------------------------------

TINY_CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def tiny_graph(onnx, helper, numpy_helper, input_name="input", elem=None, input_shape=None, op="GlobalAveragePool", domain=""):
    """input [N, 3, 8, 8] -> average pool -> flatten -> matmul [3, 4] -> output [N, 4]."""
    elem = elem or onnx.TensorProto.FLOAT
    x = helper.make_tensor_value_info(input_name, elem, input_shape or ["N", 3, 8, 8])
    y = helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["N", 4])
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    cast = [] if elem == onnx.TensorProto.FLOAT else [
        helper.make_node("Cast", [input_name], ["as_float"], to=onnx.TensorProto.FLOAT)
    ]
    nodes = cast + [
        helper.make_node(op, [cast[0].output[0] if cast else input_name], ["pooled"], domain=domain),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "tiny", [x], [y], [w])
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    # IR 8 (opset 18 needs no newer): the onnx package writes its own newest by default.
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory):
    onnx = require_module("onnx")
    from onnx import helper, numpy_helper

    repo = tmp_path_factory.mktemp("onnx-broken") / "models"
    good = tiny_graph(onnx, helper, numpy_helper)
    files = {
        "good": good,
        "not_onnx": b"this is a text file, not an ONNX graph\n" * 10,
        "truncated": good[: len(good) // 2],
        "other_name": tiny_graph(onnx, helper, numpy_helper, input_name="pixels"),
        "other_type": tiny_graph(onnx, helper, numpy_helper, elem=onnx.TensorProto.DOUBLE),
        "other_rank": tiny_graph(onnx, helper, numpy_helper, input_shape=["N", 3, 64]),
        "fixed_batch": tiny_graph(onnx, helper, numpy_helper, input_shape=[1, 3, 8, 8]),
        "unknown_op": tiny_graph(onnx, helper, numpy_helper, op="NoSuchOperator", domain="com.example"),
    }
    for name, data in files.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(data)
        (repo / name / "config.pbtxt").write_text(TINY_CONFIG.format(name=name))
    # Neither the flag nor its variable: the binary finds ONNX Runtime where the set-up
    # installed it (recorded when it was built), as a bare `visiongate` started by hand does.
    env = {k: v for k, v in os.environ.items() if k != "VISIONGATE_ONNXRUNTIME_LIBRARY"}
    s = Server(
        "--model-repository", str(repo), "--model-control-mode=explicit", "--load-model=good",
        "--repository-control-key", f"{ADMIN_HEADER}={ADMIN_KEY}", repository=False, env=env,
    )
    s.repo = repo
    yield s
    s.stop()


ADMIN_HEADER, ADMIN_KEY = "x-admin-key", "onnx-test-key"


def tiny_infer(server, data, datatype="FP32", shape=None):
    body = {"inputs": [{"name": "input", "datatype": datatype, "shape": shape or [1, 3, 8, 8], "data": data}]}
    return requests.post(server.base + "/v2/models/good/infer", json=body, timeout=30)


def test_onnx_runtime_is_found_where_the_setup_installed_it_without_a_flag(broken_server):
    # broken_server runs without --onnxruntime-library and its variable.
    ok = tiny_infer(broken_server, [1.0] * 192)
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"][0]["data"] == pytest.approx([1.2, 1.5, 1.8, 2.1], abs=1e-5)


@pytest.mark.parametrize(
    "name, says",
    [
        ("not_onnx", ["Protobuf parsing failed"]),
        ("truncated", ["Protobuf parsing failed"]),
        ("other_name", ["field 'input'", "'input'", "'pixels'"]),
        ("other_type", ["field 'input'", "TYPE_FP64", "TYPE_FP32"]),
        ("other_rank", ["field 'input'", "rank 3"]),
        ("fixed_batch", ["field 'input'", "fixed batch dimension of 1"]),
        ("unknown_op", ["model.onnx", "NoSuchOperator"]),
    ],
)
def test_a_broken_onnx_model_fails_alone_saying_what_and_where(broken_server, name, says):
    load_is_refused(broken_server, name, "model.onnx", says, {ADMIN_HEADER: ADMIN_KEY})
    # The model that loaded keeps serving.
    ok = tiny_infer(broken_server, [1.0] * 192)
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"][0]["data"] == pytest.approx([1.2, 1.5, 1.8, 2.1], abs=1e-5)


@pytest.mark.parametrize(
    "datatype, shape, says",
    [("INT64", [1, 3, 8, 8], "must be FP32"), ("FP32", [1, 3, 8, 9], "[N, 3, 8, 8]; got FP32 [1, 3, 8, 9]")],
)
def test_wrong_tensors_get_the_same_400_as_for_torchscript(broken_server, datatype, shape, says):
    n = int(np.prod(shape))
    r = tiny_infer(broken_server, [1] * n, datatype=datatype, shape=shape)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"], r.text


def test_without_onnx_runtime_onnx_models_say_what_to_install_and_the_others_serve(tmp_path):
    onnx = require_module("onnx")
    from onnx import helper, numpy_helper

    repo = tmp_path / "models"
    shutil.copytree(ROOT / "models", repo, ignore=shutil.ignore_patterns("model.*"))
    link_file(ROOT / "models" / "classifier" / "1" / "model.pt", repo / "classifier" / "1" / "model.pt")
    (repo / "tiny" / "1").mkdir(parents=True)
    (repo / "tiny" / "1" / "model.onnx").write_bytes(tiny_graph(onnx, helper, numpy_helper))
    (repo / "tiny" / "config.pbtxt").write_text(TINY_CONFIG.format(name="tiny"))
    s = Server(
        "--model-repository", str(repo), "--model-control-mode=explicit", "--load-model=ensemble_model",
        "--repository-control-key", f"{ADMIN_HEADER}={ADMIN_KEY}",
        "--onnxruntime-library", str(tmp_path / "no-such-libonnxruntime.so"), repository=False,
    )
    try:
        r = requests.post(s.base + "/v2/repository/models/tiny/load", json={}, timeout=60,
                          headers={ADMIN_HEADER: ADMIN_KEY})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "onnxruntime==" in error and "--onnxruntime-library" in error, error
        assert str(tmp_path) not in error, error
        photo = PHOTOS / "small" / "sk_chelsea.jpg"
        ok = requests.post(s.base + "/predict", files=[("files", (photo.name, photo.read_bytes(), "image/jpeg"))],
                           timeout=60)
        assert ok.status_code == 200 and ok.json()["results"][0]["label"] == "Egyptian cat", ok.text
    finally:
        s.stop()
