"""Each export of the bundled classifier the set-up writes (ONNX, OpenVINO IR, the
torch.export package) against the Python reference pipeline (PIL + torchvision + the TorchScript model) on the
283 photos: top-1 with near-ties excused at least 99%, and within 1e-3 of this server's
TorchScript scores for the same pixels. Each server is the bundled pipeline with the one
config line a user changes (the classifier's platform, or backend for OpenVINO). Reports land in test-artifacts/."""

import json
import shutil

import pytest
import requests

import reference
from conftest import PHOTOS, ROOT, Server, link_file

NEAR_TIE = 0.02
PATHS = sorted(PHOTOS.glob("*/*.jpg")) + sorted((PHOTOS / "registry").glob("*.webp"))
KINDS = {".jpg": "image/jpeg", ".webp": "image/webp"}


def predict(server):
    files = [("files", (p.name, p.read_bytes(), KINDS[p.suffix])) for p in PATHS]
    r = requests.post(server.base + "/predict?top_k=2", files=files, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()["results"]


@pytest.fixture(scope="module")
def baseline(server):
    """The TorchScript server's answers and the Python reference's, computed once."""
    assert len(PATHS) >= 280
    return predict(server), reference.classify([str(p) for p in PATHS], str(ROOT / "models"))


@pytest.mark.parametrize("platform, files, tag, line", [
    ("onnxruntime_onnx", ["model.onnx"], "onnx", 'platform: "onnxruntime_onnx"'),
    ("openvino", ["model.xml", "model.bin"], "openvino", 'backend: "openvino"'),
    ("torch_aoti", ["model.pt2"], "pt2", 'platform: "torch_aoti"'),
])
def test_the_bundled_export_agrees_with_the_python_reference(baseline, tmp_path, platform, files, tag, line):
    repo = tmp_path / "models"
    shutil.copytree(ROOT / "models", repo, ignore=shutil.ignore_patterns("model.*"))
    for file in files:
        link_file(ROOT / "models" / "classifier" / "1" / file, repo / "classifier" / "1" / file)
    config = repo / "classifier" / "config.pbtxt"
    config.write_text(config.read_text().replace('platform: "pytorch_libtorch"', line))
    s = Server("--model-repository", str(repo), repository=False)
    try:
        meta = requests.get(s.base + "/v2/models/classifier", timeout=10).json()
        assert meta["platform"] == platform
        got = predict(s)
    finally:
        s.stop()
    torchscript, python_ref = baseline
    # Near-ties are judged on the TorchScript server's top two (the reference gives top-1).
    tie = [x["top_k"][0]["score"] - x["top_k"][1]["score"] < NEAR_TIE for x in torchscript]
    agree = [o["class_id"] == r["class_id"] for o, r in zip(got, python_ref)]
    firm = [a for a, t in zip(agree, tie) if not t]
    same_as_torchscript = [o["class_id"] == t["class_id"] for o, t in zip(got, torchscript)]
    diff = [abs(o["score"] - t["score"]) for o, t in zip(got, torchscript)]
    report = {
        "format": tag,
        "photos": len(PATHS),
        "top1_vs_python_reference": f"{sum(agree)}/{len(agree)}",
        "top1_vs_python_reference_near_ties_excused": f"{sum(firm)}/{len(firm)}",
        "near_ties": sum(tie),
        "top1_vs_torchscript_server": f"{sum(same_as_torchscript)}/{len(PATHS)}",
        "max_abs_score_diff_vs_torchscript_server": float(f"{max(diff):.3g}"),
        "disagreements_with_reference": [p.name for p, a in zip(PATHS, agree) if not a],
    }
    print(f"\n{tag} fidelity:", json.dumps(report))
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    (ROOT / "test-artifacts" / f"{tag}-fidelity.json").write_text(json.dumps(report, indent=2))
    assert sum(firm) / len(firm) >= 0.99, report
    assert max(diff) < 1e-3, report
