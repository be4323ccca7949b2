"""The scale-out proof in its short form (`make scale-out` runs the full one): replicas of the
rendered Deployment on loopback behind HAProxy, sharing one S3 bucket (moto), Prometheus with
the recording rules, the HPA's arithmetic on the adapter's query, a rolling model update and a
drained replica under load (scripts/scale_out.py). Its report and plot go to
test-artifacts/scale-out/; each check is asserted from its results.json, with the numbers it
judged."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, require_tool

OUT = ROOT / "test-artifacts" / "scale-out"
# Every check scripts/scale_out.py makes, by its key in results.json: one missing fails.
CHECKS = [
    "scales_up_under_singles",
    "scales_up_under_uploads",
    "scales_back_down",
    "no_request_failed",
    "new_version_served_everywhere",
    "drained_replica_answered_its_requests",
    "drained_replica_back",
]
# Each check judged here from the numbers it reports (not from the script's `passed`, which must
# agree). `sent` counts every attempt: each was answered or a 503 retried, unless it failed.
CRITERIA = {
    "scales_up_under_singles": lambda v: v["max_wanted"] is not None and v["max_wanted"] > v["min_replicas"],
    "scales_up_under_uploads": lambda v: v["max_wanted"] is not None and v["max_wanted"] > v["min_replicas"],
    "scales_back_down": lambda v: v["last_wanted"] == v["min_replicas"],
    "no_request_failed": lambda v: v["failures"] == 0 and v["answered"] + v["retried_503"] == v["sent"],
    "new_version_served_everywhere": lambda v: len(v["served_after_s"]) == v["replicas"]
    and all(s <= v["limit_s"] for s in v["served_after_s"].values()),
    "drained_replica_answered_its_requests": lambda v: v.get("exit_code") == 0
    and v.get("pending_images_at_stop", 0) > 0 and v["refused_503"] == 0,
    "drained_replica_back": lambda v: "back_s" in v and "error" not in v,
}


@pytest.fixture(scope="module")
def scale_out():
    """One short run for every test here: the finished process and its results.json."""
    for tool in ("kubectl", "haproxy", "prometheus"):
        require_tool(tool)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale_out.py"), "--short", "--out", str(OUT)],
                       capture_output=True, text=True, timeout=900, env=os.environ)
    results = OUT / "results.json"
    assert results.exists(), f"no results.json (exit {r.returncode}): " + (r.stdout + r.stderr)[-6000:]
    return r, json.loads(results.read_text())


@pytest.mark.parametrize("key", CHECKS)
def test_replicas_share_a_bucket_scale_on_images_and_lose_nothing(scale_out, key):
    _, results = scale_out
    found = {c["check"]: c for c in results["checks"]}
    assert key in found, f"{key}: not among the checks run ({sorted(found)})"
    check = found[key]
    values, passed = check["values"], CRITERIA[key](check["values"])
    assert passed, f"{key} failed: {check['name']}: {json.dumps(values)}"
    assert check["passed"] == passed, f"{key}: the script's verdict {check['passed']} differs: {json.dumps(values)}"


def test_the_run_checks_all_it_says_stops_cleanly_and_plots(scale_out):
    r, results = scale_out
    # A check scripts/scale_out.py gains is added to CHECKS, so that it is asserted on its own.
    assert [c["check"] for c in results["checks"]] == CHECKS, [c["check"] for c in results["checks"]]
    assert results["stopped_clean"], "a process did not stop cleanly: " + (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert (OUT / "report.png").stat().st_size > 10_000
