"""Issue 14's acceptance: a classifier whose config.pbtxt carries a Triton `model_warmup`
block (the one Triton's guides show) loads and serves, and its warmup ran before ready."""

import re

import requests

from conftest import ROOT, Server, link_file

WARMUP = """
model_warmup [
  {
    name: "zero_batch_32"
    batch_size: 32
    inputs {
      key: "input__0"
      value: {
        data_type: TYPE_FP32
        dims: [ 3, 224, 224 ]
        zero_data: true
      }
    }
    count: 10
  }
]
"""


def test_a_classifier_with_tritons_model_warmup_block_serves(server, all_photos, tmp_path):
    repo = tmp_path / "models"
    classifier = repo / "classifier"
    (classifier / "1").mkdir(parents=True)
    bundled = ROOT / "models"
    (classifier / "config.pbtxt").write_text((bundled / "classifier" / "config.pbtxt").read_text() + WARMUP)
    link_file(bundled / "classifier" / "labels.txt", classifier / "labels.txt")
    link_file(bundled / "classifier" / "1" / "model.pt", classifier / "1" / "model.pt")
    for m in ("preprocessor", "ensemble_model"):
        (repo / m).symlink_to(bundled / m)

    s = Server(f"--model-repository={repo}", repository=False)
    try:
        photo = all_photos[0]
        with open(photo, "rb") as f:
            r = requests.post(s.base + "/predict", files=[("files", (photo.name, f.read()))], timeout=60)
        with open(photo, "rb") as f:
            ref = requests.post(server.base + "/predict", files=[("files", (photo.name, f.read()))], timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["top_k"][0]["label"] == ref.json()["results"][0]["top_k"][0]["label"]
        log = re.sub(r"\x1b\[[0-9;]*m", "", s.log_path.read_text())
        ran = [l for l in log.splitlines() if "warmup sample ran" in l]
        # Each instance (two on this CPU) ran the sample 10 times with batch 32 before ready.
        assert len(ran) == 2, log
        for line in ran:
            assert 'sample="zero_batch_32"' in line and "count=10" in line and "batch_size=32" in line, line
        ready_at = log.index("model ready") if "model ready" in log else len(log)
        assert all(log.index(l) < ready_at for l in ran)
    finally:
        s.stop()
