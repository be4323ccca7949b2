"""Scale-out, live on loopback (`make scale-out`; the test suite runs it with --short).

What a Kubernetes cluster would run, with every real part that runs on one machine:
- moto's S3 server holds the bundled repository at s3://models/triton-repo;
- REPLICAS visiongate processes run the Deployment's container exactly as
  `kubectl kustomize deploy/kubernetes` renders it (its args and env; the secret's keys are
  moto's), except for their ports and the cache volume's directory;
- HAProxy balances them as the Service would (random choice, readiness from the
  readinessProbe's path, period and threshold);
- Prometheus scrapes them, giving each target the `namespace` and `pod` labels a pod's
  scrape gets, and evaluates deploy/kubernetes/prometheus/visiongate.rules.yml;
- every HPA_PERIOD seconds, the adapter's metricsQuery (prometheus/adapter.yaml) is asked of
  Prometheus for every pod, and the HPA's algorithm (its formula, tolerance, missing
  metrics, min/max, and the scale-down stabilization of hpa.yaml's behavior) gives the
  replicas it would want.

Load, from a bounded set of client threads through the balancer, each answer checked
label by label: idle, then many single images, then 1000-photo uploads, then idle again.
During the single images a new classifier version is uploaded to the bucket (each replica
must serve it within the poll period); during the uploads one replica is drained as
Kubernetes stops a pod (out of the balancer, the preStop pause, SIGTERM, its exit code) and
started again. A 503 is retried (documented: a draining or overloaded replica's answer) and
counted; any other failure fails the run.

Writes OUT/report.md, OUT/report.png (the signal and the replicas wanted over time),
OUT/results.json (each check: its key, what it checks, whether it passed and the numbers it
judged), OUT/series.csv and the processes' logs; exits 1 if a check fails.
"""

import argparse
import csv
import http.client
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
PHOTOS = ROOT / "tests" / "fixtures" / "photos" / "small"
sys.path.insert(0, str(ROOT / "tests" / "python"))
from conftest import Server, free_port  # noqa: E402  (the real binary on loopback ports)
from test_remote_repositories import S3, Store  # noqa: E402  (moto's S3 server; a server process)

SCRAPE_S = 5  # Prometheus's scrape and rule evaluation interval here
HPA_PERIOD_S = 5  # how often the HPA's arithmetic runs (the controller's default is 15 s)
HPA_TOLERANCE = 0.1  # the controller's default --horizontal-pod-autoscaler-tolerance
UPLOAD_FILES = 1000

FULL = {"idle": 20, "singles": 120, "uploads": 120, "cool": 90, "single_clients": 48, "upload_clients": 3}
SHORT = {"idle": 5, "singles": 75, "uploads": 45, "cool": 75, "single_clients": 48, "upload_clients": 3}


def say(msg):
    print(f"scale-out [{time.strftime('%H:%M:%S')}]: {msg}", flush=True)


def cpu_model():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


# --- the manifests, as kubectl renders them ---------------------------------------------------

def rendered():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


