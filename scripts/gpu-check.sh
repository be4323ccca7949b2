#!/usr/bin/env bash
# visiongate's check on a GPU host, run from the folder `make gpu-kit` packs:
#   bash gpu-check.sh [--cpu] [--out DIR] [--images N] [--rounds R] [--sections LIST] [--runs REGEX]
# REGEX: only the fidelity and throughput runs whose names match ("tf32 on", "GPU 4", ...).
# R: the throughput requests each server answers one after another (default 3; the first
# can carry a GPU's one-off kernel compiles).
# LIST: which parts, comma-separated (default all: fidelity,cudashm,small,all,pt2); a later
# run with the same DIR reuses the fidelity section's CPU run.
# The binary loads the host's libtorch: the lib directory of the PyTorch that `python3`
# (or $PYTHON) imports goes first on LD_LIBRARY_PATH. It reports:
#   - the device of each classifier instance;
#   - top-1 agreement and the largest difference of any class probability between the GPU
#     path and the CPU path (CUDA hidden) on the kit's photos: with the JPEGs decoded on
#     the CPU (TF32 off and on) and on the GPU (nvJPEG);
#   - the throughput of /predict requests of N images (default 1000; R of them one after
#     another on each server) of the small photos and of all of them (mixed sizes):
#     decoded on the GPU (with --gpu-decode=true), and on the CPU with 4, 8 and
#     all-but-one decode threads, with where the images were decoded and how long that
#     took per path (the server's visiongate_decode_images_total and
#     visiongate_decode_duration_us_total) and the GPU utilisation nvidia-smi samples
#     meanwhile;
#   - the anchor: torchvision's batched decode_jpeg(..., device="cuda") on the same photos,
#     from the host's own Python;
#   - CUDA shared memory with tritonclient's utilities (the kit's client.tar.xz): the ensemble
#     reads its images from GPU memory the client shares by CUDA IPC handle and writes its
#     scores to another such region, over gRPC (tritonclient) and HTTP (its JSON), and the
#     scores are compared with the same request's without shared memory;
#   - the classifier as a .pt2 package: the kit's TorchScript converted by torch (the host's
#     release), compiled by AOTInductor for the GPU (the CPU with --cpu), its forward pass
#     timed against TorchScript's there, then served by the kit's binary (fidelity against
#     the CPU path, the small photos' throughput).
# A failed CUDA shared-memory or .pt2 section is reported and the rest still runs; the
# script then exits 1.
# --cpu runs all of it with CUDA hidden (200 images; no anchor), so the kit is tested on
# machines without a GPU: the "GPU" runs must then agree with the CPU run exactly in top-1
# and decode every image on the CPU, and registering CUDA shared memory must be refused
# with "GPUs not supported".
# The report goes to stdout and DIR/report.txt (default ./gpu-check-out), with each
# server's log beside it.
set -euo pipefail
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
cpu_only=0
out=$PWD/gpu-check-out
images=
sections=fidelity,cudashm,small,all,pt2
rounds=3
runs=.
while (($#)); do
  case $1 in
    --cpu) cpu_only=1 ;;
    --out) out=$2; shift ;;
    --images) images=$2; shift ;;
    --sections) sections=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --runs) runs=$2; shift ;;
    *) echo "usage: gpu-check.sh [--cpu] [--out DIR] [--images N] [--rounds R] [--sections LIST] [--runs REGEX]" >&2; exit 2 ;;
  esac
  shift
