"""What the container test (scripts/container-test.sh) asks of the running stack, as its
users would: /predict classifies the photos (and names a broken file), tritonclient gRPC
on the FastAPI gateway's padded UINT8 ensemble input agrees with it, and /metrics counts
both requests. Standard library plus tritonclient[grpc] and numpy only."""

import argparse
import json
import re
import sys
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

# The bundled model on scikit-image's sample photos (see tests/fixtures/photos/SOURCES.md).
EXPECTED = {"sk_chelsea.jpg": {"Egyptian cat", "tiger cat", "tabby"}, "sk_coffee.jpg": {"espresso"}}


def multipart(files):
    boundary = uuid.uuid4().hex
    body = b""
    for name, data in files:
        body += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode() + data + b"\r\n"
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def check(condition, message):
    if not condition:
        print(f"check_stack: FAILED: {message}", file=sys.stderr)
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True)
    ap.add_argument("--grpc", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--photos", type=Path, required=True)
    args = ap.parse_args()

    with urllib.request.urlopen(f"http://{args.http}/v2/health/ready", timeout=10) as r:
        check(r.status == 200, f"ready answered {r.status}")

    photos = sorted(args.photos.glob("*.jpg"))
    check(len(photos) >= 2, f"no photos in {args.photos}")
    files = [(p.name, p.read_bytes()) for p in photos] + [("notes.txt", b"not an image\n")]
    body, ctype = multipart(files)
    req = urllib.request.Request(
        f"http://{args.http}/predict?top_k=3", data=body, headers={"Content-Type": ctype}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    results = answer["results"]
    check([x["filename"] for x in results] == [n for n, _ in files], "results not in upload order")
    for x in results[:-1]:
        check("label" in x and len(x["top_k"]) == 3, f"{x['filename']}: {x}")
    labels = {x["filename"]: x["label"] for x in results[:-1]}
    for name, allowed in EXPECTED.items():
        check(labels.get(name) in allowed, f"{name} classified as {labels.get(name)!r}, expected one of {allowed}")
    check(results[-1].get("error", {}).get("code") == "invalid_image", f"broken file: {results[-1]}")
    print(f"check_stack: /predict: {len(photos)} photos classified "
          f"(sk_chelsea.jpg: {labels['sk_chelsea.jpg']}, sk_coffee.jpg: {labels['sk_coffee.jpg']}), "
          "the broken file got invalid_image")

    # The FastAPI gateway's call: encoded bytes zero-padded into UINT8 [N, L].
    longest = max(len(d) for _, d in files[:-1])
    batch = np.zeros((len(photos), longest), dtype=np.uint8)
    for i, (_, data) in enumerate(files[:-1]):
        batch[i, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    client = grpcclient.InferenceServerClient(args.grpc)
    check(client.is_server_ready() and client.is_model_ready("ensemble_model"), "gRPC: not ready")
    inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_data_from_numpy(batch)
    logits = client.infer("ensemble_model", [inp], client_timeout=300).as_numpy("output__0")
    check(logits.shape == (len(photos), 1000), f"gRPC output shape {logits.shape}")
    grpc_top1 = logits.argmax(axis=1).tolist()
    predict_top1 = [x["class_id"] for x in results[:-1]]
    check(grpc_top1 == predict_top1, f"gRPC top-1 {grpc_top1} != /predict top-1 {predict_top1}")
    print(f"check_stack: tritonclient gRPC: {len(photos)} padded UINT8 rows, top-1 equal to /predict's")

    with urllib.request.urlopen(f"http://{args.metrics}/metrics", timeout=10) as r:
        metrics = r.read().decode()

    def value(name, model):
        m = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', metrics, re.M)
        check(m, f"/metrics has no {name} for {model}")
        return float(m.group(1))

    # Both requests reach the classifier (the ensemble has no series of its own yet).
    success = value("nv_inference_request_success", "classifier")
    count = value("nv_inference_count", "classifier")
    check(success >= 2, f"nv_inference_request_success for the classifier is {success}, expected >= 2")
    check(count >= 2 * len(photos), f"nv_inference_count for the classifier is {count}, expected >= {2 * len(photos)}")
    print(f"check_stack: /metrics: classifier requests {success:.0f}, inferences {count:.0f}")


if __name__ == "__main__":
    main()