class Manifests:
    def __init__(self):
        objects = rendered()
        self.deployment = objects[("Deployment", "visiongate")]
        self.namespace = self.deployment["metadata"]["namespace"]
        self.hpa = objects[("HorizontalPodAutoscaler", "visiongate")]
        self.rules = objects[("ConfigMap", "visiongate-prometheus-rules")]["data"]["visiongate.rules.yml"]
        adapter = yaml.safe_load(objects[("ConfigMap", "visiongate-adapter-rules")]["data"]["config.yaml"])
        pod = self.deployment["spec"]["template"]["spec"]
        (self.container,) = pod["containers"]
        self.grace_s = pod["terminationGracePeriodSeconds"]
        self.pre_stop_s = self.container["lifecycle"]["preStop"]["sleep"]["seconds"]
        self.readiness = self.container["readinessProbe"]
        (metric,) = self.hpa["spec"]["metrics"]
        self.metric = metric["pods"]["metric"]["name"]
        self.target = float(metric["pods"]["target"]["averageValue"])
        self.min = self.hpa["spec"].get("minReplicas", 1)
        self.max = self.hpa["spec"]["maxReplicas"]
        behavior = self.hpa["spec"].get("behavior", {})
        self.down_window_s = behavior.get("scaleDown", {}).get("stabilizationWindowSeconds", 300)
        self.up_window_s = behavior.get("scaleUp", {}).get("stabilizationWindowSeconds", 0)
        (self.adapter_rule,) = [r for r in adapter["rules"] if r["name"]["as"] == self.metric]
        self.series = self.adapter_rule["name"]["matches"].strip("^$")
        self.poll_s = int(self.arg("--repository-poll-secs"))
        repo = self.arg("--model-repository")
        assert repo.startswith("s3://"), f"the Deployment's repository is {repo}"
        self.bucket, self.prefix = repo[len("s3://"):].split("/", 1)

    def arg(self, name):
        for a in self.container["args"]:
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        raise KeyError(name)

    def mounts(self, pod_dir, s3):
        """Each volume the container mounts, as a directory of this pod's: emptyDir volumes
        empty, the Secret visiongate-s3 holding the test store's keys in its `credentials`
        file (the AWS credentials file it documents)."""
        volumes = {v["name"]: v for v in self.deployment["spec"]["template"]["spec"]["volumes"]}
        mounts = {}
        for mount in self.container["volumeMounts"]:
            local = pod_dir / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            volume = volumes[mount["name"]]
            if "secret" in volume:
                assert volume["secret"]["secretName"] == "visiongate-s3", volume
                keys = s3.env()
                (local / "credentials").write_text(
                    f"[default]\naws_access_key_id = {keys['AWS_ACCESS_KEY_ID']}\n"
                    f"aws_secret_access_key = {keys['AWS_SECRET_ACCESS_KEY']}\n")
            else:
                assert "emptyDir" in volume, volume
            mounts[mount["mountPath"]] = str(local)
        return mounts

    @staticmethod
    def local(value, mounts):
        """An argument or env value with a path inside a volume made the pod's directory."""
        for path, local in mounts.items():
            head, eq, tail = value.partition("=") if value.startswith("--") else ("", "", value)
            if tail == path or tail.startswith(path + "/"):
                return head + eq + local + tail[len(path):]
        return value

    def replica_args(self, mounts):
        """The container's args, paths inside its volumes made the pod's directories (the
        ports are added by `Server`)."""
        return [self.local(a, mounts) for a in self.container["args"]]

    def replica_env(self, mounts, s3):
        """The container's env (paths inside its volumes made the pod's directories) and
        the test store's endpoint, as an S3-compatible store is named."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        for e in self.container["env"]:
            env[e["name"]] = self.local(e["value"], mounts)
        env["AWS_ENDPOINT_URL"] = s3.url
        return env

    def adapter_query(self, pods):
        """The adapter's metricsQuery for these pods, as prometheus-adapter fills it in."""
        matchers = f'namespace="{self.namespace}",pod=~"{"|".join(pods)}"'
        return (self.adapter_rule["metricsQuery"].replace("<<.Series>>", self.series)
                .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))


# --- the processes --------------------------------------------------------------------------

class Replica:
    """One pod: the container's args and env on its own ports and cache directory."""

    def __init__(self, index, manifests, s3, work):
        self.name = f"visiongate-{index}"
        self.mounts = manifests.mounts(work / self.name, s3)
        self.manifests, self.s3 = manifests, s3
        self.server = None
        self.starts = 0

    def start(self):
        self.starts += 1
        self.server = Server(*self.manifests.replica_args(self.mounts), repository=False,
                             env=self.manifests.replica_env(self.mounts, self.s3))
        return self

    def pending_images(self):
        return held_images(scrape(self.server.metrics_port))

    def served_versions(self):
        try:
            r = requests.get(f"{self.server.base}/v2/models/classifier", timeout=5)
        except requests.RequestException:
            return []  # stopped or restarting: asked again
        return r.json().get("versions", []) if r.status_code == 200 else []


