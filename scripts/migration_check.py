"""Proves a migration from FastAPI + Triton on your own photos: runs your Triton Python
preprocessor's own code (its `preprocess(row)` function: one zero-padded row of encoded
bytes in, FP32 [3, H, W] out) and your TorchScript classifier in this process, asks a
running visiongate the same photos (`/predict`), and compares, photo by photo.

    python scripts/migration_check.py --preprocessor OLD/models/preprocessor/1/model.py \\
        --model NEW/models/resnet_classifier/1/model.pt --url http://localhost:8000 \\
        --ensemble image_ensemble PHOTO_DIR

Reports top-1 agreement, near ties (the reference's two best classes within 0.02, where
tiny pixel differences may swap them) and the largest probability difference; exits 1
when agreement, near ties excused, is below --min-agreement (default 0.95)."""

import argparse
import importlib.util
import json
import sys
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import torch

NEAR_TIE = 0.02


def load_preprocess(path):
    """The `preprocess` function of a Triton Python model file (the Triton-only imports sit
    inside `execute`, as in the example, so the module imports outside Triton)."""
    spec = importlib.util.spec_from_file_location("old_preprocessor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "preprocess"):
        sys.exit(f"{path}: no preprocess(row) function; factor your execute() so one exists")
    return module.preprocess


def reference(preprocess, model, blobs):
    """Softmax probabilities [N, classes] as the old stack computes them."""
    width = max(len(b) for b in blobs)
    rows = np.zeros((len(blobs), width), dtype=np.uint8)
    for i, b in enumerate(blobs):
        rows[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    x = torch.from_numpy(np.stack([preprocess(r) for r in rows]))
    with torch.no_grad():
        return torch.softmax(model(x), dim=1).numpy()


def visiongate(url, ensemble, names, blobs, classes):
    """Probabilities of every class per photo from visiongate's /predict."""
    boundary = uuid.uuid4().hex
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{n}"\r\n\r\n'.encode()
        + b + b"\r\n"
        for n, b in zip(names, blobs)
    ) + f"--{boundary}--\r\n".encode()
    req = urllib.request.Request(f"{url}/predict?model={ensemble}&top_k={classes}", data=body,
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        results = json.load(r)["results"]
    probs = np.zeros((len(names), classes), dtype=np.float32)
    for i, r in enumerate(results):
        if "error" in r:
            sys.exit(f"{names[i]}: visiongate answered {r['error']}")
        for c in r["top_k"]:
            probs[i, c["class_id"]] = c["score"]
    return probs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preprocessor", required=True, type=Path, help="the old Python model.py")
    p.add_argument("--model", required=True, type=Path, help="the TorchScript classifier")
    p.add_argument("--url", default="http://localhost:8000", help="visiongate's HTTP address")
    p.add_argument("--ensemble", default="ensemble_model", help="the ensemble's name")
    p.add_argument("--min-agreement", type=float, default=0.95)
    p.add_argument("photos", type=Path, help="a folder of photos (searched recursively)")
    args = p.parse_args()
    paths = sorted(f for f in args.photos.rglob("*") if f.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if not paths:
        sys.exit(f"no photos under {args.photos}")
    names = [str(f.relative_to(args.photos)) for f in paths]
    blobs = [f.read_bytes() for f in paths]
    torch.set_num_threads(2)
    model = torch.jit.load(str(args.model), map_location="cpu").eval()
    preprocess = load_preprocess(args.preprocessor)
    ref = np.concatenate([reference(preprocess, model, blobs[i:i + 16]) for i in range(0, len(blobs), 16)])
    got = visiongate(args.url, args.ensemble, names, blobs, ref.shape[1])
    top2 = np.sort(ref, axis=1)[:, -2:]
    tie = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
    same = ref.argmax(axis=1) == got.argmax(axis=1)
    excused = same | tie
    for n, s, t, r, g in zip(names, same, tie, ref, got):
        if not s:
            print(f"differs: {n}: old top-1 {r.argmax()} ({r.max():.3f}), visiongate {g.argmax()} "
                  f"({g.max():.3f}){' (near tie)' if t else ''}")
    agreement = excused.mean()
    print(f"{len(names)} photos: top-1 agrees on {same.sum()}, near ties {tie.sum()} "
          f"({(~same & tie).sum()} of them differ), agreement with near ties excused {agreement:.1%}, "
          f"largest probability difference {np.abs(ref - got).max():.3f}")
    if agreement < args.min_agreement:
        sys.exit(f"agreement {agreement:.1%} is below {args.min_agreement:.0%}")


if __name__ == "__main__":
    main()
