"""Decoded images share one memory budget (--decode-memory-bytes), whatever the number of
decode threads: 8 requests at once, each with four images at the pixel limit (PNG, GIF,
WebP), on 8 decode threads, raise the server's peak resident memory by no more than the
budget and a margin for the uploads, rows and batches; every image is still answered. An
image whose decode alone needs more than the budget is refused with `image_too_large`
while the rest of its request is served."""

import io
import struct
import threading
import zlib

import requests
from PIL import Image

from conftest import PHOTOS, Server

SIDE = 5000
PIXELS = SIDE * SIDE
BUDGET = 256 << 20
# Request bodies (a few MiB), rows, batches, allocator slack.
MARGIN = 64 << 20


def encode(img, fmt, **kw):
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def rgba16_png(side):
    """A grey 16-bit RGBA PNG (8 bytes a pixel decoded), written by hand: Pillow cannot."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" + b"\x80\x00" * 4 * side
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def metric(server, name):
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return next(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " "))


def test_peak_memory_stays_within_the_decode_budget():
    rgba = Image.new("RGBA", (SIDE, SIDE), (200, 30, 40, 255))
    images = [
        ("rgba.png", encode(rgba, "PNG")),
        ("screen.gif", encode(Image.new("P", (SIDE, SIDE), 3), "GIF")),
        ("lossless.webp", encode(rgba, "WEBP", lossless=True)),
        ("lossy.webp", encode(Image.new("RGB", (SIDE, SIDE), (20, 130, 40)), "WEBP", quality=80)),
    ]
    server = Server(
        "--decode-threads", "8",
        "--max-image-pixels", str(PIXELS),
        "--decode-memory-bytes", str(BUDGET),
    )
    try:
        def predict(files):
            r = requests.post(
                server.base + "/predict",
                files=[("files", (name, data)) for name, data in files],
                timeout=300,
            )
            assert r.status_code == 200, r.text
            return r.json()["results"]

        def at_once():
            answers, failures = [], []

            def one():
                try:
                    answers.append(predict(images))
                except Exception as e:  # reported below, with the others
                    failures.append(repr(e))

            threads = [threading.Thread(target=one) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not failures, failures
            assert len(answers) == 8
            for results in answers:
                assert [r["filename"] for r in results] == [name for name, _ in images]
                assert all("error" not in r and "label" in r for r in results), results

        # Once, so the model, the threads and the allocator's arenas are warm: what is
        # measured is the server in its steady state.
        at_once()
        with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from here
        before = status(server.proc.pid, "VmRSS")
        at_once()

        rise = status(server.proc.pid, "VmHWM") - before
        print(
            f"\n8 requests x 4 images of {PIXELS / 1e6:.0f} MP on 8 decode threads: peak resident "
            f"memory rose {rise / 2**20:.0f} MiB (budget {BUDGET >> 20} MiB, "
            f"before {before / 2**20:.0f} MiB)"
        )
        assert rise <= BUDGET + MARGIN, f"peak rose {rise >> 20} MiB"
        assert metric(server, "visiongate_decode_memory_bytes") == 0

        # 25 MP of 16-bit RGBA: 200 MB decoded and 75 MB as RGB, over the budget alone.
        kite = (PHOTOS / "small" / "Kite.jpg").read_bytes()
        results = predict([("deep.png", rgba16_png(SIDE)), ("Kite.jpg", kite)])
        assert results[0]["error"]["code"] == "image_too_large", results[0]
        assert "decode memory budget" in results[0]["error"]["message"], results[0]
        assert "error" not in results[1] and "label" in results[1], results[1]
    finally:
        server.stop()
