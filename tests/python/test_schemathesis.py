"""The OpenAPI document as an exact contract: schemathesis (a property-based API fuzzer)
drives every operation of `openapi/openapi.json` against the real server with all its
checks (status codes and bodies as documented, schema-valid requests accepted,
schema-violating ones refused, 405 for wrong methods) and must find nothing.

The seed is fixed so the suite is repeatable; `VISIONGATE_SCHEMATHESIS_SEED=random` (or a
number) explores further."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, Server

KEY = "schemathesis-key"


def test_schemathesis_finds_nothing(tmp_path):
    # Explicit mode with the control key, so load and unload are exercised too; shared
    # memory on, so registration is.
    s = Server(
        "--model-control-mode=explicit", "--load-model=*",
        "--repository-control-key", f"x-admin-key={KEY}", "--allow-client-shm=true",
    )
    seed = os.environ.get("VISIONGATE_SCHEMATHESIS_SEED", "20261124")
    try:
        cmd = [
            str(Path(sys.executable).parent / "schemathesis"), "--no-color",
            "--config-file", str(ROOT / "tests" / "python" / "schemathesis.toml"),
            "run", str(ROOT / "openapi" / "openapi.json"), "--url", s.base,
            "--checks", "all", "-H", f"x-admin-key: {KEY}",
            "--workers", "1", "--max-examples", "40", "--request-timeout", "60",
            *([] if seed == "random" else ["--seed", seed]),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        out = r.stdout + r.stderr
        (ROOT / "test-artifacts").mkdir(exist_ok=True)
        (ROOT / "test-artifacts" / "schemathesis.txt").write_text(out)
        assert r.returncode == 0, out[-6000:]
        assert "failures" not in out.splitlines()[-1] or " 0 failures" in out.splitlines()[-1], out[-3000:]
    finally:
        s.stop()
