"""Triton's server arguments, as Kubernetes manifests for `tritonserver` pass them, start
and serve the real binary; the ones visiongate cannot honour are accepted with a log line,
and malformed or unknown ones fail before anything starts."""

import os
import shutil
import socket
import subprocess

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server, free_port, link_file


def top1(base, photo, headers=None):
    with open(photo, "rb") as f:
        r = requests.post(base + "/predict", files=[("files", (photo.name, f))], headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["top_k"][0]["label"]


def run_binary(*args, cwd=ROOT, timeout=60):
    """Runs the binary to its exit: (exit status, output)."""
    p = subprocess.run([os.environ["VISIONGATE_BIN"], *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_a_manifest_with_strict_model_config_and_log_verbose_serves(server, all_photos):
    photo = all_photos[0]
    # Exactly the manifest's arguments (a relative repository, as in a container's working
    # directory), only the ports are the test's.
    s = Server("--model-repository=models", "--strict-model-config=false", "--log-verbose=1", repository=False, cwd=ROOT)
    try:
        assert top1(s.base, photo) == top1(server.base, photo)
        log = s.log_path.read_text()
        assert "--strict-model-config / --disable-auto-complete-config: accepted, no effect" in log
        assert "DEBUG" in log and "batch ran" in log  # --log-verbose=1: visiongate's debug lines
    finally:
        s.stop()


# The seeds' classifier config (the FastAPI + Triton deployment visiongate replaces), as it
# is written there: max_batch_size is what the model takes, 4096 rows, far more than one
# batch's memory bound; Triton loads it, and so must visiongate.
SEEDS_CLASSIFIER = """name: "classifier"
platform: "pytorch_libtorch"
max_batch_size: 4096
input [
  {
    name: "input__0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "output__0"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }
]
instance_group [
  {
    count: 2
    kind: KIND_GPU
  }
]
dynamic_batching {
  preferred_batch_size: [ 32, 64, 128, 256, 512, 1024 ]
  max_queue_delay_microseconds: 100
}
"""


def seeds_repository(tmp_path):
    repo = tmp_path / "model_repository"
    (repo / "classifier" / "1").mkdir(parents=True)
    (repo / "classifier" / "config.pbtxt").write_text(SEEDS_CLASSIFIER)
    # The model's files inside its directory (a link out of it is refused).
    shutil.copy(ROOT / "models" / "classifier" / "labels.txt", repo / "classifier" / "labels.txt")
    link_file(ROOT / "models" / "classifier" / "1" / "model.pt", repo / "classifier" / "1" / "model.pt")
    for m in ("preprocessor", "ensemble_model"):
        (repo / m).symlink_to(ROOT / "models" / m)
    return repo


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_the_seeds_classifier_config_and_arguments_start_and_serve(server, all_photos, tmp_path, mode):
    repo = seeds_repository(tmp_path)
    args = [f"--model-repository={repo}", "--strict-model-config=false", "--log-verbose=1"]
    if mode == "poll":
        args += ["--model-control-mode=poll", "--repository-poll-secs=5"]
    s = Server(*args, repository=False)
    try:
        for photo in all_photos[:3]:
            assert top1(s.base, photo) == top1(server.base, photo)
        config = requests.get(s.base + "/v2/models/classifier/config", timeout=10).json()
        assert config["max_batch_size"] == 4096
        log = s.log_path.read_text()
        assert "the batches this server forms hold at most 445 rows" in log, log[-3000:]
        assert "--max-batch-bytes 268435456" in log
        # Triton's clients read the config as written.
        c = httpclient.InferenceServerClient(s.http_url)
        assert c.get_model_config("classifier")["max_batch_size"] == 4096
    finally:
        s.stop()


def test_poll_mode_manifest_serves_with_tritons_other_arguments(server, all_photos, tmp_path):
    # Two repositories: the classifier in one, the preprocessor and the ensemble in another.
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "classifier").symlink_to(ROOT / "models" / "classifier")
    for m in ("preprocessor", "ensemble_model"):
        (two / m).symlink_to(ROOT / "models" / m)
    s = Server(
        "--model-control-mode=poll", "--repository-poll-secs=30",
        f"--model-repository={one}", "--model-store", str(two),
        "--id=triton-prod", "--http-thread-count=2", "--exit-timeout-secs=10",
        "--allow-gpu-metrics=false", "--log-info=true", "--log-format=ISO8601",
        "--cache-config=local,size=1048576", "--backend-config=pytorch,enable-nvfuser=false",
        "--pinned-memory-pool-byte-size=268435456", "--cuda-memory-pool-byte-size=0:67108864",
        "--min-supported-compute-capability=7.0", "--strict-readiness=true",
        "--http-restricted-api=model-repository,statistics,shared-memory:admin-key=s3cret",
        "--allow-client-shm=true",
        "--grpc-restricted-protocol=inference:infer-key=t0ken",
        repository=False,
    )
    try:
        photo = all_photos[0]
        assert top1(s.base, photo) == top1(server.base, photo)
        assert requests.get(s.base + "/v2", timeout=10).json()["name"] == "triton-prod"
        log = s.log_path.read_text()
        for flag in ("--backend-config", "--pinned-memory-pool-byte-size", "--cuda-memory-pool-byte-size",
                     "--min-supported-compute-capability"):
            assert f"{flag}: accepted, no effect" in log, flag

        # HTTP: the restricted groups answer 403 with a JSON body naming the header.
        for path in ("/v2/models/stats", "/v2/models/classifier/stats", "/v2/systemsharedmemory/status"):
            r = requests.get(s.base + path, timeout=10)
            assert r.status_code == 403 and "admin-key" in r.json()["error"], (path, r.text)
            r = requests.get(s.base + path, headers={"Admin-Key": "s3cret"}, timeout=10)
            assert r.status_code == 200, (path, r.text)
        r = requests.post(s.base + "/v2/repository/index", json={}, timeout=10)
        assert r.status_code == 403
        # Percent-encoded letters reach the same routes: they are restricted too.
        import http.client

        for method, path in [("POST", "/v2/%72epository/index"), ("GET", "/v2/models/classifier/%73tats"),
                             ("POST", "/v2/repository/models/classifier/%75nload")]:
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            answer = conn.getresponse()
            assert answer.status == 403, (path, answer.status, answer.read())
            conn.close()
        h = httpclient.InferenceServerClient(s.http_url)
        assert {m["name"] for m in h.get_model_repository_index(headers={"admin-key": "s3cret"})} == {
            "classifier", "ensemble_model", "preprocessor"}
        # Not restricted over HTTP: inference.
        assert h.is_server_ready()

        # gRPC: inference needs Triton's prefixed metadata key; the rest is open.
        g = grpcclient.InferenceServerClient(s.grpc_url)
        assert g.is_server_ready() and g.get_server_metadata().name == "triton-prod"
        with open(photo, "rb") as f:
            data = f.read()
        import numpy as np

        batch = np.frombuffer(data, dtype=np.uint8).reshape(1, -1)
        inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
        inp.set_data_from_numpy(batch)
        with pytest.raises(InferenceServerException) as e:
            g.infer("ensemble_model", [inp], headers={"infer-key": "t0ken"})
        assert "triton-grpc-protocol-infer-key" in e.value.message()
        out = g.infer("ensemble_model", [inp], headers={"triton-grpc-protocol-infer-key": "t0ken"})
        assert out.as_numpy("output__0").shape == (1, 1000)
    finally:
        s.stop()


def test_a_model_that_fails_at_start_up_exits_unless_told_otherwise(tmp_path):
    repo = tmp_path / "repo"
    (repo / "broken").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('backend: "pytorch"\nmax_batch_size: "many"\n')
    code, out = run_binary(f"--model-repository={repo}", "--http-port=0", "--grpc-port=0", "--metrics-port=0",
                           "--host=127.0.0.1")
    assert code == 1, out
    assert "broken" in out and "--exit-on-error=false" in out
    s = Server(f"--model-repository={repo}", "--exit-on-error=false", repository=False)
    try:
        assert requests.get(s.base + "/v2/health/live", timeout=10).json() == {"live": True}
        index = requests.post(s.base + "/v2/repository/index", json={}, timeout=10).json()
        assert [(m["name"], m["state"]) for m in index] == [("broken", "UNAVAILABLE")]
    finally:
        s.stop()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--no-such-flag"], "--no-such-flag"),
        (["--allow-http", "--log-verbose=1"], "--allow-http"),
        (["--allow-grpc=yes"], "invalid value for bool option"),
        (["--load-model=ensemble_model"], "--model-control-mode=explicit"),
        (["--http-restricted-api=everything:k=v"], "unknown restricted api 'everything'"),
        (["--grpc-restricted-protocol=inference"], "<api>[,<api>...]:<header>=<key>"),
        (["--cache-config=redis,host=localhost"], "'local' cache only"),
        (["--cache-config=local,size=1", "--response-cache-byte-size=1"], "both given"),
        (["--log-format=json"], "--log-format"),
        (["--model-repository=no/such/dir"], "is not a directory"),
    ],
)
def test_bad_arguments_fail_before_anything_starts(args, says):
    code, out = run_binary(*args, "--http-port=0", "--grpc-port=0", "--metrics-port=0", timeout=30)
    assert code != 0 and says in out, out


@pytest.mark.parametrize("taken", ["--http-port", "--grpc-port", "--metrics-port"])
def test_a_port_in_use_fails_the_start_with_exit_status_1(taken):
    # A restarted pod whose old process still holds a port: a clear error and status 1,
    # not a crash while the models are still loading (RUST_BACKTRACE=1 slows the error's
    # path enough that the models are loading when the process ends).
    ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port")}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[taken]))
        holder.listen()
        args = [os.environ["VISIONGATE_BIN"], "--host", "127.0.0.1", "--model-repository", str(ROOT / "models")]
        for flag, port in ports.items():
            args += [flag, str(port)]
        p = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, "RUST_BACKTRACE": "1"})
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "Address already in use" in p.stderr, p.stderr[-2000:]
