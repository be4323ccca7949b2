"""Deployment files checked by the tools their users' tooling trusts, since no Docker engine
or Kubernetes cluster runs here: the Compose specification's schema (vendored by
check-jsonschema), hadolint and BuildKit's Dockerfile parser; the Kubernetes manifests as
`kubectl kustomize` renders them, against the API schemas of several Kubernetes releases
(kubernetes-validate, strict: unknown fields fail) and checkov's policies; the autoscaling
rules by `promtool test rules`. They run for real in scripts/scale_out.py
(tests/python/test_scale_out.py)."""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dockerfile
import kubernetes_validate
import pytest
import yaml

from conftest import ROOT, require_tool

BIN = Path(sys.executable).parent
K8S = ROOT / "deploy" / "kubernetes"
# The Kubernetes releases the manifests must be valid for: the five newest kubernetes-validate
# knows (each supported upstream for about 14 months).
K8S_VERSIONS = ["1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0"]
# checkov, in a venv of its own (scripts/setup.sh; env.sh names it).
CHECKOV = os.environ.get("VISIONGATE_CHECKOV", "checkov")


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)


def test_compose_file_follows_the_compose_spec():
    r = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", ROOT / "docker-compose.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    # The schema rejects what Compose rejects (the check is not vacuous).
    broken = ROOT / "test-artifacts" / "broken-compose.yml"
    broken.parent.mkdir(exist_ok=True)
    broken.write_text((ROOT / "docker-compose.yml").read_text().replace("restart:", "restart_policy:"))
    assert run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", broken).returncode != 0


def test_compose_service_has_ports_gpu_healthcheck_and_restart():
    (service,) = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"].values()
    assert service["build"] == "."
    # Container ports 8000-8002, published on the same host ports unless overridden.
    published = [p.split()[0] for p in service["ports"]]
    assert [p.rsplit(":", 1)[1] for p in published] == ["8000", "8001", "8002"]
    assert [re.sub(r"\$\{[A-Z_]+:-(\d+)\}", r"\1", p.rsplit(":", 1)[0]) for p in published] == [
        "8000",
        "8001",
        "8002",
    ]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    # `video`: the GPU's JPEG decoder, asked for here and in the image's environment.
    assert device["capabilities"] == ["gpu", "compute", "utility", "video"] and device["driver"] == "nvidia"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility,video" in (ROOT / "Dockerfile").read_text()
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])
    assert service["restart"] == "unless-stopped"
    # The image reads its repository from /models, so `./models:/models` can be mounted.
    assert "VISIONGATE_MODEL_REPOSITORY=/models" in (ROOT / "Dockerfile").read_text()


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: `!reset` drops what the files before it set."""


ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def test_cpu_override_drops_only_the_gpu_reservation():
    (service,) = yaml.load((ROOT / "docker-compose.cpu.yml").read_text(), ComposeLoader)["services"].values()
    assert service["deploy"] == "!reset"
    assert set(service) == {"deploy"}, "the CPU override changes nothing else"
    # The README's CPU command is the one the container test runs.
    command = "docker compose -f docker-compose.yml -f docker-compose.cpu.yml up -d --wait"
    assert command in (ROOT / "README.md").read_text()
    assert "COMPOSE_FILES=(-f docker-compose.yml -f docker-compose.cpu.yml)" in (
        ROOT / "scripts" / "container-test.sh"
    ).read_text()


def test_dockerfile_builds_with_the_readme_setup_and_ships_a_lean_runtime():
    r = run(BIN / "hadolint", "--failure-threshold", "error", ROOT / "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr
    commands = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    stages = [c for c in commands if c.cmd == "FROM"]
    assert len(stages) == 2, "multi-stage: build, then runtime"
    runtime_start = commands.index(stages[1])
    build, runtime = commands[:runtime_start], commands[runtime_start:]
    setup_runs = [c for c in build if c.cmd == "RUN" and "scripts/setup.sh" in c.value[0]]
    assert setup_runs and all("--no-test-tools" in c.value[0] for c in setup_runs), "the set-up, without test tools"
    # Dependencies before sources: the venv and model layers come before any source copy.
    copies = [c.value for c in build if c.cmd == "COPY"]
    first_src = next(i for i, v in enumerate(copies) if "src" in v)
    assert any("scripts/requirements.txt" in v for v in copies[:first_src])
    assert all("." not in v[:-1] for v in copies), "no `COPY . .`: a source edit must not redo the venv"
    assert any(
        "build" in c.value[0] and "--mount=type=cache,target=/cache/target" in c.flags for c in setup_runs
    ), "cargo's target in a cache mount"
    copied = [c.value for c in runtime if c.cmd == "COPY"]
    assert any("/stage/visiongate" in v for v in copied), "the binary"
    assert any("/stage/models" in v for v in copied), "the model repository"
    assert any("/stage/opt" in v for v in copied), "libtorch and its CUDA libraries"
    assert not any(c.cmd == "RUN" and re.search(r"\b(cargo|pip)\b", c.value[0]) for c in runtime)
    exposed = [p for c in runtime if c.cmd == "EXPOSE" for p in c.value]
    assert exposed == ["8000", "8001", "8002"]
    (health,) = [c for c in runtime if c.cmd == "HEALTHCHECK"]
    assert "/v2/health/ready" in " ".join(health.value)
    (user,) = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert user not in ("root", "0")
    assert any(c.cmd == "RUN" and "/usr/local/bin/tritonserver" in c.value[0] for c in runtime)
    # What the build context leaves out.
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", "target", ".libtorch", "gpu-kit", "tests/*", "Dockerfile", "models/*/[0-9]*/model.pt",
                 "models/*/[0-9]*/model.onnx", "models/*/[0-9]*/model.pt2"):
        assert path in ignored, path


def rendered_text():
    require_tool("kubectl")
    r = run("kubectl", "kustomize", K8S)
    assert r.returncode == 0, r.stderr
    return r.stdout


def manifests():
    """The objects `kubectl kustomize deploy/kubernetes` renders, by kind (and ConfigMaps by
    name)."""
    objects = {}
    for d in yaml.safe_load_all(rendered_text()):
        objects[d["metadata"]["name"] if d["kind"] == "ConfigMap" else d["kind"]] = d
    return objects


def test_kustomization_renders_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert set(manifests()) == {"Namespace", "Deployment", "Service", "HorizontalPodAutoscaler", "NetworkPolicy",
                                "visiongate-prometheus-rules", "visiongate-adapter-rules"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate_against_the_api_schemas(version):
    for name, obj in manifests().items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name} on Kubernetes {version}: {e}")


def test_kubernetes_validation_rejects_a_wrong_field():
    bad = copy.deepcopy(manifests()["Deployment"])
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def checkov(path):
    """checkov's Kubernetes policies over a file: its summary and failed checks' ids."""
    require_tool(CHECKOV)
    r = run(CHECKOV, "-f", path, "--framework", "kubernetes", "--quiet", "--skip-download", "-o", "json")
    report = json.loads(r.stdout)
    failed = sorted({c["check_id"] for c in report.get("results", {}).get("failed_checks", [])})
    return report["summary"], failed


def test_policy_linter_passes_the_manifests_and_every_exception_says_why(tmp_path):
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(rendered_text())
    summary, failed = checkov(rendered)
    assert failed == [] and summary["parsing_errors"] == 0, failed
    assert summary["passed"] > 50, summary
    skips = {k: v for k, v in manifests()["Deployment"]["metadata"]["annotations"].items() if k.startswith("checkov.io/skip")}
    assert summary["skipped"] == len(skips)
    assert all(re.fullmatch(r"CKV2?_K8S_\d+=.{20,}", v) for v in skips.values()), skips
    # The linter is not vacuous: the container's security context removed, it fails.
    docs = list(yaml.safe_load_all(rendered.read_text()))
    for d in docs:
        if d["kind"] == "Deployment":
            del d["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    rendered.write_text(yaml.safe_dump_all(docs))
    assert "CKV_K8S_20" in checkov(rendered)[1]


def test_autoscaling_rules_pass_their_unit_tests():
    require_tool("promtool")
    r = run("promtool", "test", "rules", ROOT / "tests" / "prometheus" / "rules_test.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def exit_timeout(container):
    """The exit timeout the container's server runs with: its --exit-timeout-secs argument, its
    environment variable, or the binary's own default."""
    args = [*container.get("command", []), *container.get("args", [])]
    for i, arg in enumerate(args):
        if arg.startswith("--exit-timeout-secs="):
            return int(arg.split("=", 1)[1])
        if arg == "--exit-timeout-secs":
            return int(args[i + 1])
    for env in container.get("env", []):
        if env["name"] == "VISIONGATE_EXIT_TIMEOUT_SECS":
            return int(env["value"])
    help_text = subprocess.run([os.environ["VISIONGATE_BIN"], "--help"], capture_output=True, text=True,
                               check=True).stdout
    default = re.search(r"--exit-timeout-secs <[^>]*>.*?\[default: (\d+)\]", help_text, re.S)
    assert default, "the binary's help names the exit timeout's default"
    return int(default.group(1))


