"""The Kubernetes pod, run for real (scripts/container-test.sh, after the image is built):
the Deployment's pod template as `kubectl kustomize deploy/kubernetes` renders it (image,
args, env, probes, ports, volumes, security context) started by `podman kube play`, its
bucket on moto's S3 server. Checked as kubelet and a client would: the startup and
readiness probes pass, the liveness probe (podman's health check) passes, it classifies, and
a stop during a 1000-photo upload (the preStop pause, then SIGTERM with the pod's grace
period) answers the upload in full, says not ready meanwhile, and exits 0 within the grace.

What differs from a cluster, each for a reason printed as it runs:
- the store's endpoint (AWS_ENDPOINT_URL) is added: moto on this host's loopback, which the
  pod reaches as 10.0.2.2 (slirp4netns with allow_host_loopback);
- each container port gets a hostPort on 127.0.0.1 (free ports), in place of the Service;
- the Secret's volume is a host directory holding the same file: podman 4.3 writes a Secret
  volume's files still base64-encoded (and leaves out stringData);
- podman runs neither readiness nor startup probes, nor preStop, nor the grace period: this
  script runs them as kubelet does, from the manifest.
"""

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from scale_out import Manifests, multipart, scrape, seed_bucket  # noqa: E402  (the rendered manifests; form bodies; /metrics)
from test_remote_repositories import S3  # noqa: E402  (moto's S3 server; scale_out adds its path)
from conftest import free_port  # noqa: E402

PHOTOS = ROOT / "tests" / "fixtures" / "photos" / "small"
HOST_FROM_POD = "10.0.2.2"
# How long the 1000-photo upload goes on after SIGTERM: the pod reports not ready meanwhile.
UPLOAD_AFTER_STOP_S = 6


class Paced:
    """A body read over `seconds` whatever the reader's speed: requests sends it with its
    length (a generator would go chunked) as http.client reads it block by block."""

    def __init__(self, data, seconds):
        self.data, self.at, self.rate = data, 0, len(data) / seconds

    def __len__(self):
        return len(self.data) - self.at

    def read(self, n=-1):
        n = len(self) if n is None or n < 0 else min(n, len(self))
        chunk = self.data[self.at:self.at + n]
        self.at += n
        time.sleep(n / self.rate)
        return chunk


def say(msg):
    print(f"kube-play: {msg}", flush=True)


def podman(*args, check=True, timeout=300):
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {r.stderr.strip()[-2000:]}")
    return r.stdout.strip()


def probe_url(probe, host_ports):
    port = probe["httpGet"]["port"]
    return f"http://127.0.0.1:{host_ports[port]}{probe['httpGet']['path']}"


