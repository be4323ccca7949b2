"""KServe's own Python SDK (`kserve` from PyPI, its v2 REST client) against visiongate:
liveness and readiness read from KServe's JSON bodies, a model's readiness, and an
inference on the ensemble whose labels match /predict's.

The SDK runs in a process of its own: it registers the same `inference.*` protobuf
messages as tritonclient, and the two cannot be imported into one process."""

import json
import subprocess
import sys

import requests

SDK = r"""
import asyncio, json, sys
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

base, photos = sys.argv[1], sys.argv[2:]

async def main():
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=120))
    try:
        data = [open(p, "rb").read() for p in photos]
        image = InferInput("RAW_IMAGE", [len(data)], "BYTES")
        image.set_data_from_numpy(np.array(data, dtype=object))
        response = await client.infer(
            base, InferRequest("ensemble_model", infer_inputs=[image]), model_name="ensemble_model"
        )
        logits = response.outputs[0].as_numpy()
        return {
            "live": await client.is_server_live(base),
            "ready": await client.is_server_ready(base),
            "model_ready": await client.is_model_ready(base, "ensemble_model"),
            "unknown_model_ready": await client.is_model_ready(base, "no_such_model"),
            "shape": list(logits.shape),
            "top1": [int(i) for i in logits.argmax(axis=1)],
        }
    finally:
        await client.close()

print(json.dumps(asyncio.run(main())))
"""


def test_kserve_sdk_health_and_inference(server, all_photos):
    photos = [p for p in all_photos if p.name in ("sk_chelsea.jpg", "sk_coffee.jpg")]
    files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in photos]
    results = requests.post(server.base + "/predict", files=files, timeout=120).json()["results"]
    run = subprocess.run(
        [sys.executable, "-c", SDK, server.base, *map(str, photos)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {
        "live": True,
        "ready": True,
        "model_ready": True,
        "unknown_model_ready": False,
        "shape": [len(photos), 1000],
        "top1": [r["class_id"] for r in results],
    }