done
images=${images:-$((cpu_only ? 200 : 1000))}
[[ $rounds =~ ^[1-9][0-9]*$ && $images =~ ^[1-9][0-9]*$ ]] || { echo "gpu-check: --rounds and --images take a positive number" >&2; exit 2; }
for section in ${sections//,/ }; do
  [[ " fidelity cudashm small all pt2 " == *" $section "* ]] || { echo "gpu-check: no section '$section'" >&2; exit 2; }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
report=$out/report.txt
: > "$report"
say() { echo "$*" | tee -a "$report"; }

# The binary and nvJPEG travel compressed (the kit's 64 MiB): unpacked into DIR/bin.
bin=$out/bin
mkdir -p "$bin"
"$PY" - "$KIT" "$bin" <<'UNPACK'
import lzma, os, shutil, sys
kit, dest = sys.argv[1:]
for packed, name in [("visiongate.xz", "visiongate"), ("lib/libnvjpeg.so.13.xz", "libnvjpeg.so.13")]:
    with lzma.open(os.path.join(kit, packed)) as src, open(os.path.join(dest, name), "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(os.path.join(dest, "visiongate"), 0o755)
UNPACK
torch_lib=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH=$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
say "# visiongate GPU check ($(cat "$KIT/BUILD" 2>/dev/null || echo 'unknown build'))"
say "host: $(nproc) cores ($(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2- | xargs)); torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') from $torch_lib"
if ((cpu_only)); then
  say "mode: --cpu (CUDA hidden in every run)"
  gpu_env=(CUDA_VISIBLE_DEVICES=)
else
  command -v nvidia-smi > /dev/null && say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /')"
  gpu_env=()
fi

# The Python half (standard library only): uploads, comparisons, free ports.
helper=$out/helper.py
cat > "$helper" <<'EOF'
import json, socket, sys, time, urllib.request, uuid
from pathlib import Path

def photos(folder):  # the registry set stays out
    return sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png")
                  and "registry" not in p.relative_to(folder).parts)

def predict(url, files, top_k):
    boundary = uuid.uuid4().hex
    parts = []
    for name, data in files:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
                     "Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    req = urllib.request.Request(f"{url}/predict?top_k={top_k}", data=body,
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        answer = json.load(r)
    return answer, time.perf_counter() - start

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "ports":
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    print(*(s.getsockname()[1] for s in socks))
elif cmd == "classify":  # URL PHOTOS OUT.json: every class's probability per photo
    url, folder, dest = args
    files = [(str(p.relative_to(folder)), p.read_bytes()) for p in photos(folder)]
    answer, _ = predict(url, files, 1000)
    probs = {}
    for (name, _), r in zip(files, answer["results"]):
        if "error" in r:
            sys.exit(f"{name}: {r['error']}")
        probs[name] = {c["class_id"]: c["score"] for c in r["top_k"]}
    Path(dest).write_text(json.dumps(probs))
elif cmd == "compare":  # REF.json OTHER.json [exact]: top-1 agreement, largest difference
    ref, other = (json.loads(Path(a).read_text()) for a in args[:2])
    same = sum(max(ref[n], key=ref[n].get) == max(other[n], key=other[n].get) for n in ref)
    diff = max(abs(p - other[n].get(c, 0.0)) for n in ref for c, p in ref[n].items())
    print(f"top-1 agreement {same}/{len(ref)}, largest probability difference {diff:.3g}")
    if len(args) > 2 and same != len(ref):
        sys.exit("top-1 differs where it must not")
elif cmd == "bulk":  # URL PHOTOS N [ROUNDS]: requests of N images (the photos over and over)
    url, folder, n = args[0], args[1], int(args[2])
    rounds = int(args[3]) if len(args) > 3 else 1
    pool = [p.read_bytes() for p in photos(folder)]
    files = [(f"{i}.jpg", pool[i % len(pool)]) for i in range(n)]
    rates = []
    for _ in range(rounds):
        answer, secs = predict(url, files, 1)
        failed = [r for r in answer["results"] if "error" in r]
        if failed:
            sys.exit(f"{len(failed)} of {n} images failed, e.g. {failed[0]}")
        rates.append(n / secs)
    if rounds == 1:
        print(f"{n} images in {n / rates[0]:.2f} s: {rates[0]:.1f} images/s")
    else:
        print(f"{n} images, {rounds} requests one after another: "
              + ", ".join(f"{r:.0f}" for r in rates) + f" images/s (best {max(rates):.1f})")
elif cmd == "decodes":  # METRICS_URL: images decoded per path (and reason), time per path
    text = urllib.request.urlopen(args[0], timeout=30).read().decode()
    counts, micros = {}, {}
    for line in text.splitlines():
        if line.startswith(("visiongate_decode_images_total{", "visiongate_decode_duration_us_total{")):
            labels, value = line.rsplit(" ", 1)
            name, labels = labels.split("{", 1)
            if float(value) > 0:
                into = counts if name == "visiongate_decode_images_total" else micros
                into["{" + labels] = int(float(value))
    # the decode threads' time on the cpu path, the device's on the GPU paths
    per_path = {}
    for labels, n in counts.items():
        path = labels.split('path="', 1)[1].split('"', 1)[0]
        per_path[path] = per_path.get(path, 0) + n
    times = []
    for labels, us in sorted(micros.items()):
        path = labels.split('path="', 1)[1].split('"', 1)[0]
        if per_path.get(path):
            times.append(f"{path} {us / 1e3:.0f} ms in all, {us / 1e3 / per_path[path]:.2f} ms an image")
    print("decoded: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
          + ("; decode time: " + ", ".join(times) if times else ""))
elif cmd == "anchor":  # PHOTOS N: torchvision's batched GPU decode of N images, and with resize
    import torch, torchvision
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2.functional import resize
    folder, n = args[0], int(args[1])
    pool = [torchvision.io.read_file(str(p)) for p in photos(folder)]
    data = [pool[i % len(pool)] for i in range(n)]
    for name, work in [
        ("decode", lambda: decode_jpeg(data, device="cuda")),
        ("decode + resize 224", lambda: [resize(x, [224, 224], antialias=True) for x in decode_jpeg(data, device="cuda")]),
    ]:
        work(); torch.cuda.synchronize()  # warm
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            work(); torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        print(f"torchvision {torchvision.__version__} {name}: {n} images in {best:.3f} s, "
              f"{n / best:.0f} images/s (best of 3, one batch)")
elif cmd == "cudashm":  # HTTP_URL GRPC_URL PHOTOS WHEELS [cpu]: the ensemble through CUDA shm
    import base64, urllib.error
    http_url, grpc_url, folder, client = args[:4]
    def post(path, body):
        req = urllib.request.Request(http_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r) if r.length else None
    if args[4:] == ["cpu"]:  # no GPU (and the client is for the GPU host's Python)
        try:
            post("/v2/cudasharedmemory/region/in/register",
                 {"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0,
                  "byte_size": 64})
            sys.exit("a CUDA region was registered with CUDA hidden")
        except urllib.error.HTTPError as e:
            error = json.load(e)["error"]
            assert e.code == 400 and "GPUs not supported" in error, (e.code, error)
            print(f"without a GPU: {e.code} {error}")
        sys.exit(0)
    sys.path.insert(0, client)
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm
    from tritonclient.utils import InferenceServerException
    files = [p.read_bytes() for p in photos(folder)][:16]
    longest = max(len(f) for f in files)
    batch = np.stack([np.pad(np.frombuffer(f, np.uint8), (0, longest - len(f))) for f in files])
    c = grpcclient.InferenceServerClient(grpc_url)
    inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
    inp.set_data_from_numpy(batch)
    expected = c.infer("ensemble_model", [inp]).as_numpy("output__0")
    scores_size = expected.nbytes
    h_in = cudashm.create_shared_memory_region("vg_in", batch.nbytes, 0)
    h_out = cudashm.create_shared_memory_region("vg_out", 256 + scores_size, 0)
    try:
        cudashm.set_shared_memory_region(h_in, [batch])
        c.register_cuda_shared_memory("vg_in", cudashm.get_raw_handle(h_in), 0, batch.nbytes)
        c.register_cuda_shared_memory("vg_out", cudashm.get_raw_handle(h_out), 0, 256 + scores_size)
        status = c.get_cuda_shared_memory_status(as_json=True)
        print("registered: " + ", ".join(sorted(status.get("regions", {}))))
        for transport in ("grpc", "http"):
            if transport == "grpc":
                inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
                inp.set_shared_memory("vg_in", batch.nbytes)
                out = grpcclient.InferRequestedOutput("output__0")
                out.set_shared_memory("vg_out", scores_size, 256)
                start = time.perf_counter()
                c.infer("ensemble_model", [inp], outputs=[out])
            else:
                start = time.perf_counter()
                post("/v2/models/ensemble_model/infer", {
                    "inputs": [{"name": "RAW_IMAGE", "datatype": "UINT8", "shape": list(batch.shape),
                                "parameters": {"shared_memory_region": "vg_in",
                                               "shared_memory_byte_size": batch.nbytes}}],
                    "outputs": [{"name": "output__0",
                                 "parameters": {"shared_memory_region": "vg_out",
                                                "shared_memory_byte_size": scores_size,
                                                "shared_memory_offset": 256}}]})
            took = time.perf_counter() - start
            raw = cudashm.get_contents_as_numpy(h_out, np.uint8, [256 + scores_size])
            got = raw[256:].view(np.float32).reshape(expected.shape)
            same = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(got, expected))
            print(f"{transport}: {len(files)} images from GPU memory, scores to GPU memory in "
                  f"{took * 1000:.0f} ms; top-1 agreement {same}/{len(files)} with the request "
                  f"without shared memory, largest difference {float(np.abs(got - expected).max()):.3g}")
            if same != len(files):
                sys.exit("CUDA shared memory changed the answer")
            cudashm.set_shared_memory_region(h_out, [np.zeros(scores_size + 256, np.uint8)])
        # The region's bounds hold: a read past it is refused, naming it.
        try:
            inp = grpcclient.InferInput("RAW_IMAGE", list(batch.shape), "UINT8")
            inp.set_shared_memory("vg_in", batch.nbytes, offset=1)
            c.infer("ensemble_model", [inp])
            sys.exit("a read past a CUDA region was served")
        except InferenceServerException as e:
            print(f"past the region: {e.status()} {e.message()}")
        c.unregister_cuda_shared_memory()
        left = c.get_cuda_shared_memory_status(as_json=True).get("regions", {})
        print(f"after unregister: {len(left)} regions")
    finally:
        cudashm.destroy_shared_memory_region(h_in)
        cudashm.destroy_shared_memory_region(h_out)
