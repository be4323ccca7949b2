"""A user's own classifier, as the format tests (ONNX, torch.export packages) bring it: the
model, an image ensemble around it, and the checks that the server answers as the model
does over tritonclient and behind /predict."""

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import PHOTOS, ROOT

CLASSES = 10


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
        torch.nn.Linear(16, CLASSES),
    ).eval()


def add_image_ensemble(repo, classifier, input_name, output_name):
    """The bundled preprocessor and `ensemble_model` around `classifier` (its tensors named
    `input_name`, `output_name`) in `repo`."""
    import shutil

    shutil.copytree(ROOT / "models" / "preprocessor", repo / "preprocessor")
    ensemble = (ROOT / "models" / "ensemble_model" / "config.pbtxt").read_text()
    ensemble = ensemble.replace('model_name: "classifier"', f'model_name: "{classifier}"')
    ensemble = ensemble.replace('input_map { key: "input__0"', f'input_map {{ key: "{input_name}"')
    ensemble = ensemble.replace('output_map { key: "output__0"', f'output_map {{ key: "{output_name}"')
    ensemble = ensemble.replace("dims: [ 1000 ]", f"dims: [ {CLASSES} ]")
    (repo / "ensemble_model" / "1").mkdir(parents=True)
    (repo / "ensemble_model" / "config.pbtxt").write_text(ensemble)


def answers_tritonclient_as_torch_does(server, model, name, platform, input_name, output_name, rows=(5,)):
    """`name` answers batches of each of `rows` over http and grpc as `model` (within 1e-4),
    and reports `platform`."""
    import torch

    for n in rows:
        batch = np.random.default_rng(n).standard_normal((n, 3, 224, 224), dtype=np.float32)
        with torch.no_grad():
            want = model(torch.from_numpy(batch)).numpy()
        for mod, client in (
            (httpclient, httpclient.InferenceServerClient(server.http_url)),
            (grpcclient, grpcclient.InferenceServerClient(server.grpc_url)),
        ):
            meta = client.get_model_metadata(name)
            assert (meta["platform"] if isinstance(meta, dict) else meta.platform) == platform
            inp = mod.InferInput(input_name, list(batch.shape), "FP32")
            inp.set_data_from_numpy(batch)
            got = client.infer(name, [inp], outputs=[mod.InferRequestedOutput(output_name)]).as_numpy(output_name)
            assert got.shape == (n, CLASSES)
            assert np.abs(got - want).max() < 1e-4, (n, np.abs(got - want).max())


def serves_predict_as_torch_does(server, model):
    """/predict of six photos gives, for each, the class and probability `model` gives the
    very pixels the server's preprocessor makes of it."""
    import torch

    paths = sorted((PHOTOS / "small").glob("*.jpg"))[:6]
    files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in paths]
    r = requests.post(server.base + "/predict?top_k=3", files=files, timeout=120)
    assert r.status_code == 200, r.text
    client = httpclient.InferenceServerClient(server.http_url)
    for path, result in zip(paths, r.json()["results"]):
        raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)[None, :]
        inp = httpclient.InferInput("RAW_IMAGE", list(raw.shape), "UINT8")
        inp.set_data_from_numpy(raw)
        pixels = client.infer("preprocessor", [inp]).as_numpy("PREPROCESSED_IMAGE").copy()
        with torch.no_grad():
            logits = model(torch.from_numpy(pixels))[0]
        assert result["class_id"] == int(logits.argmax()), (path.name, result)
        assert abs(result["score"] - float(torch.softmax(logits, 0).max())) < 1e-4
        assert len(result["top_k"]) == 3


def load_is_refused(server, name, file, says, headers):
    """Loading `name` over the control API answers 400 naming the model and its `file`
    relative to the repository (no path of the server's), and saying each of `says`."""
    r = requests.post(server.base + f"/v2/repository/models/{name}/load", json={}, timeout=120, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert f"'{name}'" in error and f"{name}/1/{file}" in error, error
    assert "/tmp" not in error and str(server.repo) not in error, error
    for part in says:
        assert part in error, (part, error)
