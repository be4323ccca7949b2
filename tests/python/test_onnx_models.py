"""ONNX models on ONNX Runtime (platform "onnxruntime_onnx"), as Triton users bring them:

- a user's own torch.onnx export behind Triton's onnxruntime image-classifier config answers
  `tritonclient` http and grpc with the exporting framework's outputs (within 1e-4), and
  behind the image ensemble serves /predict;
- the bundled classifier's ONNX export agrees with the Python reference on the 283 photos;
- an ONNX file that is not one, is cut short, or declares other names, types, ranks or a
  fixed batch dimension than its config, or uses an operator ONNX Runtime lacks, fails its
  own load (400 over the control API, naming the model, the file and the field) while the
  models that loaded keep serving; tensors of the wrong type or shape get the same 400 as
  for a TorchScript model;
- without the ONNX Runtime library, an ONNX model's load says what to install, and the
  TorchScript pipeline serves.
"""

import json
import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import reference
from conftest import PHOTOS, ROOT, Server, link_file

NEAR_TIE = 0.02

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


def user_model(torch):
    """A small classifier of the user's: convolutions, pooling, a linear layer, 10 classes."""
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 5, stride=4),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    ).eval()


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
    shutil.copytree(ROOT / "models" / "preprocessor", repo / "preprocessor")
    ensemble = (ROOT / "models" / "ensemble_model" / "config.pbtxt").read_text()
    ensemble = ensemble.replace('model_name: "classifier"', 'model_name: "image_classifier"')
    ensemble = ensemble.replace('input_map { key: "input__0"', 'input_map { key: "input"')
    ensemble = ensemble.replace('output_map { key: "output__0"', 'output_map { key: "output"')
    ensemble = ensemble.replace("dims: [ 1000 ]", "dims: [ 10 ]")
    (repo / "ensemble_model" / "1").mkdir(parents=True)
    (repo / "ensemble_model" / "config.pbtxt").write_text(ensemble)
    return repo, model


@pytest.fixture(scope="module")
def user_server(user_repository):
    repo, _ = user_repository
    s = Server("--model-repository", str(repo), repository=False)
    yield s
    s.stop()


def test_a_users_onnx_export_answers_tritonclient_as_torch_does(user_server, user_repository):
    import torch

    _, model = user_repository
    batch = np.random.default_rng(3).standard_normal((5, 3, 224, 224), dtype=np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(batch)).numpy()
    for mod, client in (
        (httpclient, httpclient.InferenceServerClient(user_server.http_url)),
        (grpcclient, grpcclient.InferenceServerClient(user_server.grpc_url)),
    ):
        meta = client.get_model_metadata("image_classifier")
        platform = meta["platform"] if isinstance(meta, dict) else meta.platform
        assert platform == "onnxruntime_onnx"
        inp = mod.InferInput("input", list(batch.shape), "FP32")
        inp.set_data_from_numpy(batch)
        out = client.infer("image_classifier", [inp], outputs=[mod.InferRequestedOutput("output")])
        got = out.as_numpy("output")
        assert got.shape == (5, 10)
        assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


def test_a_users_onnx_export_serves_predict_behind_the_image_ensemble(user_server, user_repository):
    import torch

    _, model = user_repository
    paths = sorted((PHOTOS / "small").glob("*.jpg"))[:6]
    files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in paths]
    r = requests.post(user_server.base + "/predict?top_k=3", files=files, timeout=120)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    # The classes the user's model gives the very tensors the preprocessor makes of them.
    client = httpclient.InferenceServerClient(user_server.http_url)
    for path, result in zip(paths, results):
        raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)[None, :]
        inp = httpclient.InferInput("RAW_IMAGE", list(raw.shape), "UINT8")
        inp.set_data_from_numpy(raw)
        pixels = client.infer("preprocessor", [inp]).as_numpy("PREPROCESSED_IMAGE")
        with torch.no_grad():
            logits = model(torch.from_numpy(pixels))[0]
        probs = torch.softmax(logits, 0)
        assert result["class_id"] == int(logits.argmax()), (path.name, result)
        assert abs(result["score"] - float(probs.max())) < 1e-4
        assert len(result["top_k"]) == 3


