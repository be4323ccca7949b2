"""A hostile store cannot take a repository down, fill memory, hold the control plane or
reach other hosts: moto's S3 server for keys a careless uploader makes, and a fake S3
endpoint of this test's own (an HTTP server on loopback) where moto cannot lie: an endless
listing page, a continuation that never ends, a redirect to another address, an object
that trickles. Each time the server keeps serving the models of its other repository."""

import http.server
import os
import re
import subprocess
import threading
import time

import pytest
import requests

from conftest import ROOT, Server, free_port
from test_remote_repositories import S3, S3_KEY, S3_SECRET, environment, metrics, repository_files

CONFIG = b'name: "m"\nbackend: "pytorch"\nmax_batch_size: 8\n'


class FakeS3:
    """An S3 endpoint whose bucket `b` lists one object, `repo/m/config.pbtxt`, and lies as
    `mode` says (`plain`: it does not): `endless_page` (a listing body that never ends),
    `endless_pages` (every page says there is another), `redirect` (the object answers 307 to `elsewhere`),
    `trickle` (the object's 600 bytes come one a second)."""

    def __init__(self, mode, elsewhere=None):
        self.mode, self.requests = mode, 0
        # Pages of each listing, in order.
        self.listings = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.requests += 1
                if "list-type=2" in self.path:
                    return fake.listing(self)
                return fake.get(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.elsewhere = elsewhere
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()

    def listing(self, h):
        if "continuation-token" not in h.path:
            self.listings.append(0)
        self.listings[-1] += 1
        contents = ("<Contents><Key>repo/m/config.pbtxt</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                    f"<ETag>\"e\"</ETag><Size>{600 if self.mode == 'trickle' else len(CONFIG)}</Size></Contents>")
        head = '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><Prefix>repo/</Prefix>'
        if self.mode == "endless_page":
            h.send_response(200)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            chunk = (contents * 200).encode()
            try:
                h.wfile.write(f"{len(head):x}\r\n{head}\r\n".encode())
                while True:
                    h.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except OSError:
                return
        if self.mode == "endless_pages":
            body = head + f"<IsTruncated>true</IsTruncated><NextContinuationToken>t{self.requests}</NextContinuationToken></ListBucketResult>"
        else:
            body = head + contents + "<IsTruncated>false</IsTruncated></ListBucketResult>"
        self.send(h, 200, body.encode(), "application/xml")

    def get(self, h):
        if self.mode == "redirect":
            h.send_response(307)
            h.send_header("Location", f"http://127.0.0.1:{self.elsewhere.port}/b/repo/m/config.pbtxt")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if self.mode == "trickle":
            h.send_response(200)
            h.send_header("Content-Length", "600")
            h.send_header("ETag", '"e"')
            h.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
            h.end_headers()
            try:
                for _ in range(600):
                    h.wfile.write(b"#")
                    h.wfile.flush()
                    time.sleep(1)
            except OSError:
                pass
            return
        self.send(h, 200, CONFIG, "application/octet-stream")

    @staticmethod
    def send(h, status, body, kind):
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("ETag", '"e"')
        h.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
        h.end_headers()
        h.wfile.write(body)


class Elsewhere:
    """Another address on the server's network, counting what reaches it."""

    def __init__(self):
        self.hits, self.headers = 0, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.hits += 1
                outer.headers.append(dict(self.headers))
                body = b'name: "m"\nSECRET_FROM_ELSEWHERE: 1\n'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()


def start(store, tmp_path, *args):
    """A server on the bundled repository and the fake store's `s3://127.0.0.1:<port>/b/repo`,
    serving whatever of the store it can (`--exit-on-error=false`)."""
    return Server(
        f"--model-repository={ROOT / 'models'}", f"--model-repository=s3://127.0.0.1:{store.port}/b/repo",
        "--exit-on-error=false", f"--repository-cache-dir={tmp_path / 'cache'}", *args, repository=False,
        env=environment(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_SESSION_TOKEN="session-token-1"),
    )


def serves(server, all_photos):
    files = [("files", (p.name, p.read_bytes())) for p in all_photos[:2]]
    r = requests.post(server.base + "/predict", files=files, timeout=60)
    assert r.status_code == 200 and all(x["top_k"] for x in r.json()["results"]), r.text


def run_to_exit(args, env, timeout):
    """Runs the binary to its exit: (status, output, peak resident MiB)."""
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    proc = subprocess.Popen([os.environ["VISIONGATE_BIN"], "--host", "127.0.0.1", *ports, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    out = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    killer.cancel()
    return os.waitstatus_to_exitcode(status), out, usage.ru_maxrss / 1024


def test_an_endless_listing_page_is_cut_at_its_limit_and_memory_stays_bounded(tmp_path):
    store = FakeS3("endless_page")
    try:
        code, out, peak = run_to_exit(
            [f"--model-repository=s3://127.0.0.1:{store.port}/b/repo", f"--repository-cache-dir={tmp_path}",
             "--repository-timeout-secs=20"],
            environment(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET), timeout=60)
        assert code == 1, out
        assert "a listing page was over 16777216 bytes" in out, out
        print(f"peak RSS with an endless listing page: {peak:.0f} MiB")
        assert peak < 1024, peak
    finally:
        store.stop()


def test_a_listing_that_never_ends_is_cut_after_its_page_limit(tmp_path, all_photos):
    # A store that answered well at start-up, then lists without end at a poll.
    store = FakeS3("plain")
    s = start(store, tmp_path, "--model-control-mode=poll", "--repository-poll-secs=1", "--repository-timeout-secs=120")
    try:
        store.mode, store.listings = "endless_pages", []
        deadline = time.time() + 100
        while "the listing went on past 2000 pages" not in s.log_path.read_text():
            assert time.time() < deadline, s.log_path.read_text()[-3000:]
            serves(s, all_photos)
        # Each listing reads 2000 pages, then fails; the models keep serving.
        assert store.listings[0] == 2000, store.listings
        assert 'result="too_large"' in metrics(s)
        serves(s, all_photos)
    finally:
        s.stop()
        store.stop()


def test_a_redirect_to_another_address_is_not_followed(tmp_path, all_photos):
    elsewhere = Elsewhere()
    store = FakeS3("redirect", elsewhere=elsewhere)
    s = start(store, tmp_path)
    try:
        assert elsewhere.hits == 0
        index = requests.post(s.base + "/v2/repository/index", json={}, timeout=10).text
        log = s.log_path.read_text()
        assert "SECRET_FROM_ELSEWHERE" not in index and "SECRET_FROM_ELSEWHERE" not in log
        assert "m/config.pbtxt': the store answered 307" in log, log[-3000:]
        serves(s, all_photos)
    finally:
        s.stop()
        store.stop()
        elsewhere.stop()


def test_a_trickling_object_fails_within_the_timeout_and_holds_nothing_after(tmp_path, all_photos):
    store = FakeS3("trickle")
    started = time.time()
    s = start(store, tmp_path, "--repository-timeout-secs=3")
    try:
        # The store would take 600 s; the object fails at its deadline and the server serves.
        assert time.time() - started < 30
        assert "m/config.pbtxt': not done within --repository-timeout-secs" in s.log_path.read_text()
        serves(s, all_photos)
        # Nothing of the cut download is left in the cache.
        cache = tmp_path / "cache"
        assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")], \
            sorted(map(str, cache.rglob("*")))
    finally:
        s.stop()
        store.stop()


@pytest.fixture
def s3_with_odd_keys():
    s3 = S3()
    s3.upload("odd", "repo", repository_files())
    # A key with a doubled slash (`aws s3 cp` to ".../classifier//1/"), a `.` segment and a
    # control character, beside the bundled models; and a model whose only model file has one.
    s3.put("odd", "repo/classifier//1/model.pt", b"not read")
    s3.put("odd", "repo/preprocessor/./notes", b"not read")
    s3.put("odd", "repo/classifier/bell\x07.txt", b"not read")
    config = (ROOT / "models" / "classifier" / "config.pbtxt").read_text()
    s3.put("odd", "repo/needs/config.pbtxt", config.replace('name: "classifier"', 'name: "needs"').encode())
    s3.put("odd", "repo/needs//1/model.pt", (ROOT / "models" / "classifier" / "1" / "model.pt").read_bytes())
    yield s3
    s3.stop()


def test_an_odd_key_is_left_out_named_and_counted_and_the_rest_serves(s3_with_odd_keys, tmp_path, all_photos):
    s3 = s3_with_odd_keys
    s = Server("--model-repository=s3://odd/repo", f"--repository-cache-dir={tmp_path / 'cache'}",
               "--exit-on-error=false", repository=False, env=environment(**s3.env(AWS_ENDPOINT_URL=s3.url)))
    try:
        serves(s, all_photos)
        log = s.log_path.read_text()
        for key in ("repo/classifier//1/model.pt", "repo/preprocessor/./notes", "repo/classifier/bell\\u{7}.txt",
                    "repo/needs//1/model.pt"):
            assert f"object '{key}' left out" in log, (key, log[-3000:])
        assert re.search(r'visiongate_repository_objects_skipped\{repository="s3://odd/repo"\} 4', metrics(s))
        # The model that needed one fails alone, naming it.
        index = requests.post(s.base + "/v2/repository/index", json={}, timeout=10).json()
        needs = next(m for m in index if m["name"] == "needs")
        assert needs["state"] == "UNAVAILABLE" and "'repo/needs//1/model.pt' was left out" in needs["reason"], needs
        assert {m["name"] for m in index if m.get("state") == "READY"} >= {"classifier", "preprocessor", "ensemble_model"}
    finally:
        s.stop()
