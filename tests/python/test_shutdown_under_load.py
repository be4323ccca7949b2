"""SIGTERM under load, as Kubernetes sends it: mixed `/predict`, KServe HTTP and gRPC at
concurrency 32, plus an open `ModelStreamInfer` stream. Every request the server took
before the signal gets its full, right answer; from the signal on, readiness says 503 and
new work gets 503 `shutting_down` (gRPC UNAVAILABLE) until the listeners close; the open
stream is ended and the process exits within the exit timeout + 5 s.
"""

import signal
import threading
import time

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from conftest import Server

EXIT_TIMEOUT = 10
CONCURRENCY = 32
PHOTO_NAMES = ["sk_chelsea.jpg", "sk_coffee.jpg", "LadyBird.jpg", "Kite.jpg"]
# A request sent this long before the signal has surely reached the server.
IN_TRANSIT = 1.0


def raw_image(mod, data):
    inp = mod.InferInput("RAW_IMAGE", [1, len(data)], "UINT8")
    inp.set_data_from_numpy(np.frombuffer(data, dtype=np.uint8).reshape(1, -1))
    return inp


class Load:
    """Workers that send requests until the server stops answering, recording each."""

    def __init__(self, server, photos, expected):
        self.server = server
        self.photos = photos
        self.expected = expected
        self.records = []  # (kind, sent, outcome, detail)
        self.signal_at = None
        self.lock = threading.Lock()

    def record(self, kind, sent, outcome, detail=""):
        with self.lock:
            self.records.append((kind, sent, outcome, detail))

    def worker(self, i):
        kind = ["predict", "http", "grpc"][i % 3]
        http = httpclient.InferenceServerClient(self.server.http_url, network_timeout=60)
        grpc = grpcclient.InferenceServerClient(self.server.grpc_url)
        n = 0
        while True:
            n += 1
            names = PHOTO_NAMES[: 1 + (n + i) % 4] if kind == "predict" else [PHOTO_NAMES[(n + i) % 4]]
            sent = time.monotonic()
            try:
                outcome, detail = self.one(kind, names, http, grpc)
            except (requests.ConnectionError, HTTPConnectionClosed, OSError) as e:
                outcome, detail = "unreachable", repr(e)
            except InferenceServerException as e:
                text = f"{e.status()} {e.message()}"
                if "shutting down" in text:
                    outcome, detail = "shutting_down", text
                elif "StatusCode.UNAVAILABLE" in text or "onnect" in text:
                    outcome, detail = "unreachable", text
                else:
                    outcome, detail = "error", text
            except Exception as e:  # noqa: BLE001 - every outcome is recorded and judged
                outcome, detail = "error", repr(e)
            self.record(kind, sent, outcome, detail)
            if outcome == "unreachable" and self.signal_at is not None:
                return

    def one(self, kind, names, http, grpc):
        if kind == "predict":
            files = [("files", (n, self.photos[n], "image/jpeg")) for n in names]
            r = requests.post(self.server.base + "/predict", files=files, timeout=60)
            if r.status_code != 200:
                return self.refusal(r.status_code, r.json())
            got = [x["class_id"] for x in r.json()["results"]]
            return self.check(got, names)
        mod, client = (httpclient, http) if kind == "http" else (grpcclient, grpc)
        result = client.infer("ensemble_model", [raw_image(mod, self.photos[names[0]])])
        return self.check([int(result.as_numpy("output__0")[0].argmax())], names)

    def refusal(self, status, body):
        if status == 503 and body.get("code") == "shutting_down":
            return "shutting_down", body["error"]
        return "error", f"{status} {body}"

    def check(self, got, names):
        want = [self.expected[n] for n in names]
        return ("ok", "") if got == want else ("wrong", f"{got} != {want}")


