"""Existing Triton users' clients, unchanged, against visiongate: `tritonclient.http` and
`tritonclient.grpc` from PyPI, the real server and the real model.

The ensemble input is built exactly as the FastAPI gateway of the stack visiongate replaces
builds it (`read_and_pad_images`: np.frombuffer, np.pad, np.stack into UINT8 [N, L]).
"""

import json

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

PHOTO_NAMES = ["sk_chelsea.jpg", "sk_coffee.jpg", "LadyBird.jpg", "Kite.jpg"]


def read_and_pad_images(paths):
    """The seed gateway's batching: encoded bytes, zero-padded to the longest, stacked."""
    arrays = [np.frombuffer(open(p, "rb").read(), dtype=np.uint8) for p in paths]
    longest = max(len(a) for a in arrays)
    return np.stack([np.pad(a, (0, longest - len(a))) for a in arrays])


@pytest.fixture(scope="module")
def photos(all_photos):
    by_name = {p.name: p for p in all_photos if p.parent.name == "small"}
    return [by_name[n] for n in PHOTO_NAMES]


@pytest.fixture(scope="module")
def predicted(server, photos):
    """Top-1 class of each photo according to /predict (the reference for the protocols)."""
    files = [("files", (p.name, open(p, "rb").read(), "image/jpeg")) for p in photos]
    body = requests.post(server.base + "/predict", files=files, timeout=120).json()
    return [r["class_id"] for r in body["results"]]


def client(kind, server):
    if kind == "http":
        return httpclient, httpclient.InferenceServerClient(server.http_url, network_timeout=300)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc_url)


BOTH = ["http", "grpc"]


def raw_image_input(mod, batch):
    """The seed gateway's `RAW_IMAGE` input: UINT8 [N, L]."""
    inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_data_from_numpy(batch)
    return inp


@pytest.mark.parametrize("kind", BOTH)
def test_health_and_readiness(server, kind):
    _, c = client(kind, server)
    assert c.is_server_live()
    assert c.is_server_ready()
    for model in ["ensemble_model", "classifier", "preprocessor"]:
        assert c.is_model_ready(model), model
        assert c.is_model_ready(model, "1"), model
    assert not c.is_model_ready("classifier", "2")


@pytest.mark.parametrize("kind", BOTH)
def test_server_and_model_metadata(server, kind):
    _, c = client(kind, server)
    as_json = {"as_json": True} if kind == "grpc" else {}
    meta = c.get_server_metadata(**as_json)
    assert meta["name"] == "visiongate"
    assert {"classification", "binary_tensor_data", "statistics"} <= set(meta["extensions"])
    m = c.get_model_metadata("classifier", **as_json)
    assert m["name"] == "classifier" and m["versions"] == ["1"]
    assert m["platform"] == "pytorch_libtorch"
    assert m["inputs"][0]["name"] == "input__0" and m["inputs"][0]["datatype"] == "FP32"
    assert [int(d) for d in m["inputs"][0]["shape"]] == [-1, 3, 224, 224]
    assert [int(d) for d in m["outputs"][0]["shape"]] == [-1, 1000]
    e = c.get_model_metadata("ensemble_model", "1", **as_json)
    assert e["inputs"][0]["name"] == "RAW_IMAGE" and e["inputs"][0]["datatype"] == "UINT8"


@pytest.mark.parametrize("kind", BOTH)
def test_model_config_is_as_on_disk(server, kind):
    _, c = client(kind, server)
    cfg = c.get_model_config("classifier", **({"as_json": True} if kind == "grpc" else {}))
    if kind == "grpc":
        cfg = cfg["config"]
    assert cfg["name"] == "classifier"
    assert cfg["max_batch_size"] == 4096
    assert cfg["input"][0]["name"] == "input__0"
    assert cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert [int(d) for d in cfg["input"][0]["dims"]] == [3, 224, 224]
    assert cfg["output"][0]["name"] == "output__0"
    assert cfg["output"][0]["label_filename"] == "labels.txt"
    (group,) = cfg["instance_group"]
    assert group["kind"] == "KIND_GPU" and group["count"] == 2 and group["gpus"] == [0, 1]
    assert [int(s) for s in cfg["dynamic_batching"]["preferred_batch_size"]] == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("kind,binary", [("http", True), ("http", False), ("grpc", True), ("grpc", False)])
