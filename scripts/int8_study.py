"""Whether an INT8 version of the bundled classifier keeps its accuracy (issues 27 and 43),
in the two runtimes that run one: static QDQ quantization of the ONNX export by ONNX Runtime's
tools (per-channel INT8 weights, UINT8 activations), and post-training quantization of the
OpenVINO IR the set-up exports (model.xml) by NNCF (Triton's `openvino` backend serves the
quantized IR as it is). Each is calibrated on photos apart from the 283 evaluation photos,
evaluated on those 283 against the FP32 ONNX model (top-1 agreement, near-ties excused:
FP32's top two within 0.02) and timed at batch 1 and 8 on one thread, beside its runtime's
FP32 (and OpenVINO's bf16 where the CPU has AVX-512 BF16 or AMX). visiongate offers INT8
only if a variant agrees on at least 99%.

The OpenVINO variants need NNCF, which serving does not: `pip install -r
scripts/requirements-int8.txt` into the set-up's venv.

Calibration photos: Debian's `lomiri-wallpapers-16.04`, `lomiri-wallpapers-20.04` (authors
and licences, CC-BY / CC-BY-SA / CC0, in their copyright files) and `palapeli-data`'s puzzle
collection (public domain or GFDL, in each .desktop file), fetched by `apt-get download`
unless --photos names a directory; each photo gives 12 views (whole, mirrored, 10 crops).
No package the evaluation photos come from is among them (tests/fixtures/photos/SOURCES.md).

    python scripts/int8_study.py [--photos DIR] [--variants minmax_keep_first_last ...]

Writes test-artifacts/int8-study.json.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["lomiri-wallpapers-16.04=20.04.0-2", "lomiri-wallpapers-20.04=20.04.0-2", "palapeli-data=4:22.12.3-1"]
NEAR_TIE = 0.02
VARIANTS = ("openvino_nncf", "openvino_nncf_mixed_keep_first_last", "minmax", "minmax_keep_first_last",
            "percentile_keep_first_last", "entropy_keep_first_last", "percentile_keep_first_last_depthwise")


def calibration_photos(directory):
    if directory:
        return sorted(glob.glob(os.path.join(directory, "**", "*.jpg"), recursive=True))
    tmp = tempfile.mkdtemp(prefix="int8-calibration-")
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, check=True)
    for deb in glob.glob(os.path.join(tmp, "*.deb")):
        subprocess.run(["dpkg", "-x", deb, os.path.join(tmp, "x")], check=True)
    found = glob.glob(os.path.join(tmp, "x", "usr", "share", "backgrounds", "*.jpg"))
    found += glob.glob(os.path.join(tmp, "x", "usr", "share", "palapeli", "collection", "*.jpg"))
    return sorted(found)


def views(im, ImageOps):
    w, h = im.size
    out = [im, ImageOps.mirror(im)]
    for f in (0.5, 0.7):
        cw, ch = int(w * f), int(h * f)
        for x, y in ((0, 0), (w - cw, 0), (0, h - ch), (w - cw, h - ch), ((w - cw) // 2, (h - ch) // 2)):
            out.append(im.crop((x, y, x + cw, y + ch)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--photos", help="calibration photos (*.jpg under it); else the Debian packages above")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, help="the variants to run (default: all)")
    args = ap.parse_args()

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                          QuantType, quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process
    from PIL import Image, ImageOps

    sys.path.insert(0, str(ROOT / "scripts"))
    import reference

    repo = str(ROOT / "models")
    fp32 = os.path.join(repo, "classifier", "1", "model.onnx")
    ir = os.path.join(repo, "classifier", "1", "model.xml")
    tf, _ = reference.load(repo)  # the reference pipeline's resize and normalization

    def tensor(im):
        return tf(ImageOps.exif_transpose(im).convert("RGB")).unsqueeze(0).numpy()

    cal = []
    photos = calibration_photos(args.photos)
    if not photos:
        sys.exit(f"int8: no calibration photos (*.jpg) in {args.photos or 'the packages above'}")
    for p in photos:
        with Image.open(p) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
            im.thumbnail((1024, 1024))
            cal += [tensor(v) for v in views(im, ImageOps)]
    photos_dir = ROOT / "tests" / "fixtures" / "photos"
    evaluation = sorted(photos_dir.glob("*/*.jpg")) + sorted((photos_dir / "registry").glob("*.webp"))
    X = np.concatenate([tensor(Image.open(p)) for p in evaluation])
    print(f"int8: {len(photos)} calibration photos ({len(cal)} views), {len(X)} evaluation photos")

    # A variant is run through one function, a batch of X in, its logits out.
    def onnx_runner(path):
        o = ort.SessionOptions()
        o.intra_op_num_threads = 1
        s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
        return lambda x: s.run(None, {"input__0": x})[0]

    def openvino_runner(compiled):
        # A request that copies its inputs: a compiled model called directly shares the
        # caller's array, and a later request of the same model then wrote its input into
        # those rows of X (OpenVINO 2026.4's CPU plugin).
        request = compiled.create_infer_request()
        return lambda x: request.infer(x, share_inputs=False)[0]

    def probabilities(run):
        z = np.concatenate([run(X[i:i + 16]) for i in range(0, len(X), 16)])
        e = np.exp(z - z.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    def timed(run):
        out = {}
        for b in (1, 8):
            run(X[:b])
            t, n = time.time(), 0
            while time.time() - t < 3:
                run(X[:b])
                n += 1
            out[b] = round((time.time() - t) / n / b * 1000, 2)
        return out

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(cal)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"input__0": x}

    work = tempfile.mkdtemp(prefix="int8-study-")
    pre = os.path.join(work, "pre.onnx")
    quant_pre_process(fp32, pre)
    graph = onnx.load(pre).graph
    convs = [n.name for n in graph.node if n.op_type == "Conv"]
    first_last = [convs[0]] + [n.name for n in graph.node if n.op_type in ("Gemm", "MatMul")]
    depthwise = [n.name for n in graph.node if n.op_type == "Conv"
                 and any(a.name == "group" and a.i > 1 for a in n.attribute)]
    variants = {
        "openvino_nncf": None,
        "openvino_nncf_mixed_keep_first_last": None,
        "minmax": (CalibrationMethod.MinMax, []),
        "minmax_keep_first_last": (CalibrationMethod.MinMax, first_last),
        "percentile_keep_first_last": (CalibrationMethod.Percentile, first_last),
        "entropy_keep_first_last": (CalibrationMethod.Entropy, first_last),
        "percentile_keep_first_last_depthwise": (CalibrationMethod.Percentile, first_last + depthwise),
    }
    assert tuple(variants) == VARIANTS
    reference = onnx_runner(fp32)
    reference_probs = probabilities(reference)

    def openvino_compiled(model, precision):
        import openvino as ov

        return ov.Core().compile_model(model, "CPU", {
            "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": "1",
            "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": "NO"})

    def openvino_int8(name):
        """NNCF's quantization of the set-up's IR, run by OpenVINO in FP32 around its INT8
        operations (INT8 is the IR's, not a precision hint's)."""
        import nncf
        import openvino as ov

        model = ov.Core().read_model(ir)
        data = nncf.Dataset(cal)
        if name == "openvino_nncf":
            q = nncf.quantize(model, data, subset_size=len(cal))
        else:
            first = next(op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() == "Convolution")
            q = nncf.quantize(model, data, subset_size=len(cal), preset=nncf.QuantizationPreset.MIXED,
                              ignored_scope=nncf.IgnoredScope(names=[first], types=["MatMul"]))
        # Saved and read back as the server reads it (weights kept in FP32, as the set-up
        # exports model.xml).
        path = os.path.join(work, name + ".xml")
        ov.save_model(q, path, compress_to_fp16=False)
        return openvino_compiled(path, "f32")

    top2 = np.sort(reference_probs, 1)[:, -2:]
    tie = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = cpuinfo.split()
    cpu = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith("model name")), "unknown")
    cpu_flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    print(f"int8: CPU {cpu}, flags {' '.join(cpu_flags)}")
    report = {"cpu": cpu, "cpu_flags": cpu_flags, "calibration_photos": len(photos), "calibration_views": len(cal),
              "evaluation_photos": len(X), "near_ties": int(tie.sum()), "fp32_ms_per_image": timed(reference),
              "variants": {}}
    if any(v.startswith("openvino") for v in args.variants or variants):
        precisions = ["f32"] + (["bf16"] if "avx512_bf16" in flags or "amx_bf16" in flags else [])
        report["openvino_ms_per_image"] = {
            p: timed(openvino_runner(openvino_compiled(ir, p))) for p in precisions}
    print(f"int8: ms per image at batch 1 and 8: ONNX Runtime FP32 {report['fp32_ms_per_image']}"
          + (f", OpenVINO {report['openvino_ms_per_image']}" if "openvino_ms_per_image" in report else ""), flush=True)
    for name in args.variants or variants:
        if name.startswith("openvino"):
            run = openvino_runner(openvino_int8(name))
        else:
            method, keep = variants[name]
            out = os.path.join(work, name + ".onnx")
            quantize_static(pre, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=method, nodes_to_exclude=keep)
            run = onnx_runner(out)
        probs = probabilities(run)
        agree = probs.argmax(1) == reference_probs.argmax(1)
        firm = agree[~tie]
        report["variants"][name] = {
            "top1_agreement": f"{agree.sum()}/{len(agree)}",
            "top1_agreement_near_ties_excused": f"{firm.sum()}/{len(firm)} ({100 * firm.mean():.1f}%)",
            "max_top1_probability_difference": round(float(np.abs(probs.max(1) - reference_probs.max(1)).max()), 3),
            "ms_per_image": timed(run),
        }
        print(f"int8: {name}: {json.dumps(report['variants'][name])}", flush=True)
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    (ROOT / "test-artifacts" / "int8-study.json").write_text(json.dumps(report, indent=2))
    best = max(float(v["top1_agreement_near_ties_excused"].split("(")[1].rstrip("%)")) for v in report["variants"].values())
    print(f"int8: best agreement {best:.1f}% (visiongate offers INT8 at 99% or more)")


if __name__ == "__main__":
    main()
