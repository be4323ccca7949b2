"""Mixed load against the real binary, checked request by request (`make load`, `make soak`).

Starts visiongate on free loopback ports with the bundled models, learns each test photo's
label from one request alone, then sends REQUESTS requests (or runs for DURATION seconds)
from CONCURRENCY threads, drawn at random from these kinds, each with the answer it must get:

  predict        /predict, 1 photo                          200, the photo's label
  predict_batch  /predict, 2-8 photos                       200, each photo's label
  broken_file    /predict, a broken file among photos       200, an error entry for it, labels for the rest
  oversized      /predict, Content-Length over the limit    413, before any body is sent
  kserve         KServe JSON or binary, padded photos       200, classification labels
  kserve_bad     KServe, malformed JSON, shape or datatype  400
  grpc           tritonclient.grpc, padded photos           OK, classification labels
  grpc_bad       tritonclient.grpc, a wrong datatype        INVALID_ARGUMENT
  cancelled      /predict upload dropped half-way           nothing (the client left)
  slow           /predict upload in pieces, 100 ms apart     200, the photo's label
  stalled        /predict upload that stops half-way        408 once the body timeout passes

A 503 or 504 (the documented overload answers) is counted apart; any other answer, any
other 5xx, a wrong label or an exception fails the run. With --soak-png, the server's
resident memory is sampled every second and plotted, and the run fails if it grew by 5% or
more from the end of warm-up (the first quarter of the run) to the end.
"""

import argparse
import collections
import csv
import io
import json
import os
import random
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parents[1]
PHOTOS = ROOT / "tests" / "fixtures" / "photos" / "small"
sys.path.insert(0, str(ROOT / "tests" / "python"))
from conftest import Server  # noqa: E402  (starts and stops the real binary)

BODY_TIMEOUT = 3
KINDS = {  # kind: weight
    "predict": 30, "predict_batch": 10, "broken_file": 8, "oversized": 5, "kserve": 10,
    "kserve_bad": 8, "grpc": 10, "grpc_bad": 5, "cancelled": 5, "slow": 3, "stalled": 1,
}


class Wrong(Exception):
    """An answer other than the one the request must get."""


def form(files):
    """A multipart body for /predict and its boundary."""
    boundary = "vgload%016x" % random.getrandbits(64)
    out = io.BytesIO()
    for name, data in files:
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
                  f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode())
        out.write(data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), boundary


