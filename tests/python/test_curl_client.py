"""The README's curl command, run with the real curl against the real server."""

import json
import subprocess

from conftest import require_tool

CATS = {281, 282, 283, 284, 285}


def test_curl_upload_of_two_photos_and_a_text_file(server, all_photos, tmp_path):
    require_tool("curl")
    chelsea = next(p for p in all_photos if p.name == "sk_chelsea.jpg")
    coffee = next(p for p in all_photos if p.name == "sk_coffee.jpg")
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image\n")
    out = subprocess.run(
        ["curl", "-sS", "-F", f"files=@{chelsea}", "-F", f"files=@{coffee}", "-F", f"files=@{notes}", server.base + "/predict"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    body = json.loads(out.stdout)
    results = body["results"]
    assert body["model"] == "ensemble_model"
    assert results[0]["filename"] == "sk_chelsea.jpg" and results[0]["class_id"] in CATS
    assert results[1]["label"] == "espresso"
    assert results[2]["error"]["code"] == "invalid_image"
    assert body["timing"]["total_images"] == 3


def test_single_file_field_name_is_accepted(server, all_photos):
    chelsea = next(p for p in all_photos if p.name == "sk_chelsea.jpg")
    out = subprocess.run(
        ["curl", "-sS", "-F", f"file=@{chelsea}", server.base + "/predict?top_k=1"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    results = json.loads(out.stdout)["results"]
    assert len(results) == 1 and len(results[0]["top_k"]) == 1
