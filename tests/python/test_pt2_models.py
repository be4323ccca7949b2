"""torch.export packages compiled by AOTInductor (`model.pt2`, Triton's platform "torch_aoti"):

- a user's own package behind Triton's PyTorch config conventions (INPUT__0 / OUTPUT__0,
  backend "pytorch") answers `tritonclient` http and grpc with the exporting model's
  outputs (within 1e-4) at several batch sizes, and behind the image ensemble serves
  /predict; it records no batch range, so the config's is trusted;
- a package that is not one, is cut short, holds no loadable compiled model, was compiled
  for another device, machine, instruction set or torch release, for other batch sizes than
  1 to the config's max_batch_size or for another input than the config's, fails its own load (400 over the control API, naming the model,
  the file and what disagrees) while the models that loaded keep serving; tensors of the
  wrong type or shape get the same 400 as for a TorchScript model;
- a hostile package (an entry outside the package, a compression bomb) is refused before
  anything is unpacked, and no refused package leaves files under $TMPDIR.

The bundled classifier's package is checked against the Python reference in
test_export_fidelity.py.
"""

import io
import json
import os
import time
import zipfile

import numpy as np
import pytest
import requests

from conftest import PHOTOS, Server
from user_models import (add_image_ensemble, answers_tritonclient_as_torch_does, load_is_refused,
                         serves_predict_as_torch_does, user_model)

# Triton's PyTorch backend conventions for a torch.export package: ordinal tensor names.
USER_CONFIG = """
name: "{name}"
backend: "pytorch"
platform: "torch_aoti"
max_batch_size: {max_batch}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, {side}, {side} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 10 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
dynamic_batching {{ }}
"""

ADMIN_HEADER, ADMIN_KEY = "x-admin-key", "pt2-test-key"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The user's model, exported and compiled as a user would (CPU, batch dynamic, no
    metadata of visiongate's), and the model itself."""
    import torch

    model = user_model(torch)
    path = tmp_path_factory.mktemp("pt2-user") / "model.pt2"
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad():
        program = torch.export.export(model, (torch.rand(2, 3, 224, 224),), dynamic_shapes=({0: batch},))
    # For the instruction set every x86-64 CPU here has, not -march=native.
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs={"cpp.march": "x86-64-v3", "cpp.simdlen": 256}
    )
    return path.read_bytes(), model