def test_deployment_probes_gpu_scrape_and_grace():
    m = manifests()
    pod = m["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
    # The probes name the HTTP port by number: it must be the container's `http` port.
    (http,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in (http, "http"), probe
    assert not any(a.startswith("--http-port") for a in container["args"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8002"
    # Longer than the server's own exit timeout (what it gives the requests under way, from the
    # container's arguments or the binary's default) plus the preStop pause and the listeners'
    # close (the 4 s the server allows past its exit timeout: src/shutdown.rs).
    stop = exit_timeout(container) + container["lifecycle"]["preStop"]["sleep"]["seconds"] + 4
    assert pod["spec"]["terminationGracePeriodSeconds"] > stop
    service_ports = {p["name"]: p["port"] for p in m["Service"]["spec"]["ports"]}
    assert service_ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    # The seeds' Triton arguments, on a bucket.
    args = container["args"]
    assert any(a.startswith("--model-repository=s3://") for a in args)
    assert "--model-control-mode=poll" in args and any(a.startswith("--repository-poll-secs=") for a in args)


def test_autoscaler_reads_the_adapters_series_of_the_rule_over_what_the_server_exports(server):
    m = manifests()
    hpa = m["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == m["Deployment"]["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "visiongate_pending_images" and metric["pods"]["target"]["type"] == "AverageValue"
    # The adapter serves the recording rule's series under that name...
    (rule,) = yaml.safe_load(m["visiongate-adapter-rules"]["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == name
    series = rule["name"]["matches"].strip("^$")
    assert series in rule["seriesQuery"]
    groups = yaml.safe_load(m["visiongate-prometheus-rules"]["data"]["visiongate.rules.yml"])["groups"]
    (recorded,) = [r for g in groups for r in g["rules"] if r["record"] == series]
    # ...which sums per pod the series the real server exports on its metrics port.
    import requests

    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    used = re.findall(r"(?:visiongate|nv)_[a-z_]+", "".join(r["expr"] for g in groups for r in g["rules"]))
    assert {"visiongate_decode_pending_images", "visiongate_pending_rows"} <= set(used)
    for series_name in used:
        assert re.search(rf"^{series_name}(\{{| )", text, re.M), f"{series_name} not exported"
    assert "by (namespace, pod)" in recorded["expr"]
