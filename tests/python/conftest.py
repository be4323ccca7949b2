"""Starts the real visiongate binary (release build, bundled repository) for the suite."""

import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
PHOTOS = ROOT / "tests" / "fixtures" / "photos"
sys.path.insert(0, str(ROOT / "scripts"))


def require_tool(name):
    """A program the test runs. Missing, the test is not run (reported as skipped), and
    under CI=true it fails: CI has every tool the suite uses (scripts/setup.sh installs
    them)."""
    if shutil.which(name):
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} is not installed: CI runs every test (scripts/setup.sh installs it)")
    pytest.skip(f"not run: needs {name} (scripts/setup.sh installs it)")


def require_module(name):
    """A Python module the test imports, returned. Missing, the test is not run (reported as
    skipped), and under CI=true it fails, as for `require_tool`: pytest.importorskip would
    skip there too."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Python module {name} is not installed ({e}): CI runs every test "
                        "(scripts/setup.sh installs it)")
        pytest.skip(f"not run: needs the Python module {name} (scripts/setup.sh installs it)")


def link_file(source, target):
    """`target` as a second name of the file `source` (a copy across file systems): a
    model reads only regular files inside its directory, never a symlink out of it."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


_HANDED_OUT = set()


def free_port():
    """A loopback port free now that no earlier call in this process handed out: the kernel
    may give one free port to two binds in a row, and a server given it twice (its HTTP
    and metrics ports, say) cannot start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class Server:
    def __init__(self, *args, repository=True, cwd=None, env=None, ports=None):
        """`args` follow the test's ports; `repository=False` leaves out the bundled
        repository (the test names its own); `cwd`: where the server runs; `env`: its
        environment (this process's when `None`); `ports`: (HTTP, gRPC, metrics) when
        `args` name them."""
        binary = os.environ.get("VISIONGATE_BIN")
        assert binary and os.path.exists(binary), "VISIONGATE_BIN must point at the built binary (make test sets it)"
        self.port, self.grpc_port, self.metrics_port = ports or (free_port(), free_port(), free_port())
        self.base = f"http://127.0.0.1:{self.port}"
        # What tritonclient's http and grpc clients take as `url`.
        self.http_url = f"127.0.0.1:{self.port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        # The log goes to a file: a pipe nobody reads would block the server once full.
        self.log_path = Path(tempfile.mkdtemp(prefix="visiongate-test-")) / "server.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "--host", "127.0.0.1",
                *([] if ports else ["--http-port", str(self.port), "--grpc-port", str(self.grpc_port),
                                    "--metrics-port", str(self.metrics_port)]),
                *(["--model-repository", str(ROOT / "models")] if repository else []),
                *args,
            ],
            cwd=cwd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            try:
                if requests.get(self.base + "/v2/health/ready", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.proc.kill()  # not left running by a failed start
        raise RuntimeError(f"server did not become ready in 120 s: {self.log_path}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        # A panic is a bug even where the server caught it and answered: none may pass unseen.
        panics = [line for line in self.log_path.read_text(errors="replace").splitlines() if "panicked at" in line]
        assert not panics, f"the server panicked ({self.log_path}):\n" + "\n".join(panics[:10])


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def all_photos():
    return sorted(PHOTOS.glob("*/*.jpg"))