def test_the_bundled_onnx_export_agrees_with_the_python_reference(server, tmp_path):
    """Top-1 of the bundled classifier's ONNX file against the Python reference pipeline
    (PIL + torchvision + the TorchScript model) on the 283 photos, near-ties excused; and
    against this server's TorchScript run of the same pixels."""
    repo = tmp_path / "models"
    shutil.copytree(ROOT / "models", repo, ignore=shutil.ignore_patterns("model.*"))
    link_file(ROOT / "models" / "classifier" / "1" / "model.onnx", repo / "classifier" / "1" / "model.onnx")
    config = repo / "classifier" / "config.pbtxt"
    # The one line that moves the bundled pipeline to ONNX.
    config.write_text(config.read_text().replace('platform: "pytorch_libtorch"', 'platform: "onnxruntime_onnx"'))
    paths = sorted(PHOTOS.glob("*/*.jpg")) + sorted((PHOTOS / "registry").glob("*.webp"))
    assert len(paths) >= 280
    kinds = {".jpg": "image/jpeg", ".webp": "image/webp"}

    def predict(s):
        files = [("files", (p.name, p.read_bytes(), kinds[p.suffix])) for p in paths]
        r = requests.post(s.base + "/predict?top_k=2", files=files, timeout=900)
        assert r.status_code == 200, r.text
        return r.json()["results"]

    s = Server("--model-repository", str(repo), repository=False)
    try:
        meta = requests.get(s.base + "/v2/models/classifier", timeout=10).json()
        assert meta["platform"] == "onnxruntime_onnx"
        onnx = predict(s)
    finally:
        s.stop()
    torchscript = predict(server)
    python_ref = reference.classify([str(p) for p in paths], str(ROOT / "models"))
    # Near-ties are judged on the TorchScript server's top two (the reference gives top-1).
    tie = [x["top_k"][0]["score"] - x["top_k"][1]["score"] < NEAR_TIE for x in torchscript]
    agree = [o["class_id"] == r["class_id"] for o, r in zip(onnx, python_ref)]
    firm = [a for a, t in zip(agree, tie) if not t]
    same_as_torchscript = [o["class_id"] == t["class_id"] for o, t in zip(onnx, torchscript)]
    diff = [abs(o["score"] - t["score"]) for o, t in zip(onnx, torchscript)]
    report = {
        "photos": len(paths),
        "top1_vs_python_reference": f"{sum(agree)}/{len(agree)}",
        "top1_vs_python_reference_near_ties_excused": f"{sum(firm)}/{len(firm)}",
        "near_ties": sum(tie),
        "top1_vs_torchscript_server": f"{sum(same_as_torchscript)}/{len(paths)}",
        "max_abs_score_diff_vs_torchscript_server": float(f"{max(diff):.3g}"),
        "disagreements_with_reference": [p.name for p, a in zip(paths, agree) if not a],
    }
    print("\nonnx fidelity:", json.dumps(report))
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    (ROOT / "test-artifacts" / "onnx-fidelity.json").write_text(json.dumps(report, indent=2))
    assert sum(firm) / len(firm) >= 0.99, report
    assert max(diff) < 1e-3, report


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
    onnx = pytest.importorskip("onnx")
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
    s = Server(
        "--model-repository", str(repo), "--model-control-mode=explicit", "--load-model=good",
        "--repository-control-key", f"{ADMIN_HEADER}={ADMIN_KEY}", repository=False,
    )
    s.repo = repo
    yield s
    s.stop()


ADMIN_HEADER, ADMIN_KEY = "x-admin-key", "onnx-test-key"


def tiny_infer(server, data, datatype="FP32", shape=None):
    body = {"inputs": [{"name": "input", "datatype": datatype, "shape": shape or [1, 3, 8, 8], "data": data}]}
    return requests.post(server.base + "/v2/models/good/infer", json=body, timeout=30)


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
    r = requests.post(
        broken_server.base + f"/v2/repository/models/{name}/load", json={}, timeout=60,
        headers={ADMIN_HEADER: ADMIN_KEY},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert f"'{name}'" in error and f"{name}/1/model.onnx" in error, error
    # Said relative to the repository: no path of the server's reaches a client.
    assert "/tmp" not in error and str(broken_server.repo) not in error, error
    for part in says:
        assert part in error, (part, error)
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
    onnx = pytest.importorskip("onnx")
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
