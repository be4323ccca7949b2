"""Writes the seed corpora of the fuzz targets (fuzz/seeds/<target>/): small valid inputs
of each kind, from which libFuzzer mutates. Run with the project's venv (Pillow and
tritonclient's protobuf classes): `python fuzz/make_seeds.py`."""
import io
import json
import struct
from pathlib import Path

from PIL import Image
from tritonclient.grpc import service_pb2

root = Path(__file__).resolve().parent / "seeds"


def write(target, name, data):
    d = root / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def image(fmt, mode="RGB", size=(24, 16), **kw):
    img = Image.new(mode, size)
    for x in range(size[0]):
        for y in range(size[1]):
            img.putpixel((x, y), (x * 10 % 256, y * 15 % 256, 90)[: len(mode)] if mode != "L" else x * 10)
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


# Images: every accepted format, and the variants the decoder treats apart.
write("decode", "baseline.jpg", image("JPEG"))
write("decode", "progressive.jpg", image("JPEG", progressive=True))
write("decode", "grey.jpg", image("JPEG", mode="L"))
write("decode", "rgb.png", image("PNG"))
write("decode", "rgba.png", image("PNG", mode="RGBA"))
write("decode", "grey.png", image("PNG", mode="L"))
write("decode", "a.gif", image("GIF"))
write("decode", "lossy.webp", image("WEBP", quality=50))
write("decode", "lossless.webp", image("WEBP", lossless=True))
write("decode", "a.bmp", image("BMP"))

# /predict bodies (boundary "vg-boundary"); the first byte sets the piece size.
def form(*parts, preamble=b""):
    out = preamble
    for name, filename, content in parts:
        out += b"--vg-boundary\r\nContent-Disposition: form-data; name=\"%s\"" % name
        if filename:
            out += b"; filename=\"%s\"\r\nContent-Type: image/jpeg" % filename
        out += b"\r\n\r\n" + content + b"\r\n"
    return out + b"--vg-boundary--\r\n"

jpeg = image("JPEG", size=(4, 4))
write("multipart", "two_files", b"\x07" + form((b"files", b"a.jpg", jpeg), (b"files", b"b.jpg", b"x\r\n--vg")))
write("multipart", "field_and_file", b"\x01" + form((b"model", None, b"ensemble_model"), (b"files", b"c.jpg", jpeg)))
write("multipart", "preamble", b"\x3f" + form((b"files", b"d.jpg", b""), preamble=b"ignored\r\n"))

# config.pbtxt files: the bundled ones and a few Triton features.
for model in ("classifier", "ensemble_model", "preprocessor"):
    write("model_config", model + ".pbtxt", (Path(__file__).resolve().parents[1] / "models" / model / "config.pbtxt").read_bytes())
write("model_config", "queue.pbtxt", b"""name: "m" platform: "pytorch_libtorch" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 4, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100
  priority_levels: 2 default_priority_level: 1
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 1000 max_queue_size: 4 } }
instance_group [ { count: 2 kind: KIND_CPU } ]
version_policy: { latest { num_versions: 1 } }
""")

# KServe JSON requests.
def req(inputs, outputs=None, parameters=None):
    r = {"id": "1", "inputs": inputs}
    if outputs is not None:
        r["outputs"] = outputs
    if parameters is not None:
        r["parameters"] = parameters
    return json.dumps(r).encode()

write("kserve_json", "uint8_rows", req([{"name": "RAW_IMAGE", "shape": [2, 3], "datatype": "UINT8", "data": [[1, 2, 3], [4, 5, 0]]}]))
write("kserve_json", "bytes", req([{"name": "RAW_IMAGE", "shape": [2], "datatype": "BYTES", "data": ["ab", ""]}],
                                 [{"name": "OUT", "parameters": {"classification": 3}}], {"priority": 1, "timeout": 100}))
write("kserve_json", "fp32", req([{"name": "x", "shape": [1, 2, 2], "datatype": "FP32", "data": [1.5, -2, 3e3, 0]}],
                                [{"name": "y", "parameters": {"binary_data": True}}], {"binary_data_output": False}))
write("kserve_json", "types", req([{"name": t, "shape": [2], "datatype": t, "data": v} for t, v in
                                   [("BOOL", [True, False]), ("INT8", [-1, 1]), ("UINT64", [0, 18446744073709551615]), ("FP64", [0.25, 1])]]))

# Binary tensor extension: 2-byte header length, JSON header, then the data.
def binary(header, data):
    h = json.dumps(header).encode()
    return struct.pack("<H", len(h)) + h + data

write("binary_tensors", "uint8", binary({"inputs": [{"name": "RAW_IMAGE", "shape": [1, 4], "datatype": "UINT8", "parameters": {"binary_data_size": 4}}]}, b"\xff\xd8\x00\x00"))
write("binary_tensors", "bytes_and_json", binary({"inputs": [
    {"name": "a", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 9}},
    {"name": "b", "shape": [1], "datatype": "INT32", "data": [7]}],
    "outputs": [{"name": "o", "parameters": {"binary_data": True}}]},
    struct.pack("<I", 1) + b"x" + struct.pack("<I", 0)))

# Raw BYTES data.
def elements(*es):
    return b"".join(struct.pack("<I", len(e)) + e for e in es)

write("bytes_elements", "three", elements(b"ab", b"", b"xyz"))
write("bytes_elements", "image", elements(jpeg))
write("bytes_elements", "empty", b"")

# gRPC ModelInferRequest messages.
def grpc_request(**kw):
    r = service_pb2.ModelInferRequest(model_name="ensemble_model", id="7")
    inp = r.inputs.add(name="RAW_IMAGE", datatype=kw.get("datatype", "UINT8"), shape=kw["shape"])
    if "raw" in kw:
        r.raw_input_contents.append(kw["raw"])
    if "contents" in kw:
        getattr(inp.contents, kw["contents"][0]).extend(kw["contents"][1])
    out = r.outputs.add(name="OUTPUT")
    out.parameters["classification"].int64_param = 3
    r.parameters["priority"].int64_param = 1
    return r.SerializeToString()

write("grpc_infer", "raw", grpc_request(shape=[1, len(jpeg)], raw=jpeg))
write("grpc_infer", "bytes_contents", grpc_request(datatype="BYTES", shape=[2], contents=("bytes_contents", [jpeg, b""])))
write("grpc_infer", "uint_contents", grpc_request(shape=[1, 4], contents=("uint_contents", [255, 216, 0, 1])))
write("grpc_infer", "fp32_contents", grpc_request(datatype="FP32", shape=[2], contents=("fp32_contents", [0.5, -1])))