class Balancer:
    """HAProxy in front of the replicas, as the Service: a random ready endpoint per request;
    readiness from the readinessProbe; its admin socket removes an endpoint."""

    def __init__(self, replicas, manifests, work):
        self.port = free_port()
        self.sock = work / "haproxy.sock"
        probe = manifests.readiness
        self.inter_s, self.fall = probe.get("periodSeconds", 10), probe.get("failureThreshold", 3)
        servers = "\n".join(
            f"  server {r.name} 127.0.0.1:{r.server.port} check" for r in replicas)
        cfg = work / "haproxy.cfg"
        cfg.write_text(f"""global
  stats socket {self.sock} mode 600 level admin
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 300s
  timeout server 300s
frontend service
  bind 127.0.0.1:{self.port}
  default_backend pods
backend pods
  balance random
  # Which pod answered: a 503 from the drained one would be a request it dropped.
  http-response set-header X-Pod %s
  option httpchk GET {probe["httpGet"]["path"]}
  http-check expect status 200
  default-server inter {self.inter_s}s fall {self.fall} rise {probe.get("successThreshold", 1)}
{servers}
""")
        self.process = Store(["haproxy", "-f", str(cfg), "-db"], self.port, "haproxy", log=work / "haproxy.log")

    def command(self, line):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.sock))
            s.sendall(line.encode() + b"\n")
            return s.recv(65536).decode()

    def set_address(self, replica):
        self.command(f"set server pods/{replica.name} addr 127.0.0.1 port {replica.server.port}")

    def remove(self, replica):
        self.command(f"set server pods/{replica.name} state maint")

    def restore(self, replica):
        """Back in rotation; it must stay up through enough health checks to have been taken
        out, had they failed on its new port (the seconds it was watched)."""
        self.command(f"set server pods/{replica.name} state ready")
        watch = self.inter_s * self.fall + 1
        start = time.time()
        while time.time() - start < watch:
            if not self.up(replica):
                raise RuntimeError(f"the balancer's health check fails on {replica.name}")
            time.sleep(0.5)
        return watch

    def up(self, replica):
        # `show servers state`: one line per server; field 6 is its operational state (2: up).
        for line in self.command("show servers state pods").splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[3] == replica.name:
                return fields[5] == "2"
        return False


