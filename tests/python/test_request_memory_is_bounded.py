"""No inference request of B bytes raises the server's resident memory by more than about
4 x B + 64 MiB, decoded pixels aside: JSON tensors are parsed straight into raw bytes (no
tree of JSON values), rows are cut from the request's data as they are used, a request of
more rows than --max-files is refused from its shape, and a gRPC message whose decoded form
would be out of proportion to its size (empty `bytes_contents` elements) is refused before
it is decoded. Each case is measured alone on the real binary, by the peak resident memory
(VmHWM, reset before each) over the resident memory just before it; the server still
answers afterwards.

The classifier runs one row at a time here: the forward pass's own memory grows with the
batch size (libtorch on a CPU, two instances: a batch of 1 keeps the 200-row request's rise
near 80 MiB, a pinned batch of 32 took it to about 1.5 GiB), and the size measured at
warm-up varies with the machine's load, which is not what this test is about."""

import io
import json
import shutil

import grpc
import numpy as np
import requests
from PIL import Image
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import ROOT, Server, link_file
from test_decode_memory_is_bounded import status

MARGIN = 64 << 20


def peak_rise(server, send):
    """`send()`'s answer and the peak resident memory over the memory before it."""
    with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
        f.write("5")
    before = status(server.proc.pid, "VmRSS")
    answer = send()
    return answer, status(server.proc.pid, "VmHWM") - before


def check(server, name, body_len, send):
    answer, rise = peak_rise(server, send)
    print(f"\n{name}: {body_len / 2**20:.1f} MiB request, peak resident memory rose "
          f"{rise / 2**20:.0f} MiB (bound 4 x B + 64 MiB = {(4 * body_len + MARGIN) / 2**20:.0f} MiB)")
    assert rise <= 4 * body_len + MARGIN, f"{name}: rose {rise >> 20} MiB"
    return answer


def jpeg(side=64):
    img = Image.new("RGB", (side, side))
    img.putdata([(x * 4 % 256, y * 4 % 256, 128) for y in range(side) for x in range(side)])
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90)
    return out.getvalue()


def one_row_batches(tmp_path):
    """The bundled repository with the classifier's batch size pinned at 1 (model file linked)."""
    repo = tmp_path / "models"
    shutil.copytree(ROOT / "models", repo, ignore=shutil.ignore_patterns("model.*"))
    link_file(ROOT / "models" / "classifier" / "1" / "model.pt", repo / "classifier" / "1" / "model.pt")
    config = repo / "classifier" / "config.pbtxt"
    text = config.read_text()
    assert "preferred_batch_size: [ 1, 2, 4, 8, 16, 32 ]" in text
    config.write_text(text.replace("preferred_batch_size: [ 1, 2, 4, 8, 16, 32 ]", "preferred_batch_size: [ 1 ]"))
    return repo


def test_requests_take_memory_in_proportion_to_their_size(tmp_path):
    server = Server("--model-repository", str(one_row_batches(tmp_path)), repository=False)
    try:
        infer = lambda model: f"{server.base}/v2/models/{model}/infer"
        image = jpeg()
        # Warm: the model, the threads and the allocator's arenas.
        warm = {"inputs": [{"name": "RAW_IMAGE", "shape": [1, len(image)], "datatype": "UINT8",
                            "data": list(image)}]}
        for _ in range(3):
            assert requests.post(infer("ensemble_model"), json=warm, timeout=60).status_code == 200

        # 1. JSON UINT8 [200, 60000]: real images zero-padded, as the FastAPI gateway sends
        #    them; ~24 MB of JSON, answered with a label per row.
        rows, width = 200, 60000
        row = list(image) + [0] * (width - len(image))
        body = json.dumps({
            "inputs": [{"name": "RAW_IMAGE", "shape": [rows, width], "datatype": "UINT8",
                        "data": [row] * rows}],
            "outputs": [{"name": "output__0", "parameters": {"classification": 1}}],
        }, separators=(",", ":")).encode()
        r = check(server, "JSON UINT8 rows", len(body), lambda: requests.post(
            infer("ensemble_model"), data=body, headers={"Content-Type": "application/json"}, timeout=300))
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        # "score:index:label": the same image, the same class in every row.
        assert out["shape"] == [rows, 1], out["shape"]
        assert len({d.split(":", 1)[1] for d in out["data"]}) == 1, out["data"][:3]

        # 2. JSON FP32 [16, 3, 224, 224] to the classifier: 2.4 M numbers.
        floats = np.round(np.random.default_rng(1).random((16, 3, 224, 224)), 3)
        body = json.dumps({"inputs": [{"name": "input__0", "shape": list(floats.shape), "datatype": "FP32",
                                       "data": floats.ravel().tolist()}]}).encode()
        r = check(server, "JSON FP32 tensor", len(body), lambda: requests.post(
            infer("classifier"), data=body, headers={"Content-Type": "application/json"}, timeout=300))
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["shape"] == [16, 1000]

        # 3. Binary UINT8 [N, 1]: 24 M one-byte rows, refused from the shape.
        n = 24 << 20
        header = json.dumps({"inputs": [{"name": "RAW_IMAGE", "shape": [n, 1], "datatype": "UINT8",
                                         "parameters": {"binary_data_size": n}}]}).encode()
        body = header + b"\xff" * n
        r = check(server, "binary UINT8 [N, 1]", len(body), lambda: requests.post(
            infer("ensemble_model"), data=body, timeout=300,
            headers={"Inference-Header-Content-Length": str(len(header))}))
        assert r.status_code == 400 and "at most 1000" in r.json()["error"], r.text

        # 4. JSON BYTES of 8 M empty strings.
        n = 8 << 20
        body = b'{"inputs":[{"name":"RAW_IMAGE","shape":[%d],"datatype":"BYTES","data":[' % n
        body += b",".join([b'""'] * n) + b"]}]}"
        r = check(server, "JSON empty BYTES", len(body), lambda: requests.post(
            infer("ensemble_model"), data=body, headers={"Content-Type": "application/json"}, timeout=300))
        assert r.status_code == 400 and "at most 1000" in r.json()["error"], r.text

        # 5. gRPC: 12 M empty bytes_contents elements (24 MB on the wire).
        request = service_pb2.ModelInferRequest(model_name="ensemble_model")
        n = 12 << 20
        inp = request.inputs.add(name="RAW_IMAGE", datatype="BYTES", shape=[n])
        inp.contents.bytes_contents.extend([b""] * n)
        wire = request.SerializeToString()
        del request, inp
        channel = grpc.insecure_channel(server.grpc_url, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda b: b,
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)

        def send():
            try:
                call(wire, timeout=300)
            except grpc.RpcError as e:
                return e
            raise AssertionError("accepted")
        e = check(server, "gRPC empty bytes_contents", len(wire), send)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "raw_input_contents" in e.details(), e.details()

        # Still serving, over both transports.
        assert requests.post(infer("ensemble_model"), json=warm, timeout=60).status_code == 200
        request = service_pb2.ModelInferRequest(model_name="ensemble_model")
        request.inputs.add(name="RAW_IMAGE", datatype="UINT8", shape=[1, len(image)])
        request.raw_input_contents.append(image)
        assert stub.ModelInfer(request, timeout=60).model_name == "ensemble_model"
        channel.close()
    finally:
        server.stop()
