"""docs/migrating-from-fastapi-triton.md, followed as written on the stack it starts from
(examples/fastapi-triton): the preprocessor's config replaced by the guide's block, the
server started with the Triton manifest's arguments, the old FastAPI gateway and Triton
clients served unchanged, and the guide's equivalence check passing on the test photos."""

import importlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import PHOTOS, ROOT, Server, link_file

GUIDE = ROOT / "docs" / "migrating-from-fastapi-triton.md"
EXAMPLE = ROOT / "examples" / "fastapi-triton"


def guide_block(marker):
    """The fenced block that follows `marker` in the guide."""
    text = GUIDE.read_text()
    m = re.search(re.escape(marker) + r"\s*```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"the guide has no block after {marker!r}"
    return m.group(1)


def test_the_migration_guide_works_as_written(tmp_path, all_photos):
    # The stack before: its repository, with the model `make setup` exported as model.pt.
    models = tmp_path / "models"
    shutil.copytree(EXAMPLE / "models", models, symlinks=False)
    link_file(ROOT / "models" / "classifier" / "1" / "model.pt", models / "resnet_classifier" / "1" / "model.pt")

    # Step 1: the preprocessor's config.pbtxt replaced by the guide's.
    (models / "preprocessor" / "config.pbtxt").write_text(guide_block("<!-- the new preprocessor config.pbtxt -->"))

    # Step 3: started as the Triton manifest started tritonserver.
    compose = guide_block("After, one service, the same repository mounted, the same arguments:")
    args = re.search(r'command: \["tritonserver", (.*)\]', compose).group(1)
    args = [a.strip().strip('"').replace("=/models", f"={models}") for a in args.split(",")]
    s = Server(*args, repository=False)
    try:
        # The old FastAPI gateway, unchanged, against visiongate's gRPC port.
        os.environ["TRITON_URL"] = s.grpc_url
        os.environ["LABELS"] = str(models / "resnet_classifier" / "labels.txt")
        sys.path.insert(0, str(EXAMPLE / "app"))
        try:
            gateway = importlib.import_module("main")
        finally:
            sys.path.pop(0)
        from fastapi.testclient import TestClient

        photos = all_photos[:4]
        files = [("files", (p.name, p.read_bytes())) for p in photos]
        old = TestClient(gateway.app).post("/predict", files=files).json()["results"]
        # Step 2: visiongate's own /predict, the same upload.
        import requests

        new = requests.post(s.base + "/predict?model=image_ensemble", files=files, timeout=120).json()["results"]
        assert [r["label"] for r in old] == [r["label"] for r in new]
        assert all({"filename", "label", "score"} <= set(r) for r in new)

        # Triton clients keep their model and tensor names.
        h = httpclient.InferenceServerClient(s.http_url)
        assert h.is_model_ready("image_ensemble")
        meta = h.get_model_metadata("image_ensemble")
        assert meta["inputs"][0]["name"] == "IMAGE_BYTES" and meta["outputs"][0]["name"] == "LOGITS"
        batch = gateway.pad([p.read_bytes() for p in photos])
        inp = grpcclient.InferInput("IMAGE_BYTES", list(batch.shape), "UINT8")
        inp.set_data_from_numpy(batch)
        logits = grpcclient.InferenceServerClient(s.grpc_url).infer("image_ensemble", [inp]).as_numpy("LOGITS")
        assert logits.shape == (4, 1000)
        assert [gateway.labels[i] for i in np.argmax(logits, axis=1)] == [r["label"] for r in new]
        # The classifier's model_warmup ran before ready.
        assert "warmup sample ran" in s.log_path.read_text()

        # Step 4: the guide's check, its command as written, on the test photos.
        check = guide_block("photo by photo:")
        assert "scripts/migration_check.py" in check
        r = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "migration_check.py"),
             "--preprocessor", str(models / "preprocessor" / "1" / "model.py"),
             "--model", str(models / "resnet_classifier" / "1" / "model.pt"),
             "--ensemble", "image_ensemble", "--url", s.base, str(PHOTOS)],
            capture_output=True, text=True, timeout=600,
        )
        print(r.stdout, r.stderr)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "agreement with near ties excused" in r.stdout
        (ROOT / "test-artifacts").mkdir(exist_ok=True)
        (ROOT / "test-artifacts" / "migration-check.txt").write_text(r.stdout)
    finally:
        sys.modules.pop("main", None)
        s.stop()
