"""Requests traced as Triton traces them, over every entry point: Triton's trace file
(`--trace-config triton,file=`) read as its format documents it, and OpenTelemetry's mode
against a real OTLP/HTTP receiver on loopback (below, on the official protobuf definitions
from PyPI's opentelemetry-proto): the caller's `traceparent` is the parent of the
request's span, the spans and events are Triton's, each batch is a span linked to the
requests it served; a collector that is down or slow changes nothing for clients."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import Server, free_port, require_module

PHOTO_NAMES = ["sk_chelsea.jpg", "sk_coffee.jpg", "LadyBird.jpg"]
CALLER_TRACE = "0af7651916cd43dd8448eb211c12666c"
CALLER_SPAN = "b7ad6b7169242424"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
MODEL_STAMPS = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
                "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"]


@pytest.fixture(scope="module")
def photos(all_photos):
    by_name = {p.name: p for p in all_photos if p.parent.name == "small"}
    return [by_name[n].read_bytes() for n in PHOTO_NAMES]


def padded(photos):
    arrays = [np.frombuffer(p, dtype=np.uint8) for p in photos]
    longest = max(len(a) for a in arrays)
    return np.stack([np.pad(a, (0, longest - len(a))) for a in arrays])


def infer(kind, server, model, batch, headers=None, request_id=""):
    """One tritonclient request of `model`'s one input."""
    mod = httpclient if kind == "http" else grpcclient
    c = (httpclient.InferenceServerClient(server.http_url, network_timeout=120) if kind == "http"
         else grpcclient.InferenceServerClient(server.grpc_url))
    name, dtype = {"ensemble_model": ("RAW_IMAGE", "UINT8"),
                   "classifier": ("input__0", "FP32")}[model]
    inp = mod.InferInput(name, list(batch.shape), dtype)
    inp.set_data_from_numpy(batch)
    return c.infer(model, [inp], headers=headers, request_id=request_id)


def predict(server, photos, headers=None):
    files = [("files", (f"{i}.jpg", p, "image/jpeg")) for i, p in enumerate(photos)]
    r = requests.post(server.base + "/predict", files=files, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def traces_in(records):
    """Triton's records grouped by id: each id's header and its timestamp names in order."""
    by_id = {}
    for r in records:
        t = by_id.setdefault(r["id"], {"header": None, "stamps": []})
        if "model_name" in r:
            assert t["header"] is None, f"id {r['id']} has two model records"
            assert not t["stamps"] or t["stamps"][-1][0] != "REQUEST_START"
            t["header"] = r
        else:
            assert list(r) == ["id", "timestamps"] and len(r["timestamps"]) == 1, r
            stamp = r["timestamps"][0]
            assert set(stamp) == {"name", "ns"} and isinstance(stamp["ns"], int)
            t["stamps"].append((stamp["name"], stamp["ns"]))
    return by_id


# Triton mode -------------------------------------------------------------------------------

def test_triton_mode_writes_tritons_trace_file(tmp_path, photos):
    trace_file = tmp_path / "trace.json"
    s = Server(f"--trace-config=triton,file={trace_file}", "--trace-config=level=TIMESTAMPS",
               "--trace-config=rate=1")
    try:
        infer("http", s, "ensemble_model", padded(photos), request_id="req-7")
        infer("grpc", s, "ensemble_model", padded(photos[:1]))
        predict(s, photos)
        fp32 = np.zeros((2, 3, 224, 224), dtype=np.float32)
        infer("grpc", s, "classifier", fp32)
        # Nothing is written before the stop with a log frequency of 0 until a MiB of records
        # waits (far more than these few requests').
        assert not trace_file.exists()
    finally:
        s.stop()
    records = json.loads(trace_file.read_text())
    by_id = traces_in(records)
    # Ids from 1, one per model a request ran: 3 ensembles (ensemble, preprocessor,
    # classifier) and one classifier.
    assert sorted(by_id) == list(range(1, 11)), sorted(by_id)
    tops = [by_id[i] for i in sorted(by_id) if "parent_id" not in by_id[i]["header"]]
    assert [t["header"]["model_name"] for t in tops] == ["ensemble_model"] * 3 + ["classifier"]
    assert all(t["header"]["model_version"] == 1 for t in by_id.values())
    assert tops[0]["header"]["request_id"] == "req-7"
    assert "request_id" not in tops[1]["header"]
    for i, top in enumerate(tops):
        names = [n for n, _ in top["stamps"]]
        transport = ["HTTP_RECV_START", "HTTP_RECV_END"] if "HTTP_RECV_START" in names else \
            ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END"]
        sent = ["HTTP_SEND_START", "HTTP_SEND_END"] if transport[0].startswith("HTTP") else \
            ["GRPC_SEND_START", "GRPC_SEND_END"]
        for name in transport + ["REQUEST_START", "QUEUE_START", "REQUEST_END",
                                 "INFER_RESPONSE_COMPLETE"] + sent:
            assert names.count(name) == 1, (top["header"], names)
        # In time order.
        ns = [n for _, n in top["stamps"]]
        assert ns == sorted(ns)
        assert names.index(transport[0]) < names.index("REQUEST_START") < \
            names.index("REQUEST_END") < names.index("INFER_RESPONSE_COMPLETE") < names.index(sent[0])
        # The body is read before the model runs, but for /predict (the third): its upload
        # streams while its first images decode.
        if i != 2:
            assert names.index(transport[1]) < names.index("REQUEST_START")
    # An ensemble's steps: the preprocessor's and the classifier's, each with Triton's
    # model timestamps, inside the ensemble's request.
    for top in tops[:3]:
        steps = [t for t in by_id.values() if t["header"].get("parent_id") == top["header"]["id"]]
        assert sorted(t["header"]["model_name"] for t in steps) == ["classifier", "preprocessor"]
        start = dict(top["stamps"])["REQUEST_START"]
        end = dict(top["stamps"])["REQUEST_END"]
        for step in steps:
            names = [n for n, _ in step["stamps"]]
            want = MODEL_STAMPS if step["header"]["model_name"] == "classifier" else \
                ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]
            assert names == want, (step["header"], names)
            assert all(start <= ns <= end for _, ns in step["stamps"])
    classifier = tops[3]
    assert [n for n, _ in classifier["stamps"] if not n.startswith("GRPC")] == \
        MODEL_STAMPS + ["INFER_RESPONSE_COMPLETE"]


