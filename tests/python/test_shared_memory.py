"""Triton's system shared memory with tritonclient's own utilities
(`tritonclient.utils.shared_memory`), over HTTP and gRPC, as Triton's shared-memory examples
use it: the client creates and fills POSIX shared-memory objects, registers regions on them,
and names the regions in its requests instead of sending tensors.

- the ensemble: RAW_IMAGE (UINT8 [N, L], the FastAPI gateway's padded bytes) read from a
  region, its FP32 scores written to another; the same scores as without shared memory;
- the preprocessor writes its FP32 [N, 3, 224, 224] output to a region and the classifier
  reads its input from that same region: the same logits as sending the tensor;
- regions are listed, bounds and sizes are checked (errors name the region or output), the
  server lets go of each object when it is unregistered; a server started without
  `--allow-client-shm=true` registers nothing;
- CUDA shared memory, on this host without GPUs: tritonclient's register call is refused with
  Triton's "GPUs not supported" (the round trip through GPU memory is the GPU kit's, and the
  server's side of it is unit-tested with GPU memory kept in host memory).
"""

import base64
import os
import re
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from conftest import Server
from test_triton_clients import PHOTO_NAMES, read_and_pad_images

BOTH = ["http", "grpc"]


@pytest.fixture(scope="module")
def shm_server():
    s = Server("--allow-client-shm=true")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def photos(all_photos):
    by_name = {p.name: p for p in all_photos if p.parent.name == "small"}
    return [by_name[n] for n in PHOTO_NAMES]


def client(kind, server):
    if kind == "http":
        return httpclient, httpclient.InferenceServerClient(server.http_url, network_timeout=300)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc_url)


class Regions:
    """Objects created with tritonclient's utilities and registered; all undone at the end."""

    def __init__(self, c, kind):
        self.c, self.kind, self.handles = c, kind, []

    def create(self, name, byte_size, register=True):
        key = f"/vg-test-{self.kind}-{name}-{os.getpid()}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        self.handles.append(handle)
        if register:
            self.c.register_system_shared_memory(name, key, byte_size)
        return handle, key

    def close(self):
        self.c.unregister_system_shared_memory()
        for h in self.handles:
            shm.destroy_shared_memory_region(h)


@pytest.fixture(params=BOTH)
def regions(request, shm_server):
    mod, c = client(request.param, shm_server)
    r = Regions(c, request.param)
    r.mod = mod
    yield r
    r.close()


def status(r):
    """Registered regions by name, from either transport."""
    if r.kind == "http":
        return {s["name"]: s for s in r.c.get_system_shared_memory_status()}
    # Protobuf's JSON form leaves out zeros and writes 64-bit numbers as strings.
    regions = r.c.get_system_shared_memory_status(as_json=True).get("regions", {})
    return {
        name: {**s, "offset": int(s.get("offset", 0)), "byte_size": int(s.get("byte_size", 0))}
        for name, s in regions.items()
    }


def output_in_shm(mod, name, region, byte_size, offset=0):
    out = mod.InferRequestedOutput(name)
    out.set_shared_memory(region, byte_size, offset)
    return out


def test_ensemble_reads_images_and_writes_scores_in_shared_memory(regions, photos):
    mod, c = regions.mod, regions.c
    batch = read_and_pad_images(photos)
    # Without shared memory: the reference.
    inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_data_from_numpy(batch)
    expected = c.infer("ensemble_model", [inp]).as_numpy("output__0")

    images, _ = regions.create("images", batch.nbytes)
    shm.set_shared_memory_region(images, [batch])
    scores_size = len(photos) * 1000 * 4
    # The scores go at an offset inside a larger region.
    scores, _ = regions.create("scores", 64 + scores_size)
    inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_shared_memory("images", batch.nbytes)
    result = c.infer(
        "ensemble_model", [inp], outputs=[output_in_shm(mod, "output__0", "scores", scores_size, 64)]
    )
    out = result.get_output("output__0")
    shape = [int(d) for d in (out["shape"] if regions.kind == "http" else out.shape)]
    assert shape == [len(photos), 1000]
    got = shm.get_contents_as_numpy(scores, np.float32, shape, offset=64)
    # Rows may run in batches of other sizes than the reference's: the last float bits
    # can differ (as between any two requests), the classes do not.
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert [int(np.argmax(s)) for s in got] == [int(np.argmax(s)) for s in expected]

    # The same photos as BYTES [N] (each element length-prefixed, as tritonclient
    # serializes them), at an offset of their region.
    encoded = serialize_byte_tensor(np.array([p.read_bytes() for p in photos], dtype=object))
    size = serialized_byte_size(encoded)
    elements, _ = regions.create("elements", 128 + size)
    shm.set_shared_memory_region(elements, [encoded], offset=128)
    inp = mod.InferInput("RAW_IMAGE", [len(photos)], "BYTES")
    inp.set_shared_memory("elements", size, offset=128)
    scores = c.infer("ensemble_model", [inp]).as_numpy("output__0")
    assert [int(np.argmax(s)) for s in scores] == [int(np.argmax(s)) for s in expected]