def test_ensemble_on_padded_uint8_batch_matches_predict(server, photos, predicted, kind, binary):
    mod, c = client(kind, server)
    batch = read_and_pad_images(photos)
    inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    if kind == "http":
        inp.set_data_from_numpy(batch, binary_data=binary)
        out = mod.InferRequestedOutput("output__0", binary_data=binary)
    else:
        # gRPC: raw_input_contents (binary) or typed `contents` (uint_contents).
        if binary:
            inp.set_data_from_numpy(batch)
        else:
            inp._get_tensor().contents.uint_contents[:] = batch.flatten().tolist()
        out = mod.InferRequestedOutput("output__0")
    result = c.infer("ensemble_model", [inp], outputs=[out], request_id="req-7")
    logits = result.as_numpy("output__0")
    assert logits.dtype == np.float32 and logits.shape == (len(photos), 1000)
    assert logits.argmax(axis=1).tolist() == predicted
    response = result.get_response(**({"as_json": True} if kind == "grpc" else {}))
    assert response["model_name"] == "ensemble_model" and response["id"] == "req-7"


@pytest.mark.parametrize("kind", BOTH)
def test_ensemble_takes_bytes_elements_too(server, photos, predicted, kind):
    mod, c = client(kind, server)
    data = np.array([open(p, "rb").read() for p in photos], dtype=np.object_)
    inp = mod.InferInput("RAW_IMAGE", [len(photos)], "BYTES")
    inp.set_data_from_numpy(data)
    result = c.infer("ensemble_model", [inp])
    assert result.as_numpy("output__0").argmax(axis=1).tolist() == predicted


@pytest.mark.parametrize("kind", BOTH)
def test_preprocessor_then_classifier_on_fp32_batch(server, photos, predicted, kind):
    mod, c = client(kind, server)
    batch = read_and_pad_images(photos)
    pre = c.infer("preprocessor", [raw_image_input(mod, batch)]).as_numpy("PREPROCESSED_IMAGE")
    assert pre.dtype == np.float32 and pre.shape == (len(photos), 3, 224, 224)
    # (pixel / 255 - 0.498) / 0.502 keeps values within about [-1, 1].
    assert -1.0 <= pre.min() < 0 < pre.max() <= 1.01

    fp32 = mod.InferInput("input__0", list(pre.shape), "FP32")
    fp32.set_data_from_numpy(pre)
    logits = c.infer("classifier", [fp32]).as_numpy("output__0")
    assert logits.argmax(axis=1).tolist() == predicted

    ensemble = c.infer("ensemble_model", [raw_image_input(mod, batch)]).as_numpy("output__0")
    np.testing.assert_allclose(logits, ensemble, atol=1e-3)


@pytest.mark.parametrize("kind", BOTH)
def test_classification_extension_returns_labels(server, photos, predicted, kind):
    mod, c = client(kind, server)
    out = mod.InferRequestedOutput("output__0", class_count=3)
    inp = raw_image_input(mod, read_and_pad_images(photos))
    classes = c.infer("ensemble_model", [inp], outputs=[out]).as_numpy("output__0")
    assert classes.shape == (len(photos), 3)
    labels = [line.strip() for line in open(server_labels(), encoding="utf-8")]
    for row, top1 in zip(classes, predicted):
        score, index, label = row[0].decode().split(":", 2)
        assert int(index) == top1
        assert label == labels[top1]
        float(score)
    chelsea = classes[0][0].decode()
    assert "cat" in chelsea, chelsea


@pytest.mark.parametrize("kind", BOTH)
def test_a_class_count_past_the_classes_gives_every_class(server, photos, predicted, kind):
    # A client's count is bounded by the model's classes (Triton's answer), not trusted.
    mod, c = client(kind, server)
    inp = raw_image_input(mod, read_and_pad_images(photos[:2]))
    out = mod.InferRequestedOutput("output__0", class_count=2**62)
    classes = c.infer("ensemble_model", [inp], outputs=[out]).as_numpy("output__0")
    labels = [line.strip() for line in open(server_labels(), encoding="utf-8")]
    assert classes.shape == (2, len(labels))
    assert [int(row[0].decode().split(":")[1]) for row in classes] == predicted[:2]
    # Every class once per row.
    assert all(len({e.decode().split(":")[1] for e in row}) == len(labels) for row in classes)


def server_labels():
    from conftest import ROOT

    return ROOT / "models" / "classifier" / "labels.txt"


@pytest.mark.parametrize("kind", BOTH)
def test_unknown_model_is_not_found(server, kind):
    mod, c = client(kind, server)
    inp = mod.InferInput("RAW_IMAGE", [1, 4], "UINT8")
    inp.set_data_from_numpy(np.zeros((1, 4), dtype=np.uint8))
    with pytest.raises(InferenceServerException) as e:
        c.infer("resnet50", [inp])
    assert status_of(e.value, kind) == ("404" if kind == "http" else "StatusCode.NOT_FOUND")
    assert "resnet50" in e.value.message()
    with pytest.raises(InferenceServerException):
        c.get_model_metadata("resnet50")


def status_of(error, kind):
    return str(error.status())