class Prometheus:
    def __init__(self, replicas, rules_text, namespace, work):
        self.port = free_port()
        self.replicas, self.namespace = replicas, namespace
        self.rules = work / "visiongate.rules.yml"
        self.rules.write_text(rules_text)
        self.config = work / "prometheus.yml"
        self.write()
        self.process = Store(
            ["prometheus", f"--config.file={self.config}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            self.port, "prometheus", log=work / "prometheus.log")

    def write(self):
        """Every replica's metrics port, with the labels a pod's scrape gets."""
        targets = [{"targets": [f"127.0.0.1:{r.server.metrics_port}"],
                    "labels": {"namespace": self.namespace, "pod": r.name}} for r in self.replicas]
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(self.rules)],
            "scrape_configs": [{"job_name": "visiongate", "static_configs": targets}],
        }))

    def retarget(self):
        """A restarted replica has new ports (the pod's IP would be new too)."""
        self.write()
        requests.post(f"http://127.0.0.1:{self.port}/-/reload", timeout=10).raise_for_status()

    def query(self, expr):
        r = requests.get(f"http://127.0.0.1:{self.port}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        return {s["metric"].get("pod", ""): float(s["value"][1]) for s in r.json()["data"]["result"]}


# --- the HPA's arithmetic ---------------------------------------------------------------------

class Autoscaler:
    """kube-controller-manager's replica calculation for one Pods metric with an
    AverageValue target (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale):
    ratio = average over pods / target; within the tolerance, no change; pods without a
    metric count as 0 when scaling up and as the target when scaling down, and if that
    reverses the direction or falls within the tolerance, no change; desired =
    ceil(ratio x pods); clamped to min/max. Then hpa.yaml's behavior, as the controller
    stabilizes: a rise takes the lowest recommendation of the scale-up window, a fall the
    highest of the scale-down window, applied to the replicas it last set (which here start
    at the replicas running; the processes themselves stay as they are)."""

    def __init__(self, manifests, replicas):
        self.m = manifests
        self.history = []  # (time, recommendation)
        self.scaled = replicas

    def desired(self, current, values, now):
        ready = [v for v in values.values() if not math.isnan(v)]
        missing = current - len(ready)
        if not ready:
            return current, self.scaled
        ratio = sum(ready) / len(ready) / self.m.target
        if abs(1 - ratio) <= HPA_TOLERANCE:
            raw = current
        else:
            raw = math.ceil(ratio * len(ready))
            if missing > 0:
                fill = 0.0 if ratio > 1 else self.m.target
                new_ratio = (sum(ready) + fill * missing) / (current * self.m.target)
                if abs(1 - new_ratio) <= HPA_TOLERANCE or (new_ratio > 1) != (ratio > 1):
                    raw = current
                else:
                    raw = math.ceil(new_ratio * current)
        raw = min(max(raw, self.m.min), self.m.max)
        self.history.append((now, raw))
        up = min(r for t, r in self.history if now - t <= self.m.up_window_s)
        down = max(r for t, r in self.history if now - t <= self.m.down_window_s)
        if self.scaled < up:
            self.scaled = up
        elif self.scaled > down:
            self.scaled = down
        return raw, self.scaled


# --- load ----------------------------------------------------------------------------------------

def multipart(files):
    boundary = uuid.uuid4().hex
    parts = []
    for name, data in files:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
                     f"Content-Type: image/jpeg\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


class Load:
    """Client threads through the balancer; each answer checked against the photos' labels."""

    def __init__(self, port, labels, photos, large=()):
        """Kinds of request: `single` (one of `photos`), `upload` (UPLOAD_FILES of them) and
        `large` (one of `large`); `labels` has every photo's."""
        self.port, self.labels = port, labels
        self.lock = threading.Lock()
        self.sent = self.answered = self.images = self.retried_503 = 0
        self.refused_by = {}  # pod: 503s it answered
        self.answered_by = {}  # pod: requests it answered
        self.failures = []
        self.latencies = {"single": [], "upload": [], "large": []}
        self.done = []  # (time answered, images)
        upload = [(p.name, p.read_bytes()) for p in (photos * (UPLOAD_FILES // len(photos) + 1))[:UPLOAD_FILES]]
        self.bodies = {
            "upload": [(multipart(upload), [n for n, _ in upload])],
            "single": [(multipart([(p.name, p.read_bytes())]), [p.name]) for p in photos],
            "large": [(multipart([(p.name, p.read_bytes())]), [p.name]) for p in large],
        }

    def one(self, kind, i):
        (body, ctype), names = self.bodies[kind][i % len(self.bodies[kind])]
        started = time.time()
        for attempt in range(20):
            with self.lock:
                self.sent += 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
                conn.request("POST", "/predict", body=body, headers={"Content-Type": ctype})
                r = conn.getresponse()
                status, text, pod = r.status, r.read(), r.getheader("X-Pod", "the balancer")
                conn.close()
            except OSError as e:
                return self.fail(f"{kind}: {type(e).__name__}: {e}")
            if status == 503:
                with self.lock:
                    self.retried_503 += 1
                    self.refused_by[pod] = self.refused_by.get(pod, 0) + 1
                time.sleep(0.2 * (attempt + 1))
                continue
            if status != 200:
                return self.fail(f"{kind}: HTTP {status}: {text[:200]!r}")
            results = json.loads(text)["results"]
            wrong = [f"{n}: {r.get('label') or r.get('error')}" for n, r in zip(names, results)
                     if r.get("label") != self.labels[n]]
            if len(results) != len(names) or wrong:
                return self.fail(f"{kind}: {len(results)} results for {len(names)}; wrong: {wrong[:3]}")
            with self.lock:
                self.answered += 1
                self.answered_by[pod] = self.answered_by.get(pod, 0) + 1
                self.images += len(names)
                self.latencies[kind].append(time.time() - started)
                self.done.append((time.time(), len(names)))
            return
        self.fail(f"{kind}: 503 twenty times")

    def fail(self, why):
        with self.lock:
            self.failures.append(why)

    def run(self, kind, clients, until):
        def client(c):
            i = c
            while time.time() < until:
                self.one(kind, i)
                i += clients
        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
        for t in threads:
            t.start()
        return threads


# --- the run ---------------------------------------------------------------------------------------

def expected_labels(replica, photos):
    labels = {}
    for p in photos:
        body, ctype = multipart([(p.name, p.read_bytes())])
        r = requests.post(f"{replica.server.base}/predict", data=body, headers={"Content-Type": ctype}, timeout=60)
        r.raise_for_status()
        labels[p.name] = r.json()["results"][0]["label"]
    return labels


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="shorter phases (the test suite's form)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "test-artifacts" / "scale-out")
    ap.add_argument("--study", action="store_true",
                    help="instead: one replica under each kind and level of load, each signal beside its throughput")
    args = ap.parse_args()
    plan = SHORT if args.short else FULL
    # A run that ends early leaves no results.json: none of an earlier run's is read as its.
    (args.out / "results.json").unlink(missing_ok=True)
    for tool in ("kubectl", "haproxy", "prometheus"):
        if not shutil.which(tool):
            sys.exit(f"scale-out: {tool} is not installed (scripts/setup.sh installs it)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="visiongate-scale-out-"))
    m = Manifests()
    photos = sorted(PHOTOS.glob("*.jpg"))
    started = []
    checks = []  # Check, in report.md's order
    stopped_clean = True
    try:
        code = study(args, m, photos, work, started) if args.study else run(args, plan, m, photos, work, started, checks)
    finally:
        for p in reversed(started):
            try:
                p.stop()
            except Exception as e:  # noqa: BLE001  (every process is stopped whatever failed)
                say(f"FAILED stopping {type(p).__name__}: {e}")
                stopped_clean = False
        for f in work.glob("*.log"):
            shutil.copy(f, args.out / f.name)
        for p in started:  # a run that failed part-way: each replica's log as it stands
            if isinstance(p, Server) and not (args.out / "visiongate-0.log").exists():
                shutil.copy(p.log_path, args.out / f"server-{p.port}.log")
        shutil.rmtree(work, ignore_errors=True)
    if checks:
        write_results(args, plan, checks, stopped_clean)
    return code if stopped_clean else 1


class Check:
    """One check of the run: `key` names it in results.json, `what` and `detail` in
    report.md; `values`: the numbers it judged, as measured."""

    def __init__(self, key, what, passed, detail, **values):
        self.key, self.what, self.passed, self.detail, self.values = key, what, bool(passed), detail, values

    def result(self):
        return {"check": self.key, "name": self.what, "passed": self.passed, "values": self.values}


def write_results(args, plan, checks, stopped_clean):
    """OUT/results.json: the checks as data, for tests/python/test_scale_out.py to assert
    on one by one (report.md says the same for people)."""
    results = {"run": "short" if args.short else "full", "plan": plan, "replicas": args.replicas,
               "stopped_clean": stopped_clean, "passed": stopped_clean and all(c.passed for c in checks),
               "checks": [c.result() for c in checks]}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    say(f"results: {args.out / 'results.json'}")


def seed_bucket(s3, m):
    """The bundled repository (its TorchScript classifier) into the Deployment's bucket."""
    say(f"S3 (moto) with the bundled repository at s3://{m.bucket}/{m.prefix}")
    for path in sorted((ROOT / "models").rglob("*")):
        if path.is_file() and path.suffix not in (".onnx", ".pt2", ".stamp"):
            s3.upload(m.bucket, m.prefix, [(path.relative_to(ROOT / "models").as_posix(), path)])


def run(args, plan, m, photos, work, started, checks):
    s3 = S3()
    started.append(s3)
    seed_bucket(s3, m)
    replicas = [Replica(i, m, s3, work) for i in range(args.replicas)]
    for r in replicas:
        say(f"starting {r.name} with the Deployment's args: {' '.join(m.replica_args(r.mounts))}")
        r.start()
        started.append(r.server)
    balancer = Balancer(replicas, m, work)
    started.append(balancer.process)
    prom = Prometheus(replicas, m.rules, m.namespace, work)
    started.append(prom.process)
    labels = expected_labels(replicas[0], photos)
    load = Load(balancer.port, labels, photos)
    hpa = Autoscaler(m, len(replicas))
    rows, events = [], []
    t0 = time.time()
    phase = {"name": "idle"}

    def sample():
        names = [r.name for r in replicas]
        values = prom.query(m.adapter_query(names))
        ratio = prom.query("visiongate:queue_per_compute:ratio_rate1m")
        pending_req = prom.query(f'sum by (pod) (nv_inference_pending_request_count{{namespace="{m.namespace}"}})')
        now = time.time() - t0
        per_pod = {n: values.get(n, float("nan")) for n in names}
        raw, stabilized = hpa.desired(len(replicas), per_pod, now)
        row = {"t": round(now, 1), "phase": phase["name"], "signal_sum": sum(v for v in per_pod.values() if not math.isnan(v)),
               **{f"signal_{n}": per_pod[n] for n in names},
               "queue_per_compute": max(ratio.values(), default=0.0),
               "pending_requests": sum(pending_req.values()), "wanted": raw, "wanted_stabilized": stabilized}
        rows.append(row)

    sampling = threading.Event()

    def sampler():
        while not sampling.is_set():
            try:
                sample()
            except Exception as e:  # noqa: BLE001  (a missed sample is reported, not fatal)
                say(f"sample failed: {e}")
            sampling.wait(HPA_PERIOD_S)

    threading.Thread(target=sampler, daemon=True).start()

    def phase_run(name, seconds, kind=None, clients=0, during=None):
        phase["name"] = name
        events.append((time.time() - t0, f"{name} starts"))
        say(f"phase {name}: {seconds} s" + (f", {clients} clients of {kind}" if kind else ""))
        until = time.time() + seconds
        threads = load.run(kind, clients, until) if kind else []
        if during:
            during()
        while time.time() < until:
            time.sleep(0.5)
        for t in threads:
            t.join(timeout=300)
        return threads

    # -- the rolling model update: a new version in the bucket, every replica serving it --
    update = {}

    def upload_new_version():
        time.sleep(5)
        key_src = ROOT / "models" / "classifier" / "1" / "model.pt"
        at = time.time()
        s3.upload(m.bucket, m.prefix, [("classifier/2/model.pt", key_src)])
        events.append((at - t0, "classifier version 2 uploaded"))
        say("classifier version 2 uploaded to the bucket")
        deadline = at + 3 * m.poll_s + 60
        waiting = set(r.name for r in replicas)
        while waiting and time.time() < deadline:
            for r in replicas:
                if r.name in waiting and "2" in r.served_versions():
                    update[r.name] = time.time() - at
                    waiting.discard(r.name)
            time.sleep(0.5)
        say(f"version 2 served after (s): {update}")

    # -- a replica drained as Kubernetes stops a pod, then started again --
    drain = {}

    def drain_replica():
        try:
            stop_and_restart()
        except Exception as e:  # noqa: BLE001  (a check below fails on it)
            drain["error"] = f"{type(e).__name__}: {e}"
            say(f"drain: {drain['error']}")

    def stop_and_restart():
        time.sleep(15)
        # The replica holding the most images: its requests under way must all be answered.
        held = {r.name: r.pending_images() for r in replicas}
        r = max(replicas, key=lambda r: held[r.name])
        drain["pending_images_at_stop"] = held[r.name]
        drain["replica"] = r.name
        at = time.time()
        events.append((at - t0, f"{r.name} stopped"))
        balancer.remove(r)  # the endpoints controller takes the pod out of the Service
        time.sleep(m.pre_stop_s)  # preStop: sleep
        r.server.proc.send_signal(signal.SIGTERM)
        try:
            code = r.server.proc.wait(timeout=m.grace_s)
        except subprocess.TimeoutExpired:
            r.server.proc.kill()
            code = "killed at the grace period"
        drain.update(exit_code=code, stop_s=round(time.time() - at, 1))
        started.remove(r.server)
        r.server.stop()  # its log closed and read: a panic fails the run
        shutil.copy(r.server.log_path, work / f"{r.name}-before-restart.log")
        say(f"{r.name} exited {code} {drain['stop_s']} s after its stop began; starting it again")
        r.start()
        started.append(r.server)
        balancer.set_address(r)
        drain["balancer_checked_up_s"] = round(balancer.restore(r), 1)
        prom.retarget()
        drain["back_s"] = round(time.time() - at, 1)
        events.append((time.time() - t0, f"{r.name} ready again"))

    updater = threading.Thread(target=upload_new_version, daemon=True)
    drainer = threading.Thread(target=drain_replica, daemon=True)
    phase_run("idle", plan["idle"])
    phase_run("singles", plan["singles"], "single", plan["single_clients"], during=updater.start)
    phase_run("uploads", plan["uploads"], "upload", plan["upload_clients"], during=drainer.start)
    updater.join(timeout=300)
    drainer.join(timeout=300)
    # The last uploads were answered: the signal falls over its minute's window.
    phase_run("cool", plan["cool"])
    sampling.set()
    time.sleep(0.5)
    for r in replicas:
        # A replica that failed to start again has its log closed: the checks say so.
        if not r.server.log.closed:
            r.server.log.flush()
        shutil.copy(r.server.log_path, work / f"{r.name}.log")

    # -- checks --
    def by_phase(name, key):
        return [row[key] for row in rows if row["phase"] == name]

    for name in ("singles", "uploads"):
        wanted = by_phase(name, "wanted")
        checks.append(Check(f"scales_up_under_{name}", f"replicas wanted rise above {m.min} under {name}",
                            max(wanted, default=0) > m.min, f"max {max(wanted, default=0)}",
                            max_wanted=max(wanted, default=None), min_replicas=m.min, samples=len(wanted)))
    last = rows[-1]["wanted"] if rows else None
    checks.append(Check("scales_back_down", f"replicas wanted back to the minimum ({m.min}) after the load",
                        last == m.min, f"last {last}", last_wanted=last, min_replicas=m.min, samples=len(rows)))
    checks.append(Check("no_request_failed", "every request answered, no failure but retried 503s", not load.failures,
                        f"{len(load.failures)} failures: {load.failures[:5]}",
                        failures=len(load.failures), first_failures=load.failures[:5], sent=load.sent,
                        answered=load.answered, images=load.images, retried_503=load.retried_503,
                        refused_by=load.refused_by))
    update_limit_s = m.poll_s + 30
    checks.append(Check("new_version_served_everywhere",
                        f"every replica served version 2 within the poll period ({m.poll_s} s) and its load",
                        len(update) == len(replicas) and max(update.values()) <= update_limit_s,
                        json.dumps({k: round(v, 1) for k, v in update.items()}),
                        served_after_s={k: round(v, 1) for k, v in update.items()}, replicas=len(replicas),
                        poll_s=m.poll_s, limit_s=update_limit_s))
    refused_by_drained = load.refused_by.get(drain.get("replica"), 0)
    checks.append(Check("drained_replica_answered_its_requests",
                        "the drained replica held requests, answered them (no 503 from it) and exited 0 within its grace period",
                        drain.get("exit_code") == 0 and drain.get("pending_images_at_stop", 0) > 0
                        and not refused_by_drained, json.dumps(drain),
                        **drain, refused_503=refused_by_drained, grace_s=m.grace_s))
    checks.append(Check("drained_replica_back", "the drained replica started again and passed the balancer's health checks",
                        "back_s" in drain and "error" not in drain, json.dumps(drain), **drain))
    write_report(args, plan, m, rows, events, load, update, drain, checks, t0)
    ok = all(c.passed for c in checks)
    for c in checks:
        say(f"{'ok  ' if c.passed else 'FAIL'} {c.what}: {c.detail}")
    return 0 if ok else 1


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# --- which signal tracks saturation: one replica under each kind of load ----------------------

STUDY_LEVELS = [("single", c) for c in (1, 4, 16, 48)] + [("upload", u) for u in (1, 2, 3)] + [
    ("large", c) for c in (1, 8, 32)]
LARGE = ROOT / "tests" / "fixtures" / "photos" / "large"
KIND_NAMES = {"single": "1 small photo", "upload": f"{UPLOAD_FILES} small photos", "large": "1 photo of 12 MP"}


def scrape(port):
    """The classifier's series and the decode threads' backlog from a replica's /metrics."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if "{" in series and 'model="classifier"' not in series:
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out


def held_images(series):
    """The images a replica holds, from `scrape`: the signal's two gauges."""
    return series.get("visiongate_decode_pending_images", 0.0) + series.get("visiongate_pending_rows", 0.0)


def study(args, m, photos, work, started):
    """One replica, each load held for STUDY_S seconds; over its last STUDY_WINDOW_S: the
    images inferred per second (saturation: where it stops rising), and each candidate
    signal: the images held (decoding or queued), queue time per compute time, pending
    requests."""
    settle, window = (10, 20) if args.short else (10, 30)
    s3 = S3()
    started.append(s3)
    seed_bucket(s3, m)
    replica = Replica(0, m, s3, work).start()
    started.append(replica.server)
    large = sorted(LARGE.glob("*.jpg"))
    load = Load(replica.server.port, expected_labels(replica, photos + large), photos, large)
    results = []
    for kind, clients in STUDY_LEVELS:
        say(f"study: {clients} clients of {kind}")
        start, before = time.time(), len(load.latencies[kind])
        threads = load.run(kind, clients, start + settle + window)
        time.sleep(settle)
        samples = []
        while time.time() < start + settle + window:
            samples.append((time.time(), scrape(replica.server.metrics_port)))
            time.sleep(1)
        for t in threads:
            t.join(timeout=600)
        (t0, a), (t1, b) = samples[0], samples[-1]
        delta = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}

        def mean(*names):
            return sum(sum(s.get(n, 0.0) for n in names) for _, s in samples) / len(samples)

        results.append({
            "load": f"{clients} x {KIND_NAMES[kind]}",
            "images_per_s": delta["nv_inference_count"] / (t1 - t0),
            "pending_images": sum(held_images(s) for _, s in samples) / len(samples),
            "queue_per_compute": delta["nv_inference_queue_duration_us"] / max(delta["nv_inference_compute_infer_duration_us"], 1),
            "pending_requests": mean("nv_inference_pending_request_count"),
            "latency_p50_s": percentile(load.latencies[kind][before:], 0.5),
        })
        say(f"study: {json.dumps(results[-1])}")
    if load.failures:
        raise RuntimeError(f"study: {load.failures[:5]}")
    lines = ["# Which signal tracks saturation: one replica", "",
             f"CPU: {cpu_model()}, {os.cpu_count()} cores; the Deployment's container on loopback, each load for "
             f"{settle + window} s, measured over its last {window} s from the replica's /metrics every second.", "",
             "| load | images inferred per s | images held (mean) | queue / compute | pending requests (mean) | latency p50, s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['load']} | {r['images_per_s']:.1f} | {r['pending_images']:.1f} | {r['queue_per_compute']:.2f} | "
              f"{r['pending_requests']:.1f} | {r['latency_p50_s']:.2f} |" for r in results]
    (args.out / "study.md").write_text("\n".join(lines) + "\n")
    say(f"study: {args.out / 'study.md'}")
    return 0


def write_report(args, plan, m, rows, events, load, update, drain, checks, t0):
    out = args.out
    if not rows:
        (out / "report.md").write_text("# Scale-out: no sample of Prometheus succeeded\n")
        return
    with open(out / "series.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for key in [k for k in rows[0] if k.startswith("signal_visiongate")]:
        a1.plot(t, [r[key] for r in rows], label=key.removeprefix("signal_"))
    a1.axhline(m.target, color="grey", ls="--", label=f"target per pod ({m.target:g})")
    a1.set_ylabel(f"{m.metric}\n(images, avg 1m)")
    a1.legend(fontsize=7, loc="upper right")
    a2.plot(t, [r["queue_per_compute"] for r in rows], label="queue/compute (max over pods)")
    a2.plot(t, [r["pending_requests"] for r in rows], label="nv_inference_pending_request_count (sum)")
    a2.set_ylabel("Triton's signals")
    a2.legend(fontsize=7, loc="upper right")
    a3.step(t, [r["wanted"] for r in rows], where="post", label="wanted (formula, tolerance)")
    a3.step(t, [r["wanted_stabilized"] for r in rows], where="post", ls=":",
            label=f"set, after the {m.down_window_s} s scale-down window")
    a3.set_ylabel("replicas wanted")
    a3.set_xlabel("seconds")
    a3.legend(fontsize=7, loc="upper right")
    for ax in (a1, a2, a3):
        for at, what in events:
            ax.axvline(at, color="k", lw=0.5, alpha=0.4)
    for at, what in events:
        a1.annotate(what, (at, a1.get_ylim()[1]), rotation=90, fontsize=6, va="top", ha="right")
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=100)

    def stat(name, key, f):
        vals = [r[key] for r in rows if r["phase"] == name]
        return f(vals) if vals else float("nan")

    lines = [
        "# Scale-out, live on loopback", "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; {len(rows)} samples every {HPA_PERIOD_S} s; "
        f"{'short' if args.short else 'full'} run: {json.dumps(plan)}", "",
        f"HPA: {m.metric}, AverageValue {m.target:g}, min {m.min}, max {m.max}, tolerance {HPA_TOLERANCE}, "
        f"scale-down window {m.down_window_s} s; Prometheus scrape and rules every {SCRAPE_S} s.", "",
        "| phase | images answered per s | signal, sum over pods (max) | queue/compute (max) | pending requests (max) "
        "| wanted (max) | wanted at end |",
        "|---|---|---|---|---|---|---|",
    ]
    spans = [(at, what.removesuffix(" starts")) for at, what in events if what.endswith(" starts")]
    for (start, name), (end, _) in zip(spans, spans[1:] + [(rows[-1]["t"] if rows else 0, "")]):
        answered = sum(n for at, n in load.done if start <= at - t0 < end)
        rate = answered / (end - start) if end > start else float("nan")
        lines.append(f"| {name} | {rate:.1f} | {stat(name, 'signal_sum', max):.1f} | {stat(name, 'queue_per_compute', max):.2f} | "
                     f"{stat(name, 'pending_requests', max):.0f} | {stat(name, 'wanted', max)} | "
                     f"{stat(name, 'wanted', lambda v: v[-1])} |")
    lines += [
        "", "Requests (through the balancer, each answer checked label by label):", "",
        f"- sent {load.sent}, answered {load.answered} ({load.images} images), 503s retried {load.retried_503} "
        f"(by pod: {json.dumps(load.refused_by)}), failed {len(load.failures)}; answered by pod: "
        f"{json.dumps(dict(sorted(load.answered_by.items())))}",
        f"- single image latency p50 {percentile(load.latencies['single'], 0.5):.3f} s, p99 {percentile(load.latencies['single'], 0.99):.3f} s; "
        f"1000-photo upload p50 {percentile(load.latencies['upload'], 0.5):.1f} s, max {max(load.latencies['upload'], default=float('nan')):.1f} s",
        f"- version 2 served after (s, from its upload): {json.dumps({k: round(v, 1) for k, v in update.items()})}",
        f"- drained replica: {json.dumps(drain)}",
        "", "Events (s): " + "; ".join(f"{at:.0f} {what}" for at, what in events), "",
        "Checks:", "",
    ]
    lines += [f"- {'ok' if c.passed else 'FAILED'}: {c.what} ({c.detail})" for c in checks]
    lines += ["", "![signal and replicas wanted](report.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    say(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    sys.exit(main())