def with_metadata(data, compiled=None, **changes):
    """The package with its AOTInductor metadata changed (`None` removes a key), and its
    compiled model replaced by `compiled` if given; every other entry as it was."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            body = src.read(item)
            if item.filename.endswith("_metadata.json"):
                meta = json.loads(body)
                for k, v in changes.items():
                    if v is None:
                        meta.pop(k, None)
                    else:
                        meta[k] = v
                body = json.dumps(meta).encode()
            if compiled is not None and item.filename.endswith(".so"):
                body = compiled
            dst.writestr(item.filename, body)
    return out.getvalue()


@pytest.fixture(scope="module")
def user_server(package, tmp_path_factory):
    """The user's package as `image_classifier` behind the bundled preprocessor in an image
    ensemble, and (explicit control) the broken packages, loaded one by one by the tests."""
    data, _ = package
    repo = tmp_path_factory.mktemp("pt2-repo") / "models"

    def add(name, body, max_batch=64, side=224, count=2):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.pt2").write_bytes(body)
        (repo / name / "config.pbtxt").write_text(
            USER_CONFIG.format(name=name, max_batch=max_batch, side=side, count=count))

    add("image_classifier", data)
    broken = {
        # Rewritten unchanged: what the other rewrites start from loads.
        "rewritten": (with_metadata(data), {}),
        "not_pt2": (b"this is a text file, not a package\n" * 10, {}),
        "truncated": (data[: len(data) // 2], {}),
        "cuda_package": (with_metadata(data, AOTI_DEVICE_KEY="cuda", AOTI_COMPUTE_CAPABILITY="90"), {}),
        "other_machine": (with_metadata(data, AOTI_MACHINE="aarch64", AOTI_CPU_ISA="ASIMD"), {}),
        "other_isa": (with_metadata(data, AOTI_CPU_ISA="AVX2 NO_SUCH_EXTENSION"), {}),
        "not_elf": (with_metadata(data, compiled=b"not a shared library\n" * 64), {}),
        "other_torch": (with_metadata(data, torch_version="2.12.0+cu128"), {}),
        "few_rows": (with_metadata(data, batch_min="1", batch_max="16"), {"max_batch": 32}),
        "no_single_rows": (with_metadata(data, batch_min="2", batch_max="64"), {}),
        "other_input": (with_metadata(data, input_shape="3,224,224"), {"side": 256}),
    }
    for name, (body, config) in broken.items():
        add(name, body, count=1, **config)
    add_image_ensemble(repo, "image_classifier", "INPUT__0", "OUTPUT__0")
    s = Server(
        "--model-repository", str(repo), "--model-control-mode=explicit", "--load-model=ensemble_model",
        "--repository-control-key", f"{ADMIN_HEADER}={ADMIN_KEY}", repository=False,
    )
    s.repo = repo
    yield s
    s.stop()


def test_a_users_package_answers_tritonclient_as_torch_does(user_server, package):
    _, model = package
    answers_tritonclient_as_torch_does(user_server, model, "image_classifier", "torch_aoti", "INPUT__0",
                                       "OUTPUT__0", rows=(1, 5, 64))


def test_a_users_package_serves_predict_behind_the_image_ensemble(user_server, package):
    _, model = package
    serves_predict_as_torch_does(user_server, model)


def load(server, name):
    return requests.post(server.base + f"/v2/repository/models/{name}/load", json={}, timeout=120,
                         headers={ADMIN_HEADER: ADMIN_KEY})


@pytest.mark.parametrize(
    "name, says",
    [
        ("not_pt2", ["not a torch.export package"]),
        ("truncated", ["not a torch.export package"]),
        ("cuda_package", ["compiled for device 'cuda'", "runs on the CPU"]),
        ("other_machine", ["compiled for aarch64"]),
        ("other_isa", ["compiled for AVX2 NO_SUCH_EXTENSION", "NO_SUCH_EXTENSION (an instruction set"]),
        # Fails after the loader unpacked it: the unpacked file is named under $TMPDIR.
        ("not_elf", ["dlopen", "$TMPDIR/"]),
        ("other_torch", ["compiled with torch 2.12.0+cu128", "export it again"]),
        ("few_rows", ["max_batch_size", "1 to 32 rows", "exported for 1 to 16"]),
        ("no_single_rows", ["max_batch_size", "1 to 64 rows", "exported for 2 to 64"]),
        ("other_input", ["input.dims", "[3,224,224]", "[3,256,256]"]),
    ],
)
def test_a_broken_package_fails_alone_saying_what_and_where(user_server, name, says):
    load_is_refused(user_server, name, "model.pt2", says, {ADMIN_HEADER: ADMIN_KEY})
    # The models that loaded keep serving.
    photo = PHOTOS / "small" / "sk_chelsea.jpg"
    ok = requests.post(user_server.base + "/predict", timeout=60,
                       files=[("files", (photo.name, photo.read_bytes(), "image/jpeg"))])
    assert ok.status_code == 200, ok.text


def test_a_rewritten_package_loads(user_server):
    """What the broken packages are made from loads and answers: each fails for its change."""
    r = load(user_server, "rewritten")
    assert r.status_code == 200, r.text
    body = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 3, 224, 224],
                        "data": [0.5] * (3 * 224 * 224)}]}
    r = requests.post(user_server.base + "/v2/models/rewritten/infer", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 10], r.text


@pytest.mark.parametrize(
    "datatype, shape, says",
    [("INT64", [1, 3, 224, 224], "must be FP32"),
     ("FP32", [1, 3, 224, 200], "[N, 3, 224, 224]; got FP32 [1, 3, 224, 200]")],
)
def test_wrong_tensors_get_the_same_400_as_for_torchscript(user_server, datatype, shape, says):
    body = {"inputs": [{"name": "INPUT__0", "datatype": datatype, "shape": shape,
                        "data": [1] * int(np.prod(shape))}]}
    r = requests.post(user_server.base + "/v2/models/image_classifier/infer", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"], r.text


def hostile(data, extra=None, inflate=None):
    """The package with an `extra` entry (name, body) added, and its metadata entry made
    `inflate` bytes of zeros (deflated: a thousand times smaller in the package)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        top = src.infolist()[0].filename.split("/")[0]
        for item in src.infolist():
            if inflate and item.filename.endswith("_metadata.json"):
                info = zipfile.ZipInfo(item.filename)
                info.compress_type = zipfile.ZIP_DEFLATED
                with dst.open(info, "w", force_zip64=True) as f:
                    zeros = bytes(1 << 20)
                    for _ in range(inflate >> 20):
                        f.write(zeros)
                continue
            dst.writestr(item.filename, src.read(item))
        if extra:
            dst.writestr(f"{top}/{extra[0]}", extra[1])
    return out.getvalue()