def test_preprocessor_output_region_is_the_classifiers_input(regions, photos):
    mod, c = regions.mod, regions.c
    batch = read_and_pad_images(photos[:2])
    images, _ = regions.create("images", batch.nbytes)
    shm.set_shared_memory_region(images, [batch])
    tensor_size = 2 * 3 * 224 * 224 * 4
    tensor, _ = regions.create("tensor", tensor_size)
    logits, _ = regions.create("logits", 2 * 1000 * 4)

    inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_shared_memory("images", batch.nbytes)
    c.infer("preprocessor", [inp], outputs=[output_in_shm(mod, "PREPROCESSED_IMAGE", "tensor", tensor_size)])

    fp32 = mod.InferInput("input__0", [2, 3, 224, 224], "FP32")
    fp32.set_shared_memory("tensor", tensor_size)
    c.infer("classifier", [fp32], outputs=[output_in_shm(mod, "output__0", "logits", 2 * 1000 * 4)])
    got = shm.get_contents_as_numpy(logits, np.float32, [2, 1000])

    # The same, with the tensors in the requests.
    inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_data_from_numpy(batch)
    pre = c.infer("preprocessor", [inp]).as_numpy("PREPROCESSED_IMAGE")
    np.testing.assert_array_equal(shm.get_contents_as_numpy(tensor, np.float32, pre.shape), pre)
    fp32 = mod.InferInput("input__0", [2, 3, 224, 224], "FP32")
    fp32.set_data_from_numpy(pre)
    expected = c.infer("classifier", [fp32]).as_numpy("output__0")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def server_holds(server, key):
    """Whether the server process has a descriptor of `key`'s object open."""
    target = "/dev/shm/" + key.lstrip("/")
    fds = Path(f"/proc/{server.proc.pid}/fd")
    return any(os.readlink(fd) == target for fd in fds.iterdir() if fd.is_symlink())


def test_regions_are_listed_and_let_go_when_unregistered(regions, shm_server):
    _, key_a = regions.create("a", 4096, register=False)
    regions.c.register_system_shared_memory("a", key_a, 1024, offset=2048)
    regions.c.register_system_shared_memory("b", key_a, 4096)
    assert status(regions) == {
        "a": {"name": "a", "key": key_a, "offset": 2048, "byte_size": 1024},
        "b": {"name": "b", "key": key_a, "offset": 0, "byte_size": 4096},
    }
    if regions.kind == "http":
        assert regions.c.get_system_shared_memory_status("a") == [
            {"name": "a", "key": key_a, "offset": 2048, "byte_size": 1024}
        ]
    assert server_holds(shm_server, key_a)
    regions.c.unregister_system_shared_memory("a")
    assert set(status(regions)) == {"b"}
    regions.c.unregister_system_shared_memory()
    assert status(regions) == {}
    assert not server_holds(shm_server, key_a)


def error_of(call):
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


