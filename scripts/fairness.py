"""How long a single-image /predict waits while someone else uploads many large photos
(`make fairness`): its latency percentiles alone, then during a 1000-photo upload, on the
real binary with the bundled models. Issue 13's target: p99 during the upload within 3x
the p99 alone.

Standard library only, so the GPU kit carries it (`gpu-kit/fairness.py`) to hosts with
more cores: `python3 fairness.py --binary ./visiongate --models ./models --photos ./photos`.
Arguments after `--` go to the server."""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentiles(xs):
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"n": len(xs), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": xs[-1]}


def predict(base, files, timeout):
    """POST /predict with `files` [(name, bytes)]: the status."""
    boundary = uuid.uuid4().hex
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n"
        for name, data in files
    ) + f"--{boundary}--\r\n".encode()
    req = urllib.request.Request(base + "/predict", data=body,
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        json.load(r)
        return r.status


def singles(base, image, until=None, count=None):
    """Sequential one-image requests: their latencies in ms."""
    out = []
    while (count is None or len(out) < count) and (until is None or not until.is_set()):
        start = time.perf_counter()
        predict(base, [("one.jpg", image)], 600)
        out.append((time.perf_counter() - start) * 1000)
    return out


def free_ports(n):
    """`n` loopback ports free now, all different: each is held while the next is picked, so
    the kernel cannot give one port twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_server(binary, models, extra, log_path):
    port, grpc, metrics = free_ports(3)
    log = open(log_path or Path(tempfile.mkdtemp(prefix="visiongate-fairness-")) / "server.log", "wb")
    proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics), "--model-repository", str(models), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited: {Path(log.name).read_text()}")
        try:
            with urllib.request.urlopen(base + "/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("server did not become ready")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos", type=int, default=1000, help="photos in the large upload")
    p.add_argument("--alone", type=int, default=100, help="single requests measured alone")
    p.add_argument("--binary", default=os.environ.get("VISIONGATE_BIN"), help="the server (default $VISIONGATE_BIN)")
    p.add_argument("--models", default=ROOT / "models", type=Path, help="model repository")
    p.add_argument("--photo-dir", default=ROOT / "tests" / "fixtures" / "photos", type=Path,
                   help="photos: large/ and medium/ for the upload, small/sk_chelsea.jpg alone")
    p.add_argument("--log", type=Path, help="the server's log (default: a temporary file)")
    p.add_argument("server_args", nargs="*", help="after --: the server's own flags")
    args = p.parse_args()
    if not args.binary:
        sys.exit("--binary or VISIONGATE_BIN must name the server binary")
    big = [f.read_bytes() for f in sorted((args.photo_dir / "large").glob("*.jpg"))
           + sorted((args.photo_dir / "medium").glob("*.jpg"))]
    image = (args.photo_dir / "small" / "sk_chelsea.jpg").read_bytes()
    proc, base = start_server(args.binary, args.models, args.server_args, args.log)
    try:
        singles(base, image, count=10)  # warm
        alone = percentiles(singles(base, image, count=args.alone))
        done = threading.Event()
        upload = {}

        def large_upload():
            files = [(f"{i}.jpg", big[i % len(big)]) for i in range(args.photos)]
            start = time.perf_counter()
            upload["status"] = predict(base, files, 3600)
            upload["seconds"] = time.perf_counter() - start
            done.set()

        t = threading.Thread(target=large_upload)
        t.start()
        time.sleep(1)  # the upload is under way
        during = percentiles(singles(base, image, until=done))
        t.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    size = sum(len(b) for b in big) / len(big) / 1e6
    print(f"host: {os.cpu_count()} cores; server flags: {' '.join(args.server_args) or '(defaults)'}")
    print(f"large upload: {args.photos} photos of {size:.1f} MB on average, status {upload['status']}, "
          f"{upload['seconds']:.1f} s")
    for name, s in (("alone", alone), ("during", during)):
        print(f"single image {name:>6}: n={s['n']} p50 {s['p50']:.0f} ms, p90 {s['p90']:.0f} ms, "
              f"p99 {s['p99']:.0f} ms, max {s['max']:.0f} ms")
    print(f"p99 during / alone: {during['p99'] / alone['p99']:.1f}x (target: within 3x)")


if __name__ == "__main__":
    main()