def test_hostile_packages_are_refused_before_anything_is_unpacked_and_leave_nothing(package, tmp_path):
    """A package's zip directory is checked before libtorch sees it: an entry that climbs
    out of the package, or a metadata entry that inflates to 256 MiB of zeros, fails the
    load before anything is written; a package that fails inside libtorch's loader (its
    compiled model is not one) leaves its unpacked files behind neither. Twelve refused loads
    leave $TMPDIR as it was, and the model that loaded keeps serving."""
    data, _ = package
    repo, tmpdir = tmp_path / "models", tmp_path / "tmpdir"
    tmpdir.mkdir()

    def add(name, body):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.pt2").write_bytes(body)
        (repo / name / "config.pbtxt").write_text(USER_CONFIG.format(name=name, max_batch=64, side=224, count=1))

    add("good", data)
    refused = {
        "escape": (hostile(data, extra=("data/aotinductor/model/../../../../../../escaped/f", b"outside")),
                   "is not a path inside the package"),
        "bomb": (hostile(data, inflate=256 << 20), "times its size in the package"),
        "not_elf": (with_metadata(data, compiled=b"not a shared library\n" * 64), "dlopen"),
    }
    for name, (body, _) in refused.items():
        add(name, body)
    assert len(refused["bomb"][0]) < 4 * len(data)
    s = Server("--model-repository", str(repo), "--model-control-mode=explicit", "--load-model=good",
               "--repository-control-key", f"{ADMIN_HEADER}={ADMIN_KEY}", repository=False,
               env={**os.environ, "TMPDIR": str(tmpdir)})
    s.repo = repo
    try:
        body = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 3, 224, 224],
                            "data": [0.5] * (3 * 224 * 224)}]}
        before = requests.post(s.base + "/v2/models/good/infer", json=body, timeout=60).json()["outputs"]
        for _ in range(4):
            for name, (_, says) in refused.items():
                load_is_refused(s, name, "model.pt2", [says], {ADMIN_HEADER: ADMIN_KEY})
        # What the loaded package unpacked is there while it serves; nothing else is.
        left = sorted(p.name for p in tmpdir.iterdir())
        assert len(left) == 1 and left[0].startswith("visiongate-pt2-"), left
        assert not list(tmp_path.rglob("escaped"))
        after = requests.post(s.base + "/v2/models/good/infer", json=body, timeout=60).json()["outputs"]
        assert after == before
        r = requests.post(s.base + "/v2/repository/models/good/unload", json={}, timeout=60,
                          headers={ADMIN_HEADER: ADMIN_KEY})
        assert r.status_code == 200, r.text
        deadline = time.time() + 30
        while list(tmpdir.iterdir()) and time.time() < deadline:
            time.sleep(0.2)
        assert list(tmpdir.iterdir()) == []
    finally:
        s.stop()
