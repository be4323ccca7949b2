"""The FastAPI gateway of the two-container stack (before visiongate): reads the uploaded
images, pads their bytes into one UINT8 [N, L] array and calls Triton's ensemble over
gRPC. Kept here as the migration guide's starting point
(docs/migrating-from-fastapi-triton.md)."""

import os
from typing import List

import numpy as np
import tritonclient.grpc as grpcclient
from fastapi import FastAPI, File, UploadFile

TRITON_URL = os.environ.get("TRITON_URL", "triton:8001")
MODEL = "image_ensemble"

app = FastAPI()
client = grpcclient.InferenceServerClient(TRITON_URL)
labels = [line.strip() for line in open(os.environ.get("LABELS", "/models/resnet_classifier/labels.txt"))]


def pad(blobs: List[bytes]) -> np.ndarray:
    """Each image's bytes in one row, zero-padded to the longest."""
    batch = np.zeros((len(blobs), max(len(b) for b in blobs)), dtype=np.uint8)
    for i, b in enumerate(blobs):
        batch[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    return batch


@app.post("/predict")
async def predict(files: List[UploadFile] = File(...)):
    blobs = [await f.read() for f in files]
    batch = pad(blobs)
    images = grpcclient.InferInput("IMAGE_BYTES", list(batch.shape), "UINT8")
    images.set_data_from_numpy(batch)
    result = client.infer(MODEL, [images], outputs=[grpcclient.InferRequestedOutput("LOGITS")])
    logits = result.as_numpy("LOGITS")
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return {
        "results": [
            {"filename": f.filename, "label": labels[int(p.argmax())], "score": float(p.max())}
            for f, p in zip(files, probs)
        ]
    }