elif cmd == "pt2":  # MODEL_PT REPO OUT_REPO DEVICE: the kit's repository with the model as a .pt2 package
    # The kit carries no model source (its TorchScript is frozen), so torch's TorchScript
    # converter gives the exported program; then as scripts/export_model.py: a dynamic batch,
    # AOTInductor for this device, the metadata visiongate checks.
    import shutil
    import torch
    from torch._export.converter import TS2EPConverter
    model_pt, repo, dest, device = args
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    ts = torch.jit.load(model_pt).eval()
    start = time.perf_counter()
    example = torch.zeros(2, 3, 224, 224)
    with torch.no_grad():
        converted = TS2EPConverter(ts, (example,)).convert().module()
        # Its constants are plain tensor attributes, which Module.to leaves where they are.
        for module in converted.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    setattr(module, name, value.to(device))
        converted = converted.to(device)
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(converted, (example.to(device),), dynamic_shapes=({0: batch},))
    configs = {"aot_inductor.metadata": {"torch_version": torch.__version__, "batch_min": "1",
                                         "batch_max": "1024", "input_shape": "3,224,224"}}
    # (on the CPU for this machine's own instruction set: the package runs where it is built)
    shutil.copytree(repo, dest, ignore=shutil.ignore_patterns("model.pt", "*.stamp"))
    package = str(Path(dest) / "classifier" / "1" / "model.pt2")
    torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=configs)
    print(f"exported and compiled for {device} with torch {torch.__version__} in "
          f"{time.perf_counter() - start:.0f} s ({Path(package).stat().st_size / 1e6:.1f} MB)")
    config = Path(dest) / "classifier" / "config.pbtxt"
    config.write_text(config.read_text().replace('platform: "pytorch_libtorch"', 'platform: "torch_aoti"'))