def test_log_frequency_writes_numbered_files(tmp_path, photos):
    trace_file = tmp_path / "trace.json"
    s = Server(f"--trace-config=triton,file={trace_file}", "--trace-config=level=TIMESTAMPS",
               "--trace-config=rate=2", "--trace-config=triton,log-frequency=2")
    try:
        fp32 = np.zeros((1, 3, 224, 224), dtype=np.float32)
        for _ in range(10):
            infer("http", s, "classifier", fp32)
        # Every 2nd of 10 requests: 5 traces, two files of 2 while it runs.
        deadline = time.time() + 10
        while not (tmp_path / "trace.json.1").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert len(json.loads((tmp_path / "trace.json.0").read_text())) > 0
    finally:
        s.stop()
    counts = [len({r["id"] for r in json.loads((tmp_path / f"trace.json.{i}").read_text())})
              for i in range(3)]
    assert counts == [2, 2, 1]
    assert not trace_file.exists() and not (tmp_path / "trace.json.3").exists()


def test_every_request_at_32_at_once_is_answered_and_traced(tmp_path, photos):
    """rate=1 at c=32 over both transports and /predict: no request fails, and the trace file
    (log frequency 0) is written as traces come, a MiB at a time, and closed at stop holding
    every request's trace."""
    trace_file = tmp_path / "trace.json"
    s = Server(f"--trace-config=triton,file={trace_file}", "--trace-config=level=TIMESTAMPS",
               "--trace-config=rate=1")
    answered, errors = [], []

    def client(i):
        try:
            for j in range(32):
                kind = ("http", "grpc", "predict")[(i + j) % 3]
                if kind == "predict":
                    answered.append(predict(s, photos[:1])["results"][0]["class_id"])
                else:
                    out = infer(kind, s, "ensemble_model", padded(photos[:1]))
                    answered.append(int(np.argmax(out.as_numpy("output__0")[0])))
        except Exception as e:  # noqa: BLE001 - every failure is reported below
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # 1024 requests' records (about 1.6 MiB): the first MiB is on disk before the stop,
        # its array still open.
        deadline = time.time() + 10
        while not trace_file.exists() and time.time() < deadline:
            time.sleep(0.1)
        running = trace_file.read_text()
        assert running.startswith("[") and not running.endswith("]")
    finally:
        s.stop()
    assert not errors, errors[:3]
    assert len(answered) == 1024 and len(set(answered)) == 1
    text = trace_file.read_text()
    assert text.startswith(running) and text.endswith("]")
    tops = [t for t in traces_in(json.loads(text)).values() if "parent_id" not in t["header"]]
    # One top-level trace per request, each ended.
    assert len(tops) == 1024
    assert all("REQUEST_END" in [n for n, _ in t["stamps"]] for t in tops)


