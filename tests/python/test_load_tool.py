"""The load tool (`make load`, scripts/load.py) in miniature: 400 mixed requests at
concurrency 16 against its own server, every one answered as its kind must be (labels
checked), and the tool says so with its exit code."""

import subprocess
import sys

from conftest import ROOT


def test_a_short_mixed_load_is_answered_request_by_request():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "load.py"), "--requests", "400", "--concurrency", "16"],
        capture_output=True, text=True, timeout=600,
    )
    print(run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "400 requests in" in run.stdout
    table = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()
             if line.split() and line.split()[0] in ("predict", "kserve", "grpc", "stalled", "oversized")}
    # The common kinds all came up, and none was answered wrongly.
    assert all(int(ok) > 0 and wrong == "0" for kind, (ok, _, wrong) in table.items() if kind != "stalled"), table