def run_probe(probe, host_ports, what, deadline_s=None):
    """Polls the probe as kubelet does (every periodSeconds, up to failureThreshold failures
    in a row, or `deadline_s`); returns the seconds until it passed."""
    period = probe.get("periodSeconds", 10)
    allowed = deadline_s or period * probe.get("failureThreshold", 3)
    start = time.time()
    while time.time() - start <= allowed:
        try:
            if requests.get(probe_url(probe, host_ports), timeout=probe.get("timeoutSeconds", 1)).status_code < 400:
                return time.time() - start
        except requests.RequestException:
            pass
        time.sleep(min(period, 1))
    raise RuntimeError(f"the {what} probe did not pass in {allowed} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", type=Path, required=True)
    ap.add_argument("--image", required=True, help="the image the container test built")
    args = ap.parse_args()
    m = Manifests()
    pod_spec = m.deployment["spec"]["template"]["spec"]
    container = m.container
    # The manifest's image (kustomization.yaml's tag) is the one just built.
    podman("tag", args.image, f"docker.io/library/{container['image']}")
    say(f"{args.image} tagged as the manifest's {container['image']}")

    s3 = S3()
    work = Path(args.artifacts) / "kube-play"
    work.mkdir(parents=True, exist_ok=True)
    pod_name = None
    try:
        seed_bucket(s3, m)

        # -- what differs from a cluster (see the docstring) --
        container["env"].append({"name": "AWS_ENDPOINT_URL", "value": f"http://{HOST_FROM_POD}:{s3.port}"})
        say(f"env AWS_ENDPOINT_URL=http://{HOST_FROM_POD}:{s3.port} (moto on this host's loopback)")
        host_ports = {}
        for port in container["ports"]:
            port["hostPort"] = host_ports[port["containerPort"]] = host_ports[port["name"]] = free_port()
            port["hostIP"] = "127.0.0.1"
        say(f"hostPorts on 127.0.0.1: {json.dumps({p['name']: p['hostPort'] for p in container['ports']})}")
        secret_dir = work / "s3-credentials"
        secret_dir.mkdir(exist_ok=True)
        keys = s3.env()
        (secret_dir / "credentials").write_text(
            f"[default]\naws_access_key_id = {keys['AWS_ACCESS_KEY_ID']}\n"
            f"aws_secret_access_key = {keys['AWS_SECRET_ACCESS_KEY']}\n")
        (secret_dir / "credentials").chmod(0o444)
        for volume in pod_spec["volumes"]:
            if "secret" in volume:
                volume.pop("secret")
                volume["hostPath"] = {"path": str(secret_dir.resolve()), "type": "Directory"}
        say("the Secret visiongate-s3's volume: a host directory with its `credentials` file")
        pod_yaml = work / "pod.yaml"
        pod_yaml.write_text(yaml.safe_dump(m.deployment))

        # -- play --
        start = time.time()
        # podman names a Deployment's pod <name>-pod-0 and its containers <pod>-<container>.
        pod_name = f"{m.deployment['metadata']['name']}-pod-0"
        ctr = f"{pod_name}-{container['name']}"
        podman("kube", "play", "--network", "slirp4netns:allow_host_loopback=true", str(pod_yaml))
        say(f"pod {pod_name}, container {ctr}")
        inspect = json.loads(podman("inspect", ctr))[0]
        user = inspect["Config"]["User"]
        assert user.split(":")[0] == str(pod_spec["securityContext"]["runAsUser"]), f"runs as {user}"
        assert inspect["HostConfig"]["ReadonlyRootfs"], "the root file system is writable"
        started = run_probe(container["startupProbe"], host_ports, "startup",
                            deadline_s=container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"])
        run_probe(container["readinessProbe"], host_ports, "readiness", deadline_s=300)
        say(f"startup probe passed after {started:.1f} s, readiness after {time.time() - start:.1f} s from the play")
        health = subprocess.run(["podman", "healthcheck", "run", ctr], capture_output=True, text=True)
        assert health.returncode == 0, f"the liveness probe (podman's health check): {health.stdout}{health.stderr}"
        hc = inspect["Config"]["Healthcheck"]["Test"]
        assert any(container["livenessProbe"]["httpGet"]["path"] in part for part in hc), hc

        # -- it classifies --
        base = f"http://127.0.0.1:{host_ports['http']}"
        photo = PHOTOS / "sk_chelsea.jpg"
        body, ctype = multipart([(photo.name, photo.read_bytes())])
        answer = requests.post(f"{base}/predict", data=body, headers={"Content-Type": ctype}, timeout=60)
        assert answer.status_code == 200 and answer.json()["results"][0]["label"] == "Egyptian cat", answer.text
        say("it classifies: sk_chelsea.jpg is an Egyptian cat, from the bucket's model")

        # -- a stop during a 1000-photo upload --
        photos = sorted(PHOTOS.glob("*.jpg"))
        files = [(p.name, p.read_bytes()) for p in (photos * (1000 // len(photos) + 1))[:1000]]
        body, ctype = multipart(files)
        upload = {}
        # Sent over UPLOAD_S, whatever the server's speed: its stop (preStop, then SIGTERM)
        # comes while the upload still arrives, so the drain has a request to wait for.
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        paced = Paced(body, (pre_stop + UPLOAD_AFTER_STOP_S))

        def send():
            try:
                r = requests.post(f"{base}/predict", data=paced, headers={"Content-Type": ctype}, timeout=600)
                upload.update(status=r.status_code, results=len(r.json().get("results", [])),
                              labelled=sum(1 for x in r.json().get("results", []) if x.get("label")))
            except Exception as e:  # noqa: BLE001  (reported below)
                upload.update(error=repr(e))

        decoded = lambda: scrape(host_ports["metrics"]).get("visiongate_decode_seconds_count", 0.0)
        before = decoded()
        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.time() + 60
        while time.time() < deadline:
            if decoded() > before:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the upload never reached the server")
        grace = pod_spec["terminationGracePeriodSeconds"]
        say(f"stopping with the upload arriving (its first images decoded): preStop {pre_stop} s, then SIGTERM, "
            f"grace {grace} s")
        stop_start = time.time()
        time.sleep(pre_stop)
        assert sender.is_alive(), f"the upload ended during the preStop pause: {upload}"
        stopper = subprocess.Popen(["podman", "stop", "-t", str(grace), ctr], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        not_ready = None
        while stopper.poll() is None:
            try:
                if requests.get(probe_url(container["readinessProbe"], host_ports), timeout=1).status_code == 503:
                    not_ready = not_ready or time.time() - stop_start
            except requests.RequestException:
                pass
            time.sleep(0.2)
        stop_s = time.time() - stop_start
        sender.join(timeout=grace)
        code = json.loads(podman("inspect", ctr))[0]["State"]["ExitCode"]
        logs = subprocess.run(["podman", "logs", ctr], capture_output=True, text=True)
        (work / "server.log").write_text(logs.stdout + logs.stderr)
        say(f"stopped in {stop_s:.1f} s (exit code {code}); the upload: {json.dumps(upload)}; "
            f"not ready {not_ready if not_ready is None else round(not_ready, 1)} s into the stop")
        assert upload.get("status") == 200 and upload.get("labelled") == 1000, f"the upload under way: {upload}"
        assert not_ready is not None, "readiness never said 503 while the pod drained"
        assert code == 0, f"exit code {code} after SIGTERM"
        assert stop_s < grace, "the stop took the whole grace period"
        say("passed")
    finally:
        if pod_name:
            podman("pod", "rm", "-f", pod_name, check=False)
        # podman makes each emptyDir a named volume: removed, so the next play starts empty.
        for volume in pod_spec["volumes"]:
            if "emptyDir" in volume:
                podman("volume", "rm", "-f", volume["name"], check=False)
        s3.stop()


if __name__ == "__main__":
    main()