@pytest.mark.parametrize("kind", BOTH)
def test_wrong_shape_or_datatype_names_the_input(server, kind):
    mod, c = client(kind, server)
    bad_shape = mod.InferInput("input__0", [1, 3, 100, 100], "FP32")
    bad_shape.set_data_from_numpy(np.zeros((1, 3, 100, 100), dtype=np.float32))
    bad_type = mod.InferInput("input__0", [1, 3, 224, 224], "FP64")
    bad_type.set_data_from_numpy(np.zeros((1, 3, 224, 224), dtype=np.float64))
    wrong_name = mod.InferInput("pixels", [1, 3, 224, 224], "FP32")
    wrong_name.set_data_from_numpy(np.zeros((1, 3, 224, 224), dtype=np.float32))
    for inp, needle in [(bad_shape, "input__0"), (bad_type, "FP64"), (wrong_name, "pixels")]:
        with pytest.raises(InferenceServerException) as e:
            c.infer("classifier", [inp])
        expected = "400" if kind == "http" else "StatusCode.INVALID_ARGUMENT"
        assert status_of(e.value, kind) == expected, e.value
        assert needle in e.value.message(), e.value.message()


@pytest.mark.parametrize("kind", BOTH)
def test_undecodable_row_fails_the_request_naming_the_row(server, photos, kind):
    mod, c = client(kind, server)
    good = np.frombuffer(open(photos[0], "rb").read(), dtype=np.uint8)
    junk = np.frombuffer(b"this is not an image" * 10, dtype=np.uint8)
    inp = raw_image_input(mod, read_and_pad_images_arrays([good, junk]))
    with pytest.raises(InferenceServerException) as e:
        c.infer("ensemble_model", [inp])
    expected = "400" if kind == "http" else "StatusCode.INVALID_ARGUMENT"
    assert status_of(e.value, kind) == expected
    assert "row 1" in e.value.message() and "RAW_IMAGE" in e.value.message(), e.value.message()
    # The server goes on serving.
    ok = raw_image_input(mod, good.reshape(1, -1))
    assert c.infer("ensemble_model", [ok]).as_numpy("output__0").shape == (1, 1000)


@pytest.mark.parametrize("kind", BOTH)
def test_an_output_requested_twice_is_refused(server, photos, kind):
    """A 2 KB request must not buy a response 32 times larger: each output once (Triton)."""
    mod, c = client(kind, server)
    inp = raw_image_input(mod, read_and_pad_images([photos[0]]))
    outputs = [mod.InferRequestedOutput("output__0") for _ in range(32)]
    with pytest.raises(InferenceServerException) as e:
        c.infer("ensemble_model", [inp], outputs=outputs)
    expected = "400" if kind == "http" else "StatusCode.INVALID_ARGUMENT"
    assert status_of(e.value, kind) == expected
    assert "requested 32 times" in e.value.message(), e.value.message()


def read_and_pad_images_arrays(arrays):
    longest = max(len(a) for a in arrays)
    return np.stack([np.pad(a, (0, longest - len(a))) for a in arrays])


def test_statistics_and_repository_index_agree_over_both_transports(server, photos):
    _, h = client("http", server)
    _, g = client("grpc", server)
    h.infer("ensemble_model", [raw_image_input(httpclient, read_and_pad_images(photos[:1]))])
    http_stats = h.get_inference_statistics("classifier")["model_stats"][0]
    grpc_stats = g.get_inference_statistics("classifier", as_json=True)["model_stats"][0]
    assert http_stats["name"] == grpc_stats["name"] == "classifier"
    success = http_stats["inference_stats"]["success"]
    assert success["count"] >= 1 and success["ns"] > 0
    assert int(grpc_stats["inference_stats"]["success"]["count"]) == success["count"]
    assert int(grpc_stats["inference_count"]) == http_stats["inference_count"] > 0
    assert http_stats["execution_count"] > 0 and http_stats["last_inference"] > 0
    every = h.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} == {"classifier", "ensemble_model", "preprocessor"}

    index = h.get_model_repository_index()
    assert [(m["name"], m["state"]) for m in index] == [
        ("classifier", "READY"),
        ("ensemble_model", "READY"),
        ("preprocessor", "READY"),
    ]
    grpc_index = g.get_model_repository_index(as_json=True)["models"]
    assert [m["name"] for m in grpc_index] == [m["name"] for m in index]


def test_grpc_stream_infer_answers_each_request(server, photos, predicted):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    answers = []
    c.start_stream(callback=lambda result, error: answers.append((result, error)))
    for i, p in enumerate(photos[:2]):
        inp = raw_image_input(grpcclient, read_and_pad_images([p]))
        c.async_stream_infer("ensemble_model", [inp], request_id=str(i))
    c.stop_stream()
    assert len(answers) == 2
    for result, error in answers:
        assert error is None
        i = int(result.get_response().id)
        assert result.as_numpy("output__0").argmax() == predicted[i]