elif cmd == "pt2-forward":  # MODEL_PT PACKAGE DEVICE: its forward pass against TorchScript's
    import torch
    model_pt, package, device = args
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
    ts = torch.jit.load(model_pt, map_location=device).eval()
    def best(work, rounds=10 if device == "cuda" else 2):
        with torch.no_grad():
            work(); work()
            times = []
            for _ in range(rounds):
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                work()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        return min(times)
    for n in (1, 16, 64):
        x = torch.rand(n, 3, 224, 224, device=device)
        with torch.no_grad():
            diff = (loader.run([x])[0] - ts(x)).abs().max().item()
        t_pt2, t_ts = best(lambda: loader.run([x])), best(lambda: ts(x))
        print(f"batch {n}: largest logit difference {diff:.3g} against TorchScript (TF32 off); "
              f"forward {t_pt2 * 1e3:.2f} ms ({n / t_pt2:.0f} images/s) against TorchScript's "
              f"{t_ts * 1e3:.2f} ms ({n / t_ts:.0f} images/s)")
elif cmd == "utilisation":  # FILE: nvidia-smi samples "util, memory"
    rows = [l.split(",") for l in Path(args[0]).read_text().splitlines() if l.strip()]
    util = [float(r[0]) for r in rows]
    mem = [float(r[1]) for r in rows]
    if util:
        print(f"GPU utilisation mean {sum(util) / len(util):.0f} %, max {max(util):.0f} % "
              f"({len(util)} samples), memory used up to {max(mem):.0f} MiB")
    else:
        print("GPU utilisation: no samples")
