"""The scale-out proof in its short form (`make scale-out` runs the full one): replicas of the
rendered Deployment on loopback behind HAProxy, sharing one S3 bucket (moto), Prometheus with
the recording rules, the HPA's arithmetic on the adapter's query, a rolling model update and a
drained replica under load (scripts/scale_out.py). Its report and plot go to
test-artifacts/scale-out/."""

import os
import subprocess
import sys

from conftest import ROOT, require_tool


def test_replicas_share_a_bucket_scale_on_images_and_lose_nothing():
    for tool in ("kubectl", "haproxy", "prometheus"):
        require_tool(tool)
    out = ROOT / "test-artifacts" / "scale-out"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale_out.py"), "--short", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=os.environ)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    report = (out / "report.md").read_text()
    assert "FAILED" not in report and (out / "report.png").stat().st_size > 10_000