def test_grpc_log_settings_are_unimplemented_with_a_message(server):
    # Shared memory, system and CUDA, is served (test_shared_memory.py); trace settings too
    # (test_trace_settings.py).
    c = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        c.get_log_settings()
    assert str(e.value.status()) == "StatusCode.UNIMPLEMENTED"
    assert "RUST_LOG" in e.value.message(), e.value.message()


def test_http_raw_binary_body_is_the_single_input(server, photos, predicted):
    body = open(photos[0], "rb").read()
    r = requests.post(
        server.base + "/v2/models/ensemble_model/infer",
        data=body,
        headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "output__0" and out["shape"] == [1, 1000]
    assert int(np.argmax(out["data"])) == predicted[0]


def test_500_image_grpc_request_larger_than_4_mib(server, photos, predicted):
    paths = [photos[i % len(photos)] for i in range(500)]
    batch = read_and_pad_images(paths)
    assert batch.nbytes > 4 * 1024 * 1024
    c = grpcclient.InferenceServerClient(server.grpc_url)
    logits = c.infer("ensemble_model", [raw_image_input(grpcclient, batch)], client_timeout=600).as_numpy("output__0")
    assert logits.shape == (500, 1000)
    assert logits.argmax(axis=1).tolist() == [predicted[i % len(photos)] for i in range(500)]


ADMIN = {"x-admin-key": "interop-key"}


@pytest.fixture(scope="module")
def explicit_server():
    """A second server in explicit model-control mode, with load/unload behind a key."""
    from conftest import Server

    s = Server(
        "--model-control-mode", "explicit",
        "--load-model", "ensemble_model",
        "--repository-control-key", "x-admin-key=interop-key",
    )
    yield s
    s.stop()


def index_states(c, kind):
    index = c.get_model_repository_index(**({"as_json": True} if kind == "grpc" else {}))
    if kind == "grpc":
        index = index["models"]
    return {m["name"]: m.get("state", "") for m in index}


@pytest.mark.parametrize("kind", BOTH)
def test_load_and_unload_in_explicit_mode(explicit_server, photos, predicted, kind):
    mod, c = client(kind, explicit_server)
    assert index_states(c, kind) == {"classifier": "READY", "ensemble_model": "READY", "preprocessor": "READY"}

    # Closed without the key.
    with pytest.raises(InferenceServerException) as e:
        c.unload_model("ensemble_model")
    assert status_of(e.value, kind) == ("403" if kind == "http" else "StatusCode.PERMISSION_DENIED")
    assert "x-admin-key" in e.value.message()
    assert c.is_model_ready("ensemble_model")

    c.unload_model("ensemble_model", headers=ADMIN, unload_dependents=True)
    assert not c.is_model_ready("ensemble_model")
    assert not c.is_model_ready("classifier")
    assert index_states(c, kind) == {m: "UNAVAILABLE" for m in ["classifier", "ensemble_model", "preprocessor"]}
    inp = raw_image_input(mod, read_and_pad_images(photos))
    with pytest.raises(InferenceServerException) as e:
        c.infer("ensemble_model", [inp])
    assert status_of(e.value, kind) == ("404" if kind == "http" else "StatusCode.NOT_FOUND")

    c.load_model("ensemble_model", headers=ADMIN)
    assert c.is_model_ready("ensemble_model") and c.is_model_ready("classifier")
    logits = c.infer("ensemble_model", [inp]).as_numpy("output__0")
    assert logits.argmax(axis=1).tolist() == predicted

    # A config given with the load request replaces config.pbtxt (here: max_batch_size).
    cfg = c.get_model_config("classifier", **({"as_json": True} if kind == "grpc" else {}))
    cfg = cfg["config"] if kind == "grpc" else cfg
    cfg["max_batch_size"] = 16
    cfg["dynamic_batching"]["preferred_batch_size"] = [4]
    c.load_model("classifier", headers=ADMIN, config=json.dumps(cfg))
    now = c.get_model_config("classifier", **({"as_json": True} if kind == "grpc" else {}))
    now = now["config"] if kind == "grpc" else now
    assert int(now["max_batch_size"]) == 16
    assert c.infer("ensemble_model", [inp]).as_numpy("output__0").argmax(axis=1).tolist() == predicted

    with pytest.raises(InferenceServerException) as e:
        c.load_model("resnet50", headers=ADMIN)
    assert status_of(e.value, kind) == ("400" if kind == "http" else "StatusCode.INVALID_ARGUMENT")
    assert "resnet50" in e.value.message()