def raw_http(port, head, body_parts, pause=0.0, read=True, timeout=60):
    """Sends a request over a plain socket, `body_parts` `pause` s apart; its status."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for part in body_parts:
            if pause:
                time.sleep(pause)
            s.sendall(part)
        if not read:
            return None
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                raise Wrong("connection closed without an answer")
            answer += chunk
        return int(answer.split(b" ", 2)[1])


def post_head(path, length, boundary):
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()


class Load:
    def __init__(self, server, seed):
        self.server = server
        self.rng = random.Random(seed)
        self.photos = {p.name: p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))}
        self.labels = {}
        self.local = threading.local()

    def learn_labels(self):
        """Each photo's label from a request of its own; photos whose top two classes are
        within 0.05 of each other are left out (batching may swap them)."""
        for name, data in self.photos.items():
            r = requests.post(self.server.base + "/predict?top_k=2",
                              files=[("files", (name, data))], timeout=120)
            r.raise_for_status()
            top = r.json()["results"][0]["top_k"]
            if top[0]["score"] - top[1]["score"] > 0.05:
                self.labels[name] = top[0]["label"]
        self.names = sorted(self.labels)

    def pick(self, rng, n):
        return [rng.choice(self.names) for _ in range(n)]

    def check_predict(self, r, names, broken=()):
        if r.status_code != 200:
            raise Wrong(f"{r.status_code}: {r.text[:200]}")
        results = r.json()["results"]
        if len(results) != len(names):
            raise Wrong(f"{len(results)} results for {len(names)} files")
        for name, res in zip(names, results):
            if name in broken:
                if "error" not in res:
                    raise Wrong(f"broken file {name} got {res}")
            elif res.get("label") != self.labels.get(name):
                raise Wrong(f"{name}: {res.get('label') or res.get('error')} != {self.labels.get(name)}")

    def padded(self, names):
        arrays = [np.frombuffer(self.photos[n], dtype=np.uint8) for n in names]
        longest = max(len(a) for a in arrays)
        return np.stack([np.pad(a, (0, longest - len(a))) for a in arrays])

    def check_classes(self, rows, names):
        got = [row[0].decode().split(":", 2)[2] if isinstance(row[0], bytes)
               else row[0].split(":", 2)[2] for row in rows]
        want = [self.labels[n] for n in names]
        if got != want:
            raise Wrong(f"labels {got} != {want}")

    def grpc(self):
        if not hasattr(self.local, "grpc"):
            self.local.grpc = grpcclient.InferenceServerClient(self.server.grpc_url)
        return self.local.grpc

    # --- the kinds ------------------------------------------------------------------------
    def predict(self, rng):
        names = self.pick(rng, 1)
        r = requests.post(self.server.base + "/predict",
                          files=[("files", (n, self.photos[n])) for n in names], timeout=120)
        self.check_predict(r, names)
        return r.status_code

    def predict_batch(self, rng):
        names = self.pick(rng, rng.randint(2, 8))
        r = requests.post(self.server.base + "/predict",
                          files=[("files", (n, self.photos[n])) for n in names], timeout=300)
        self.check_predict(r, names)
        return r.status_code

    def broken_file(self, rng):
        names = self.pick(rng, 2)
        broken = rng.choice([b"\xff\xd8\xff\xe0" + os.urandom(300), b"plain text, not an image",
                             b"", self.photos[names[0]][:200]])
        files = [(names[0], self.photos[names[0]]), ("broken.jpg", broken), (names[1], self.photos[names[1]])]
        r = requests.post(self.server.base + "/predict",
                          files=[("files", f) for f in files], timeout=120)
        self.check_predict(r, [names[0], "broken.jpg", names[1]], broken={"broken.jpg"})
        return r.status_code

    def oversized(self, rng):
        status = raw_http(self.server.port, post_head("/predict", 5 << 30, "x"), [])
        if status != 413:
            raise Wrong(f"{status} for a 5 GiB Content-Length")
        return status

    def kserve(self, rng):
        names = self.pick(rng, rng.randint(1, 4))
        batch = self.padded(names)
        url = f"{self.server.base}/v2/models/ensemble_model/infer"
        output = {"name": "output__0", "parameters": {"classification": 1}}
        if rng.random() < 0.5:
            body = {"inputs": [{"name": "RAW_IMAGE", "shape": list(batch.shape), "datatype": "UINT8",
                                "data": batch.ravel().tolist()}], "outputs": [output]}
            r = requests.post(url, json=body, timeout=120)
        else:
            header = json.dumps({"inputs": [{"name": "RAW_IMAGE", "shape": list(batch.shape),
                                             "datatype": "UINT8",
                                             "parameters": {"binary_data_size": batch.size}}],
                                 "outputs": [output]}).encode()
            r = requests.post(url, data=header + batch.tobytes(), timeout=120,
                              headers={"Inference-Header-Content-Length": str(len(header))})
        if r.status_code != 200:
            raise Wrong(f"{r.status_code}: {r.text[:200]}")
        out = r.json()["outputs"][0]
        self.check_classes([[d] for d in out["data"]], names)
        return r.status_code

    def kserve_bad(self, rng):
        url = f"{self.server.base}/v2/models/ensemble_model/infer"
        body = rng.choice([
            b'{"inputs": [',
            b'{"inputs": [{"name": "RAW_IMAGE", "shape": [2, 3], "datatype": "UINT8", "data": [1, 2]}]}',
            b'{"inputs": [{"name": "RAW_IMAGE", "shape": [1], "datatype": "FP32", "data": [1.0]}]}',
            b'{"inputs": [{"name": "OTHER", "shape": [1, 1], "datatype": "UINT8", "data": [1]}]}',
            b'{"inputs": [{"name": "RAW_IMAGE", "shape": [1, 4], "datatype": "UINT8", "data": [1, 2, 3, 4]}]}',
            b'{"parameters": {"p": [1, 2]}, "inputs": []}',
        ])
        r = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
        if r.status_code != 400 or "error" not in r.json():
            raise Wrong(f"{r.status_code}: {r.text[:200]}")
        return r.status_code

    def grpc_infer(self, rng):
        names = self.pick(rng, rng.randint(1, 4))
        batch = self.padded(names)
        inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
        inp.set_data_from_numpy(batch)
        out = grpcclient.InferRequestedOutput("output__0", class_count=1)
        result = self.grpc().infer("ensemble_model", [inp], outputs=[out], client_timeout=120)
        self.check_classes(result.as_numpy("output__0"), names)
        return 200

    def grpc_bad(self, rng):
        inp = grpcclient.InferInput("RAW_IMAGE", [1, 4], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
        try:
            self.grpc().infer("ensemble_model", [inp], client_timeout=60)
        except InferenceServerException as e:
            if e.status() != "StatusCode.INVALID_ARGUMENT":
                raise Wrong(f"{e.status()}: {e.message()}")
            return 400
        raise Wrong("a wrong datatype was accepted")

    def cancelled(self, rng):
        name = self.pick(rng, 1)[0]
        body, boundary = form([(name, self.photos[name])])
        raw_http(self.server.port, post_head("/predict", len(body), boundary),
                 [body[: len(body) // 2]], read=False)
        return None

    def slow(self, rng):
        name = self.pick(rng, 1)[0]
        body, boundary = form([(name, self.photos[name])])
        parts = [body[i: i + len(body) // 5 + 1] for i in range(0, len(body), len(body) // 5 + 1)]
        status = raw_http(self.server.port, post_head("/predict", len(body), boundary), parts, pause=0.1)
        if status != 200:
            raise Wrong(f"{status} for a slow upload")
        return status

    def stalled(self, rng):
        name = self.pick(rng, 1)[0]
        body, boundary = form([(name, self.photos[name])])
        status = raw_http(self.server.port, post_head("/predict", len(body), boundary),
                          [body[: len(body) // 2]], timeout=BODY_TIMEOUT * 10)
        if status != 408:
            raise Wrong(f"{status} for a stalled upload")
        return status

    def one(self, seed):
        rng = random.Random(seed)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        run = {"grpc": self.grpc_infer}.get(kind) or getattr(self, kind)
        try:
            status = run(rng)
            return kind, "ok", status
        except Wrong as e:
            text = str(e)
            if text.startswith(("503", "504")):
                return kind, "refused", text[:3]
            return kind, "wrong", text
        except InferenceServerException as e:
            if e.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"):
                return kind, "refused", e.status()
            return kind, "wrong", f"{e.status()}: {e.message()}"
        except Exception as e:  # a transport failure: not answered
            return kind, "wrong", repr(e)


def sample_rss(pid, stop, samples, started):
    while not stop.wait(1.0):
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return
        samples.append((time.time() - started, rss / 1024))


def plot(samples, path, growth):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs, ys = zip(*samples)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([x / 60 for x in xs], ys, lw=1)
    warm = xs[-1] / 4 / 60
    ax.axvline(warm, color="grey", ls="--", lw=0.8)
    ax.text(warm, min(ys), " end of warm-up", color="grey", va="bottom")
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(0, max(ys) * 1.15)
    ax.set_title(f"visiongate under mixed load: resident memory ({growth:+.1f}% after warm-up)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10000, help="how many requests (default 10000)")
    p.add_argument("--duration", type=float, default=0,
                   help="run for this many seconds instead (requests are drawn until then)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=1800, help="the run stops by itself after this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--soak-png", help="sample resident memory and plot it here (PNG; a CSV beside it)")
    args = p.parse_args()

    server = Server("--body-timeout-secs", str(BODY_TIMEOUT))
    load = Load(server, args.seed)
    stop = threading.Event()
    samples = []
    try:
        load.learn_labels()
        print(f"{len(load.names)} of {len(load.photos)} photos have a clear label", flush=True)
        started = time.time()
        sampler = threading.Thread(target=sample_rss, args=(server.proc.pid, stop, samples, started), daemon=True)
        sampler.start()
        deadline = started + (args.duration or args.time_limit)
        counts = collections.Counter()
        wrong = []
        seeds = iter(range(args.seed * 10**9, args.seed * 10**9 + 10**9))
        submitted = 0
        limit = None if args.duration else args.requests
        with ThreadPoolExecutor(args.concurrency) as pool:
            running = set()
            while (limit is None or submitted < limit) and time.time() < deadline:
                while len(running) < args.concurrency * 2 and (limit is None or submitted < limit):
                    running.add(pool.submit(load.one, next(seeds)))
                    submitted += 1
                done = [f for f in running if f.done()]
                if not done:
                    time.sleep(0.005)
                for f in done:
                    running.remove(f)
                    kind, outcome, detail = f.result()
                    counts[(kind, outcome)] += 1
                    if outcome == "wrong":
                        wrong.append((kind, detail))
            for f in running:
                kind, outcome, detail = f.result()
                counts[(kind, outcome)] += 1
                if outcome == "wrong":
                    wrong.append((kind, detail))
        elapsed = time.time() - started
        stop.set()
        alive = server.proc.poll() is None
    finally:
        stop.set()
        server.stop()

    total = sum(counts.values())
    print(f"\n{total} requests in {elapsed:.0f} s ({total / elapsed:.0f}/s) at concurrency {args.concurrency}")
    print(f"{'kind':<14} {'ok':>7} {'503/504':>8} {'wrong':>6}")
    for kind in KINDS:
        print(f"{kind:<14} {counts[(kind, 'ok')]:>7} {counts[(kind, 'refused')]:>8} {counts[(kind, 'wrong')]:>6}")
    for kind, detail in wrong[:20]:
        print(f"WRONG {kind}: {detail}")
    failed = bool(wrong) or not alive
    if not alive:
        print("the server died during the run")
    if args.soak_png and samples:
        warm = [rss for t, rss in samples if t <= elapsed / 4]
        end = [rss for t, rss in samples if t >= elapsed * 0.9]
        base, last = warm[-1] if warm else samples[0][1], sum(end) / max(len(end), 1)
        growth = 100 * (last - base) / base
        with open(Path(args.soak_png).with_suffix(".csv"), "w", newline="") as f:
            csv.writer(f).writerows([("seconds", "rss_mib"), *samples])
        plot(samples, args.soak_png, growth)
        print(f"resident memory: {base:.0f} MiB at the end of warm-up, {last:.0f} MiB at the end "
              f"({growth:+.1f}%), peak {max(r for _, r in samples):.0f} MiB; plot: {args.soak_png}")
        failed |= growth >= 5
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
