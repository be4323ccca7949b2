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
        assert "--strict-model-config: accepted, no effect" in log
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


def make_certificates(where):
    """A test CA, a server certificate for 127.0.0.1 and localhost, and a client
    certificate, all signed by the CA: PEM files in `where`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name, key, issuer_name, issuer_key, ca=False, san=None, usage=None):
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(issuer_name)
             .public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(name, key, cert):
        (where / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (where / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "visiongate test CA")])
    ca = issue("visiongate test CA", ca_key, ca_name, ca_key, ca=True)
    write("ca", ca_key, ca)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    write("server", server_key, issue("localhost", server_key, ca_name, ca_key, san=san,
                                      usage=ExtendedKeyUsageOID.SERVER_AUTH))
    client_key = ec.generate_private_key(ec.SECP256R1())
    write("client", client_key, issue("a client", client_key, ca_name, ca_key,
                                      usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    return {f"{n}_{e}": str(where / f"{n}.{e}") for n in ("ca", "server", "client") for e in ("crt", "key")}


def grpc_top1(client, photo, model="ensemble_model"):
    import numpy as np

    batch = np.frombuffer(photo.read_bytes(), dtype=np.uint8).reshape(1, -1)
    inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_data_from_numpy(batch)
    return int(client.infer(model, [inp]).as_numpy("output__0")[0].argmax())


# Every option of `tritonserver` (the command-line parser of its server repository, release
# 2.73) but --model-repository and --help, with values a manifest would carry; the addresses,
# ports and files are the test's. The parser's whole list is also checked option by option,
# each alone, in the config module's unit tests.
def every_tritonserver_option(s_ports, certs, log_file, trace_file):
    http, grpc, metrics = s_ports
    return [
        "--id=triton-prod", "--exit-timeout-secs=30", "--exit-on-error=true",
        "--disable-auto-complete-config", "--strict-readiness=true",
        "--model-control-mode=explicit", "--repository-poll-secs=15", "--load-model=*",
        "--model-config-name=h100", "--model-load-thread-count=4", "--model-load-retry-count=2",
        "--model-namespacing=false", "--enable-peer-access=true",
        "--allow-http=true", "--http-address=127.0.0.1", f"--http-port={http}", "--reuse-http-port=true",
        "--http-header-forward-pattern=x-request-.*", "--http-thread-count=2",
        "--http-max-input-size=67108864", "--http-restricted-api=model-repository:admin-key=s3cret",
        "--allow-grpc=true", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}", "--reuse-grpc-port=true",
        "--grpc-header-forward-pattern=x-request-.*", "--grpc-infer-thread-count=2",
        "--grpc-infer-allocation-pool-size=8", "--grpc-max-response-pool-size=64",
        "--grpc-use-ssl=true", "--grpc-use-ssl-mutual=false", f"--grpc-server-cert={certs['server_crt']}",
        f"--grpc-server-key={certs['server_key']}", f"--grpc-root-cert={certs['ca_crt']}",
        "--grpc-infer-response-compression-level=none", "--grpc-keepalive-time=7200000",
        "--grpc-keepalive-timeout=20000", "--grpc-keepalive-permit-without-calls=true",
        "--grpc-http2-max-pings-without-data=2", "--grpc-http2-min-recv-ping-interval-without-data=300000",
        "--grpc-http2-max-ping-strikes=2", "--grpc-max-connection-age=3600000",
        "--grpc-max-connection-age-grace=30000", "--grpc-restricted-protocol=model-repository:admin-key=s3cret",
        "--log-verbose=0", "--log-info=true", "--log-warning=true", "--log-error=true",
        "--log-format=default", f"--log-file={log_file}",
        "--allow-sagemaker=false", "--sagemaker-port=8080", "--sagemaker-safe-port-range=8081-8082",
        "--sagemaker-thread-count=8",
        "--allow-vertex-ai=false", "--vertex-ai-port=8080", "--vertex-ai-thread-count=8",
        "--vertex-ai-default-model=ensemble_model",
        "--allow-metrics=true", "--allow-gpu-metrics=true", "--allow-cpu-metrics=true",
        "--metrics-address=127.0.0.1", f"--metrics-port={metrics}", "--metrics-interval-ms=2000",
        "--metrics-config=summary_latencies=true",
        f"--trace-config=triton,file={trace_file}", "--trace-config=level=TIMESTAMPS",
        "--trace-config=rate=1000",
        "--cache-config=local,size=1048576", "--cache-directory=/opt/tritonserver/caches",
        "--rate-limit=execution_count", "--rate-limit-resource=R1:10", "--rate-limit-resource=R2:5:0",
        "--pinned-memory-pool-byte-size=268435456", "--cuda-memory-pool-byte-size=0:67108864",
        "--cuda-virtual-address-size=0:1073741824", "--min-supported-compute-capability=6.0",
        "--buffer-manager-thread-count=0", "--host-policy=gpu_0,numa-node=0", "--model-load-gpu-limit=0:0.8",
        "--allow-client-shm=false", "--backend-directory=/opt/tritonserver/backends",
        "--backend-config=pytorch,default-max-batch-size=8", "--repoagent-directory=/opt/tritonserver/repoagents",
        "--strict-model-config=false",
        # Triton refuses it beside --cache-config, as visiongate does: alone in the unit test.
        # "--response-cache-byte-size=1048576",
        f"--trace-file={trace_file}", "--trace-level=TIMESTAMPS", "--trace-rate=1000", "--trace-count=-1",
        "--trace-log-frequency=0",
    ]


def test_every_tritonserver_option_at_once_starts_and_serves(server, all_photos, tmp_path):
    certs = make_certificates(tmp_path)
    log_file = tmp_path / "triton.log"
    ports = (free_port(), free_port(), free_port())
    args = every_tritonserver_option(ports, certs, log_file, tmp_path / "trace.json")
    args += [f"--model-repository={ROOT / 'models'}"]
    s = Server(*args, repository=False, ports=ports)
    try:
        photo = all_photos[0]
        assert top1(s.base, photo) == top1(server.base, photo)
        assert requests.get(s.base + "/v2", timeout=10).json()["name"] == "triton-prod"
        # gRPC over TLS, as tritonclient's ssl=True speaks it.
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}", ssl=True, root_certificates=certs["ca_crt"])
        assert g.is_server_ready()
        reference = grpcclient.InferenceServerClient(server.grpc_url)
        assert grpc_top1(g, photo) == grpc_top1(reference, photo)
        metrics = requests.get(f"http://127.0.0.1:{ports[2]}/metrics", timeout=10).text
        assert "nv_inference_request_success" in metrics
        # The log went to --log-file, and names each option that has no effect here.
        log = log_file.read_text()
        assert "gRPC listening" in log and "tls=true" in log
        for flag in ("--strict-model-config", "--disable-auto-complete-config", "--backend-config",
                     "--backend-directory", "--repoagent-directory", "--cache-directory",
                     "--pinned-memory-pool-byte-size", "--cuda-memory-pool-byte-size",
                     "--cuda-virtual-address-size", "--min-supported-compute-capability",
                     "--buffer-manager-thread-count", "--host-policy", "--model-load-gpu-limit",
                     "--model-load-thread-count", "--model-load-retry-count", "--model-namespacing",
                     "--enable-peer-access", "--rate-limit", "--rate-limit-resource",
                     "--http-header-forward-pattern", "--grpc-header-forward-pattern",
                     "--grpc-infer-thread-count", "--grpc-infer-allocation-pool-size",
                     "--grpc-max-response-pool-size", "--grpc-keepalive-permit-without-calls",
                     "--grpc-http2-max-pings-without-data", "--grpc-http2-min-recv-ping-interval-without-data",
                     "--grpc-http2-max-ping-strikes", "--sagemaker-port", "--vertex-ai-port",
                     "--log-format=default"):
            assert f"{flag}: accepted, no effect" in log or f"{flag} /" in log, flag
        # The trace arguments make the server's trace setting.
        assert "--trace-config: tracing" in log
        setting = requests.get(s.base + "/v2/trace/setting", timeout=10).json()
        assert setting == {"trace_level": ["TIMESTAMPS"], "trace_rate": "1000", "trace_count": "-1",
                           "log_frequency": "0", "trace_file": str(tmp_path / "trace.json"),
                           "trace_mode": "triton"}
    finally:
        s.stop()


def test_grpc_over_mutual_tls_serves_only_clients_the_root_signed(server, all_photos, tmp_path):
    certs = make_certificates(tmp_path)
    s = Server("--grpc-use-ssl-mutual=true", f"--grpc-server-cert={certs['server_crt']}",
               f"--grpc-server-key={certs['server_key']}", f"--grpc-root-cert={certs['ca_crt']}")
    try:
        photo = all_photos[1]
        reference = grpc_top1(grpcclient.InferenceServerClient(server.grpc_url), photo)
        g = grpcclient.InferenceServerClient(s.grpc_url, ssl=True, root_certificates=certs["ca_crt"],
                                             private_key=certs["client_key"], certificate_chain=certs["client_crt"])
        assert grpc_top1(g, photo) == reference
        # No client certificate, or plain text: no call gets through.
        for client in (grpcclient.InferenceServerClient(s.grpc_url, ssl=True, root_certificates=certs["ca_crt"]),
                       grpcclient.InferenceServerClient(s.grpc_url)):
            with pytest.raises(InferenceServerException):
                client.is_server_live(client_timeout=10)
        # The server keeps serving the client it trusts.
        assert g.is_server_ready()
    finally:
        s.stop()


def test_model_config_name_picks_each_models_custom_config(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models", repo, copy_function=link_file)
    custom = (ROOT / "models" / "classifier" / "config.pbtxt").read_text()
    assert "max_queue_delay_microseconds" in custom
    (repo / "classifier" / "configs").mkdir()
    (repo / "classifier" / "configs" / "h100.pbtxt").write_text(
        custom.replace("dynamic_batching {", "dynamic_batching {\n  default_queue_policy { max_queue_size: 7 }", 1))
    s = Server(f"--model-repository={repo}", "--model-config-name=h100", repository=False)
    try:
        h = httpclient.InferenceServerClient(s.http_url)
        assert h.get_model_config("classifier")["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 7
        # A model without configs/h100.pbtxt reads its config.pbtxt, as in Triton.
        assert h.get_model_config("preprocessor")["name"] == "preprocessor"
    finally:
        s.stop()


def test_http_max_input_size_bounds_kserve_bodies_not_predict_uploads(all_photos):
    photo = max(all_photos, key=lambda p: p.stat().st_size)
    size = photo.stat().st_size
    s = Server(f"--http-max-input-size={size // 2}")
    try:
        import numpy as np

        h = httpclient.InferenceServerClient(s.http_url)
        batch = np.frombuffer(photo.read_bytes(), dtype=np.uint8).reshape(1, -1)
        inp = httpclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
        inp.set_data_from_numpy(batch, binary_data=True)
        with pytest.raises(InferenceServerException) as e:
            h.infer("ensemble_model", [inp])
        assert f"larger than {size // 2} bytes" in e.value.message()
        # /predict keeps --max-body-bytes.
        assert top1(s.base, photo)
    finally:
        s.stop()


def test_a_kserve_request_to_the_preprocessor_holds_no_more_than_max_batch_bytes(all_photos):
    # Its FP32 outputs come back whole, so they cannot be cut into batches: a request of more
    # rows than --max-batch-bytes holds is refused with 413 naming the limit, before any
    # image is decoded. Two 224 x 224 rows fit here; the preprocessor's config says 64.
    row = 3 * 224 * 224 * 4
    s = Server(f"--max-batch-bytes={2 * row}")
    try:
        import numpy as np

        h = httpclient.InferenceServerClient(s.http_url)

        def request(n):
            data = [p.read_bytes() for p in all_photos[:n]]
            batch = np.array(data, dtype=np.object_).reshape(n, 1)
            inp = httpclient.InferInput("RAW_IMAGE", [n, 1], "BYTES")
            inp.set_data_from_numpy(batch, binary_data=True)
            return h.infer("preprocessor", [inp])

        assert request(2).as_numpy("PREPROCESSED_IMAGE").shape == (2, 3, 224, 224)
        with pytest.raises(InferenceServerException) as e:
            request(3)
        assert "at most 2 (the FP32 outputs --max-batch-bytes holds)" in e.value.message()
        assert e.value.status() == "413" or "413" in str(e.value), e.value
    finally:
        s.stop()
