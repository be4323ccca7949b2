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

import pytest

from conftest import ROOT, Server

KEY = "schemathesis-key"


# The server on its default configuration (no flags), and with shared memory on in explicit
# mode with the control key, so registration, load and unload are exercised too. Each
# adds to `schemathesis.toml` what a schema-valid request to it gets where the document
# cannot say:
# - default: load (and unload) is closed without --repository-control-key, shared memory
#   is off without --allow-client-shm: 403, and only 403;
# - shm-explicit: a load of a model the repository does not hold is 400 (as Triton), a
#   region registered on an object that does not exist is 400 (the client creates the
#   object; the server only opens it).
CONFIGURATIONS = {
    "default": ([], {"/load$": ["403"], "/register$": ["403"]}),
    "shm-explicit": (
        [
            "--model-control-mode=explicit", "--load-model=*",
            "--repository-control-key", f"x-admin-key={KEY}", "--allow-client-shm=true",
        ],
        {"/load$": ["2xx", "400", "404"], "/register$": ["2xx", "400"]},
    ),
}


def settings(tmp_path, accepted):
    """`schemathesis.toml` with the configuration's statuses for schema-valid requests."""
    text = (ROOT / "tests" / "python" / "schemathesis.toml").read_text()
    for path, statuses in accepted.items():
        text += (f'\n[[operations]]\ninclude-path-regex = "{path}"\n'
                 f"checks.positive_data_acceptance.expected-statuses = {statuses!r}\n")
    out = tmp_path / "schemathesis.toml"
    out.write_text(text.replace("'", '"'))
    return out


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_schemathesis_finds_nothing(tmp_path, configuration):
    flags, accepted = CONFIGURATIONS[configuration]
    s = Server(*flags)
    seed = os.environ.get("VISIONGATE_SCHEMATHESIS_SEED", "20261124")
    try:
        cmd = [
            str(Path(sys.executable).parent / "schemathesis"), "--no-color",
            "--config-file", str(settings(tmp_path, accepted)),
            "run", str(ROOT / "openapi" / "openapi.json"), "--url", s.base,
            "--checks", "all", "-H", f"x-admin-key: {KEY}",
            "--workers", "1", "--max-examples", "40", "--request-timeout", "60",
            *([] if seed == "random" else ["--seed", seed]),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        out = r.stdout + r.stderr
        (ROOT / "test-artifacts").mkdir(exist_ok=True)
        (ROOT / "test-artifacts" / f"schemathesis-{configuration}.txt").write_text(out)
        print(f"\n{configuration}: {out.strip().splitlines()[-1]}")
        assert r.returncode == 0, out[-6000:]
        assert "failures" not in out.splitlines()[-1] or " 0 failures" in out.splitlines()[-1], out[-3000:]
    finally:
        s.stop()
