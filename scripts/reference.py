"""Python reference classifier: what the FastAPI + Triton pipeline computes.

PIL decode + EXIF transpose + RGB, torchvision Resize((224, 224)) (antialiased bilinear),
ToTensor, Normalize(mean, std), the same TorchScript model.pt, softmax. Tests compare
visiongate's /predict with it.

    python scripts/reference.py [--model-repository models] [--top-k 5] FILE...

prints one JSON object per file: {"filename", "class_id", "score", "top_k": [[id, p], ...]}
"""

import argparse
import json
import os
import sys


def load(repo):
    import torch
    from torchvision import transforms

    torch.set_num_threads(1)
    params = parse_preprocessor_params(os.path.join(repo, "preprocessor", "config.pbtxt"))
    size = (int(params.get("height", 224)), int(params.get("width", 224)))
    mean = [float(x) for x in params["mean"].split(",")]
    std = [float(x) for x in params["std"].split(",")]
    tf = transforms.Compose(
        [
            transforms.Resize(size),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )
    model = torch.jit.load(os.path.join(repo, "classifier", "1", "model.pt"), map_location="cpu")
    model.eval()
    return tf, model


def parse_preprocessor_params(path):
    """The `parameters { key: .. value: { string_value: .. } }` entries of the preprocessor's
    config.pbtxt (the server parses the whole file with a protobuf text-format parser; the
    reference only needs these string pairs)."""
    import re

    text = open(path).read()
    pat = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')
    return dict(pat.findall(text))


def classify(paths, repo, top_k=5):
    import torch
    from PIL import Image, ImageOps

    tf, model = load(repo)
    out = []
    for p in paths:
        with Image.open(p) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
            x = tf(im).unsqueeze(0)
        with torch.no_grad():
            probs = torch.softmax(model(x), dim=-1)[0]
        vals, idx = probs.topk(top_k)
        out.append(
            {
                "filename": os.path.basename(p),
                "class_id": int(idx[0]),
                "score": float(vals[0]),
                "top_k": [[int(i), float(v)] for v, i in zip(vals, idx)],
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", default=os.path.join(os.path.dirname(__file__), "..", "models"))
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for r in classify(args.files, args.model_repository, args.top_k):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
