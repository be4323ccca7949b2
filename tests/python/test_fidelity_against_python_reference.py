"""visiongate's /predict agrees with the Python pipeline it replaces (PIL + torchvision +
the same TorchScript model) on the test photos."""

import json
from pathlib import Path

import requests

import reference

ROOT_MODELS = str(Path(__file__).resolve().parents[2] / "models")


def predict(server, paths):
    files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in paths]
    r = requests.post(server.base + "/predict", files=files, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_top1_matches_the_python_reference_on_at_least_95_percent_of_photos(server, all_photos):
    ours = predict(server, all_photos)
    ref = reference.classify([str(p) for p in all_photos], ROOT_MODELS)
    assert len(ours) == len(ref) == len(all_photos) >= 40
    agree = [o["class_id"] == r["class_id"] for o, r in zip(ours, ref)]
    score_diff = [abs(o["score"] - r["score"]) for o, r in zip(ours, ref)]
    rate = sum(agree) / len(agree)
    report = {
        "photos": len(agree),
        "top1_agreement": f"{sum(agree)}/{len(agree)}",
        "max_abs_score_diff": round(max(score_diff), 4),
        "mean_abs_score_diff": round(sum(score_diff) / len(score_diff), 4),
        "disagreements": [str(p.relative_to(p.parents[1])) for p, a in zip(all_photos, agree) if not a],
    }
    print("\nfidelity:", json.dumps(report))
    assert rate >= 0.95, report


def test_the_reference_itself_sees_the_cat_and_the_espresso(all_photos):
    by_name = {p.name: p for p in all_photos if p.parent.name == "small"}
    ref = reference.classify([str(by_name["sk_chelsea.jpg"]), str(by_name["sk_coffee.jpg"])], ROOT_MODELS)
    assert ref[0]["class_id"] in (281, 282, 283, 284, 285)
    assert ref[1]["class_id"] == 967  # espresso