def test_bad_places_are_refused_with_what_and_where(regions, photos):
    mod, c = regions.mod, regions.c
    batch = read_and_pad_images(photos[:1])
    images, key = regions.create("images", batch.nbytes)
    shm.set_shared_memory_region(images, [batch])
    regions.create("small", 100)

    # Already registered; beyond its object; an unknown object.
    assert "already in manager" in error_of(lambda: c.register_system_shared_memory("images", key, 1)).message()
    e = error_of(lambda: c.register_system_shared_memory("big", key, batch.nbytes + 1))
    assert "beyond the" in e.message()
    e = error_of(lambda: c.register_system_shared_memory("none", "/vg-no-such-object", 8))
    assert "unable to open" in e.message()

    def infer(region, size, offset=0, out=None):
        inp = mod.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
        inp.set_shared_memory(region, size, offset)
        return c.infer("ensemble_model", [inp], outputs=out)

    # Outside the region; a size that is not the shape's (refused before reading); an
    # unknown region.
    e = error_of(lambda: infer("images", batch.nbytes, offset=1))
    assert "outside" in e.message() and "'images'" in e.message()
    e = error_of(lambda: infer("images", batch.nbytes - 1))
    assert "RAW_IMAGE" in e.message() and f"needs {batch.nbytes}" in e.message(), e.message()
    e = error_of(lambda: infer("nope", batch.nbytes))
    assert "nope" in e.message()
    if regions.kind == "http":
        assert e.status() == "404"
    else:
        assert e.status() == "StatusCode.NOT_FOUND"
    # An output region too small for the scores: refused, naming the output.
    e = error_of(lambda: infer("images", batch.nbytes, out=[output_in_shm(mod, "output__0", "small", 100)]))
    assert "'output__0' (100 bytes) should be at least 4000 bytes" in e.message()


def test_regions_left_registered_are_closed_at_exit(photos):
    s = Server("--allow-client-shm=true")
    key = f"/vg-test-exit-{os.getpid()}"
    handle = shm.create_shared_memory_region("left", key, 64)
    try:
        httpclient.InferenceServerClient(s.http_url).register_system_shared_memory("left", key, 64)
        assert server_holds(s, key)
    finally:
        s.stop()
        shm.destroy_shared_memory_region(handle)
    assert s.proc.returncode == 0
    log = re.sub(r"\x1b\[[0-9;]*m", "", s.log_path.read_text())
    assert "shared-memory regions closed" in log and "regions=1" in log, log[-2000:]


@pytest.mark.parametrize("kind", BOTH)
def test_cuda_shared_memory_without_gpus_says_so(shm_server, kind):
    _, c = client(kind, shm_server)
    # What tritonclient.utils.cuda_shared_memory.get_raw_handle gives: a CUDA IPC handle's
    # 64 bytes in base64 (the gRPC client sends them decoded).
    handle = base64.b64encode(bytes(range(64)))
    e = error_of(lambda: c.register_cuda_shared_memory("gpu", handle, 0, 64))
    assert e.message() == "failed to register CUDA shared memory region: 'gpu', GPUs not supported"
    assert e.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    if kind == "http":
        assert c.get_cuda_shared_memory_status() == []
    else:
        assert c.get_cuda_shared_memory_status(as_json=True) == {}
    c.unregister_cuda_shared_memory("gpu")
    c.unregister_cuda_shared_memory()
    # A system region does not answer for a CUDA one, though they share names.
    key = f"/vg-test-cuda-{kind}-{os.getpid()}"
    h = shm.create_shared_memory_region("both", key, 64)
    try:
        c.register_system_shared_memory("both", key, 64)
        e = error_of(lambda: c.get_cuda_shared_memory_status("both"))
        assert "registered as system shared memory, not CUDA" in e.message(), e.message()
        c.unregister_cuda_shared_memory("both")
        assert "both" in status(Regions(c, kind))
        c.unregister_system_shared_memory("both")
    finally:
        shm.destroy_shared_memory_region(h)


def test_cuda_register_body_is_checked(shm_server):
    url = shm_server.base + "/v2/cudasharedmemory/region/r/register"
    for body, needle in [
        ({"raw_handle": {"b64": "%%%"}, "device_id": 0, "byte_size": 8}, "valid base64"),
        ({"device_id": 0, "byte_size": 8}, "raw_handle"),
        ({"raw_handle": {"b64": ""}, "device_id": 0}, "byte_size"),
    ]:
        r = requests.post(url, json=body, timeout=10)
        assert r.status_code == 400 and needle in r.json()["error"], (body, r.text)


@pytest.mark.parametrize("kind", BOTH)
def test_off_unless_the_server_allows_it(server, kind):
    _, c = client(kind, server)
    key = f"/vg-test-off-{kind}-{os.getpid()}"
    handle = shm.create_shared_memory_region("off", key, 64)
    try:
        e = error_of(lambda: c.register_system_shared_memory("off", key, 64))
        assert "--allow-client-shm=true" in e.message()
        assert e.status() in ("403", "StatusCode.PERMISSION_DENIED")
        assert not server_holds(server, key)
    finally:
        shm.destroy_shared_memory_region(handle)
    meta = c.get_server_metadata(**({"as_json": True} if kind == "grpc" else {}))
    assert "system_shared_memory" in meta["extensions"]