def test_sigterm_under_load_answers_what_it_took_and_exits_in_time(all_photos):
    by_name = {p.name: p for p in all_photos if p.parent.name == "small"}
    photos = {n: by_name[n].read_bytes() for n in PHOTO_NAMES}
    server = Server("--exit-timeout-secs", str(EXIT_TIMEOUT))
    try:
        files = [("files", (n, photos[n], "image/jpeg")) for n in PHOTO_NAMES]
        body = requests.post(server.base + "/predict", files=files, timeout=120).json()
        expected = {n: r["class_id"] for n, r in zip(PHOTO_NAMES, body["results"])}

        # An open stream that has been answered once and stays open.
        stream_events = []
        streamer = grpcclient.InferenceServerClient(server.grpc_url)
        streamer.start_stream(callback=lambda result, error: stream_events.append((result, error)))
        streamer.async_stream_infer("ensemble_model", [raw_image(grpcclient, photos["Kite.jpg"])])
        deadline = time.monotonic() + 60
        while not stream_events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stream_events and stream_events[0][1] is None, stream_events

        load = Load(server, photos, expected)
        workers = [threading.Thread(target=load.worker, args=(i,), daemon=True) for i in range(CONCURRENCY)]
        for w in workers:
            w.start()
        time.sleep(4)

        load.signal_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        ready_after_signal = []
        while time.monotonic() < load.signal_at + 3:
            try:
                ready_after_signal.append(requests.get(server.base + "/v2/health/ready", timeout=1).status_code)
            except requests.ConnectionError:
                break
            if 503 in ready_after_signal:
                break
        try:
            server.proc.wait(timeout=EXIT_TIMEOUT + 5)
        except Exception:
            server.proc.kill()
            raise AssertionError(f"still running {EXIT_TIMEOUT + 5} s after SIGTERM")
        exited_after = time.monotonic() - load.signal_at
        for w in workers:
            w.join(timeout=30)
        log = server.log_path.read_text()
    finally:
        server.stop()

    assert server.proc.returncode == 0, (server.proc.returncode, log[-3000:])
    assert exited_after < EXIT_TIMEOUT + 5
    assert ready_after_signal and ready_after_signal[-1] == 503, ready_after_signal

    before = [r for r in load.records if r[1] < load.signal_at - IN_TRANSIT]
    answered_before = [r for r in before if r[2] == "ok"]
    assert len(answered_before) >= 20, f"too little load before the signal: {len(answered_before)}"
    lost = [r for r in before if r[2] != "ok"]
    assert not lost, f"requests sent before the signal without their answer: {lost[:5]}"
    bad = [r for r in load.records if r[2] in ("wrong", "error")]
    assert not bad, f"wrong answers or undocumented errors: {bad[:5]}"
    kinds_ok = {r[0] for r in answered_before}
    assert kinds_ok == {"predict", "http", "grpc"}, kinds_ok
    refused = [r for r in load.records if r[2] == "shutting_down"]
    assert refused, "new work after the signal was never answered 503 shutting_down"

    # The stream was ended by the server (UNAVAILABLE), not left hanging.
    assert len(stream_events) >= 2 and stream_events[-1][1] is not None, stream_events
    assert "shutting down" in str(stream_events[-1][1]), stream_events[-1][1]
    print(
        f"\n{len(load.records)} requests: {len(answered_before)} answered before the signal, "
        f"{sum(r[2] == 'ok' for r in load.records) - len(answered_before)} more after it, "
        f"{len(refused)} refused with shutting_down; exit {exited_after:.1f} s after SIGTERM"
    )


def test_a_second_signal_exits_at_once(all_photos):
    photo = next(p for p in all_photos if p.parent.name == "small").read_bytes()
    server = Server("--exit-timeout-secs", "60")
    try:
        # Long work under way: the first signal waits for it, the second does not.
        files = [("files", (f"{i}.jpg", photo, "image/jpeg")) for i in range(400)]
        def send():
            try:
                requests.post(server.base + "/predict", files=files, timeout=120)
            except requests.ConnectionError:
                pass  # cut off by the second signal, as it should be

        long = threading.Thread(target=send, daemon=True)
        long.start()
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None, "the first signal waits for the request under way"
        second = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=10)
        assert time.monotonic() - second < 2
        assert server.proc.returncode == 130
    finally:
        server.stop()