# OpenTelemetry mode ------------------------------------------------------------------------

class Receiver:
    """An OTLP/HTTP receiver: each POSTed ExportTraceServiceRequest parsed with the official
    definitions; `delay` answers slowly (a slow collector)."""

    def __init__(self, delay=0.0):
        trace_service = require_module("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
        self.spans, self.resources, self.exports = [], [], 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces"
                assert self.headers["Content-Type"] == "application/x-protobuf"
                req = trace_service.ExportTraceServiceRequest()
                req.ParseFromString(body)
                time.sleep(delay)
                with receiver.lock:
                    receiver.exports += 1
                    for rs in req.resource_spans:
                        receiver.resources.append({a.key: a.value.string_value for a in rs.resource.attributes})
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def wait_for(self, what, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                got = what(list(self.spans))
            if got:
                return got
            time.sleep(0.1)
        with self.lock:
            raise AssertionError(f"not received in {timeout} s: {[s.name for s in self.spans]}")

    def close(self):
        self.http.shutdown()


def otel_server(url, *extra):
    return Server("--trace-config=mode=opentelemetry", f"--trace-config=opentelemetry,url={url}",
                  "--trace-config=opentelemetry,resource=service.name=vg_test",
                  "--trace-config=opentelemetry,resource=test.key=test.value",
                  "--trace-config=opentelemetry,bsp_schedule_delay=100",
                  "--trace-config=level=TIMESTAMPS", *extra)


def attrs(span):
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else \
            v.int_value if v.HasField("int_value") else v.double_value
    return out


def tree_of(spans, root):
    """The spans under `root` (same trace), by parent."""
    children = {}
    for s in spans:
        if s.trace_id == root.trace_id and s.parent_span_id:
            children.setdefault(s.parent_span_id, []).append(s)
    return children


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def otel(receiver):
    # Rate 0: only requests that carry their caller's context are traced.
    s = otel_server(receiver.url, "--trace-config=rate=0")
    yield s
    s.stop()


ENTRY_POINTS = ["predict", "http", "grpc"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_callers_traceparent_is_the_parent_of_the_requests_spans(otel, receiver, photos, entry):
    trace_id = f"{ENTRY_POINTS.index(entry) + 1:02x}" + CALLER_TRACE[2:]
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01", "tracestate": "vendor=one"}
    if entry == "predict":
        predict(otel, photos + [b"not an image"], headers=headers)
    else:
        infer(entry, otel, "ensemble_model", padded(photos), headers=headers)
    want = bytes.fromhex(trace_id)
    root = receiver.wait_for(lambda spans: [s for s in spans if s.trace_id == want
                                            and s.name == "InferRequest"])[0]
    assert root.parent_span_id == bytes.fromhex(CALLER_SPAN) and root.trace_state == "vendor=one"
    children = receiver.wait_for(lambda spans: (c := tree_of(spans, root)) and
                                 len([s for s in spans if s.trace_id == want]) >= 6 and c)
    prefix = "HTTP" if entry != "grpc" else "GRPC"
    events = [e.name for e in root.events]
    assert events[0].startswith(prefix) and events[-1] == f"{prefix}_SEND_END", events
    [ensemble] = children[root.span_id]
    assert ensemble.name == "ensemble_model"
    a = attrs(ensemble)
    assert (a["triton.model_name"], a["triton.model_version"], a["triton.trace_parent_id"]) == \
        ("ensemble_model", 1, 0)
    assert [e.name for e in ensemble.events][:2] == ["REQUEST_START", "QUEUE_START"]
    steps = {s.name: s for s in children[ensemble.span_id]}
    assert set(steps) == {"preprocessor", "classifier"}
    assert attrs(steps["classifier"])["triton.trace_parent_id"] == a["triton.trace_id"]
    decode = attrs(steps["preprocessor"])
    assert decode["visiongate.decode.images"] == len(photos) + (entry == "predict")
    assert decode["visiongate.decode.bytes"] >= sum(len(p) for p in photos)
    assert 0 <= decode["visiongate.decode.slowest_image"] < len(photos) + 1
    if entry == "predict":
        # The file that is not an image: an event with its code, on the decode's span.
        [bad] = [e for e in steps["preprocessor"].events if e.name == "image_unusable"]
        bad_attrs = {x.key: x.value for x in bad.attributes}
        assert bad_attrs["code"].string_value == "invalid_image" and bad_attrs["image"].int_value == 3
        assert "row_failed" in [e.name for e in ensemble.events]
    # Each batch the classifier's rows rode in: a compute span with Triton's four
    # timestamps, linked to the batch's own span, which links back to this request.
    computes = children[steps["classifier"].span_id]
    assert computes and all(c.name == "compute" for c in computes)
    for c in computes:
        assert [e.name for e in c.events] == MODEL_STAMPS[2:6]
        [link] = c.links
        batch = receiver.wait_for(lambda spans: [s for s in spans if s.span_id == link.span_id])[0]
        assert batch.name == "batch" and not batch.parent_span_id
        assert steps["classifier"].span_id in [lk.span_id for lk in batch.links]
    assert receiver.resources[-1]["service.name"] == "vg_test"
    assert receiver.resources[-1]["test.key"] == "test.value"


def test_without_context_rate_zero_traces_nothing(otel, receiver, photos):
    before = len(receiver.spans)
    predict(otel, photos)
    infer("grpc", otel, "ensemble_model", padded(photos))
    time.sleep(1)
    assert len(receiver.spans) == before
    # A malformed context is ignored, never an error.
    predict(otel, photos, headers={"traceparent": "00-zz-11-01"})
    time.sleep(1)
    assert len(receiver.spans) == before


def test_a_large_uploads_batches_are_linked_to_it(receiver, all_photos):
    s = otel_server(receiver.url, "--trace-config=rate=1")
    try:
        small = [p.read_bytes() for p in all_photos if p.parent.name == "small"]
        upload = [small[i % len(small)] for i in range(1000)]
        known = {x.span_id for x in receiver.spans}
        predict(s, upload)
        root = receiver.wait_for(lambda spans: [x for x in spans if x.name == "InferRequest"
                                                and x.span_id not in known])[0]
        assert not root.parent_span_id
        children = receiver.wait_for(lambda spans: (c := tree_of(spans, root)) and sum(
            1 for x in spans if x.trace_id == root.trace_id and x.name == "compute") >= 8 and c)
        [ensemble] = children[root.span_id]
        classifier = [x for x in children[ensemble.span_id] if x.name == "classifier"][0]
        computes = children[classifier.span_id]
        rows = sum(attrs(c)["visiongate.batch.rows"] for c in computes)
        # Every image rode in some batch (a batch may hold other requests' rows too).
        assert len(computes) >= 8 and rows >= 1000, (len(computes), rows)
        batch_ids = {c.links[0].span_id for c in computes}
        batches = receiver.wait_for(lambda spans: (b := [x for x in spans if x.span_id in batch_ids])
                                    and len(b) == len(batch_ids) and b)
        assert all(classifier.span_id in [lk.span_id for lk in b.links] for b in batches)
    finally:
        s.stop()


@pytest.mark.parametrize("collector", ["down", "slow"])
def test_a_collector_down_or_slow_changes_nothing_for_clients(photos, collector):
    slow = Receiver(delay=20) if collector == "slow" else None
    url = slow.url if slow else f"http://127.0.0.1:{free_port()}/v1/traces"
    s = otel_server(url, "--trace-config=rate=1", "--trace-config=opentelemetry,bsp_max_queue_size=64")
    try:
        results = []

        def client(n):
            for _ in range(n):
                results.append(predict(s, photos[:1])["results"][0]["class_id"])

        started = time.time()
        threads = [threading.Thread(target=client, args=(6,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 48 and len(set(results)) == 1
        # Far from the collector's 20 s.
        assert time.time() - started < 60
        metrics = requests.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).text
        dropped = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("visiongate_trace_spans_dropped_total")}
        if collector == "down":
            deadline = time.time() + 20
            while time.time() < deadline and dropped.get(
                    'visiongate_trace_spans_dropped_total{reason="export_failed"}', 0) == 0:
                time.sleep(0.5)
                metrics = requests.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).text
                dropped = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                           if line.startswith("visiongate_trace_spans_dropped_total")}
            assert dropped['visiongate_trace_spans_dropped_total{reason="export_failed"}'] > 0
        else:
            # 48 requests of 6 spans each, a queue of 64 held by one slow export.
            assert dropped['visiongate_trace_spans_dropped_total{reason="queue_full"}'] > 0
    finally:
        stop_started = time.time()
        s.stop()
        if slow:
            slow.close()
    # The stop does not wait on the collector past its exit timeout.
    assert time.time() - stop_started < 30