EOF

read -r http grpc metrics < <("$PY" "$helper" ports)
url=http://127.0.0.1:$http
pid=
sampler=
stop_server() {
  if [[ -n $sampler ]]; then
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    sampler=
  fi
  if [[ -n $pid ]]; then
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=
  fi
}
trap 'stop_server; [[ -z ${pt2_job:-} ]] || kill "$pt2_job" 2>/dev/null || true' EXIT

# serve NAME [ENV=VALUE...] -- [FLAG...]: starts the kit's server on $models (the kit's
# repository unless said otherwise) and waits until ready.
models=$KIT/models
serve() {
  local name=$1 envs=()
  shift
  while (($#)) && [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  # nvJPEG from the kit (PyPI's nvidia-nvjpeg), for the GPU decode runs.
  envs+=("VISIONGATE_NVJPEG_LIBRARY=$bin/libnvjpeg.so.13")
  env "${envs[@]}" "$bin/visiongate" --model-repository "$models" --host 127.0.0.1 \
    --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" "$@" > "$out/$name.log" 2>&1 &
  pid=$!
  local start=$SECONDS
  until curl -fsS "$url/v2/health/ready" > /dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || ((SECONDS - start > 900)); then
      tail -20 "$out/$name.log" >&2
      echo "gpu-check: the $name server did not become ready (log: $out/$name.log)" >&2
      exit 1
    fi
    sleep 1
  done
  local log
  log=$(sed 's/\x1b\[[0-9;]*m//g' "$out/$name.log")  # without the log's colours
  say "[$name] ready in $((SECONDS - start)) s; $(grep 'model ready' <<< "$log" | grep -o 'model="classifier".*' | head -1)"
  grep -E 'TF32|KIND_GPU' <<< "$log" | sed -E 's/^[^ ]+ +[A-Z]+ +/  /' | tee -a "$report" || true
}

device=cuda
((cpu_only)) && device=cpu
wants() { [[ ",$sections," == *",$1,"* ]]; }
failed=()
all_but_one=$(($(nproc) > 1 ? $(nproc) - 1 : 1))
# The .pt2 compile (CPU work, minutes) runs beside the fidelity and shared-memory sections,
# whose figures are not throughput (their servers' batch-size timing runs beside it too),
# bounded by PT2_TIMEOUT seconds; on a CPU-only machine it runs alone.
pt2_job=
pt2_compile() {
  env "${gpu_env[@]}" timeout "${PT2_TIMEOUT:-400}" "$PY" "$helper" pt2 \
    "$KIT/models/classifier/1/model.pt" "$KIT/models" "$out/pt2-repo" "$device" > "$out/pt2.txt" 2>&1
}
if wants pt2; then
  rm -rf "$out/pt2-repo"
  if ((!cpu_only)); then
    pt2_compile &
    pt2_job=$!
  fi
fi

if wants fidelity; then
  say ""
  say "## Fidelity: the kit's $(find "$KIT/photos/" -path '*/registry' -prune -o -name '*.jpg' -print | wc -l) photos, every class's probability"
  serve cpu CUDA_VISIBLE_DEVICES= -- --decode-threads 4
  "$PY" "$helper" classify "$url" "$KIT/photos" "$out/cpu.json"
  stop_server
  exact=()
  ((cpu_only)) && exact=(exact)
  for run in "tf32 off" "tf32 on" "tf32 off, GPU decode"; do
    [[ $run =~ $runs ]] || continue
    name=gpu-${run//[ ,]/-}
    flags=(--tf32 "$(cut -d' ' -f2 <<< "${run%%,*}")" --decode-threads 4 --gpu-decode=false)
    [[ $run == *"GPU decode"* ]] && flags[-1]=--gpu-decode=true
    serve "$name" "${gpu_env[@]}" -- "${flags[@]}"
    "$PY" "$helper" classify "$url" "$KIT/photos" "$out/$name.json"
    decodes=$("$PY" "$helper" decodes "http://127.0.0.1:$metrics/metrics")
    stop_server
    compared=$("$PY" "$helper" compare "$out/cpu.json" "$out/$name.json" "${exact[@]}") || {
      say "  GPU ($run) against CPU: $compared"
      echo "gpu-check: top-1 differs where it must not" >&2
      exit 1
    }
    say "  GPU ($run) against CPU: $compared; $decodes"
    if ((cpu_only)) && grep -q 'path="gpu' <<< "$decodes"; then
      echo "gpu-check: images were decoded on a GPU with CUDA hidden" >&2
      exit 1
    fi
  done
fi

if wants cudashm; then
  say ""
  say "## CUDA shared memory (tritonclient's utilities, for Python 3.12)"
  client=$out/client
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$KIT/client.tar.xz" "$client"
  serve cudashm "${gpu_env[@]}" -- --allow-client-shm=true --decode-threads 4
  cpu_flag=()
  ((cpu_only)) && cpu_flag=(cpu)
  "$PY" "$helper" cudashm "$url" "127.0.0.1:$grpc" "$KIT/photos/small" "$client" "${cpu_flag[@]}" \
    > "$out/cudashm.txt" 2>&1 || failed+=("CUDA shared memory")
  sed 's/^/  /' "$out/cudashm.txt" | tee -a "$report"
  stop_server
fi

# The .pt2 compile is waited for before anything is timed.
pt2_ok=0
if wants pt2; then
  if [[ -n $pt2_job ]]; then
    wait "$pt2_job" && pt2_ok=1
    pt2_job=
  else
    pt2_compile && pt2_ok=1
  fi
fi

for set in small all; do
  wants "$set" || continue
  folder=$KIT/photos
  [[ $set == small ]] && folder=$KIT/photos/small
  say ""
  say "## Throughput: /predict requests of $images images ($rounds one after another), $set photos ($(find "$folder/" -path '*/registry' -prune -o -name '*.jpg' -print | wc -l) over and over)"
  for run in "GPU 4" "CPU 4" "CPU 8" "CPU $all_but_one"; do
    [[ $run =~ $runs ]] || continue
    read -r where threads <<< "$run"
    gpu_decode=false
    [[ $where == GPU ]] && gpu_decode=true
    name=bulk-$set-$where-$threads
    serve "$name" "${gpu_env[@]}" -- --decode-threads "$threads" --gpu-decode="$gpu_decode"
    "$PY" "$helper" bulk "$url" "$folder" 20 > /dev/null  # warm the decoders and allocator
    sampler=
    if ((!cpu_only)) && command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 \
        > "$out/nvidia-smi-$name.csv" &
      sampler=$!
    fi
    result=$("$PY" "$helper" bulk "$url" "$folder" "$images" "$rounds")
    decodes=$("$PY" "$helper" decodes "http://127.0.0.1:$metrics/metrics")
    util="GPU utilisation: not sampled (no GPU)"
    sampled=$sampler
    stop_server  # the sampler too
    [[ -n $sampled ]] && util=$("$PY" "$helper" utilisation "$out/nvidia-smi-$name.csv")
    say "  $where decode, $threads decode threads: $result; $util; $decodes"
  done
  if ((!cpu_only)) && [[ anchor =~ $runs ]]; then
    say "  anchor: $("$PY" "$helper" anchor "$folder" "$images" 2>&1 | tr '\n' ';')"
  fi
done

if wants pt2; then
  say ""
  say "## The classifier as a .pt2 package (AOTInductor) compiled here for $device, served on it"
  if ((pt2_ok)); then
    sed 's/^/  /' "$out/pt2.txt" | tee -a "$report"
    # In a subshell of its own (errexit on, its server stopped on the way out), so that a
    # failure here is reported with the others instead of ending the script.
    set +e
    (
      set -e
      trap stop_server EXIT
      env "${gpu_env[@]}" "$PY" "$helper" pt2-forward "$KIT/models/classifier/1/model.pt" \
        "$out/pt2-repo/classifier/1/model.pt2" "$device" > "$out/pt2-forward.txt" 2>&1
      sed 's/^/  /' "$out/pt2-forward.txt" | tee -a "$report"
      models=$out/pt2-repo
      serve pt2 "${gpu_env[@]}" -- --decode-threads 4 --gpu-decode=false
      "$PY" "$helper" classify "$url" "$KIT/photos" "$out/pt2.json"
      against="no CPU run to compare with (fidelity not run)"
      if [[ -f $out/cpu.json ]]; then
        against=$("$PY" "$helper" compare "$out/cpu.json" "$out/pt2.json")
      fi
      stop_server
      say "  .pt2 on $device against the CPU path: $against"
      serve pt2-bulk "${gpu_env[@]}" -- --decode-threads "$all_but_one" --gpu-decode=false
      "$PY" "$helper" bulk "$url" "$KIT/photos/small" 20 > /dev/null
      result=$("$PY" "$helper" bulk "$url" "$KIT/photos/small" "$images" "$rounds")
      say "  .pt2, CPU decode, $all_but_one decode threads, small photos: $result"
    )
    status=$?
    set -e
    if ((status)); then
      [[ -f $out/pt2-forward.txt ]] && tail -20 "$out/pt2-forward.txt" | sed 's/^/  /' | tee -a "$report"
      failed+=(".pt2 package")
    fi
  else
    tail -20 "$out/pt2.txt" | sed 's/^/  /' | tee -a "$report"
    failed+=(".pt2 package")
  fi
fi

say ""
if ((${#failed[@]})); then
  say "gpu-check: FAILED: ${failed[*]} (report: $report)"
  exit 1
fi
say "gpu-check: done (report: $report)"
