#!/usr/bin/env bash
# `make gpu-kit`: a visiongate for the GPU hosts this project is lent now and then (PyTorch
# 2.11.0 with CUDA 13 under Python 3.12, NVIDIA driver 580, no Rust, no package registries,
# at most 64 MiB of files carried along), packed into gpu-kit/ (git-ignored):
#   visiongate.xz  built here against torch 2.11.0 (tch/torch-sys 0.24, the releases for
#                  it) in a venv and target directory of its own, stripped and compressed
#                  (gpu-check.sh unpacks it); on the host it loads the host's own libtorch
#                  (gpu-check.sh sets LD_LIBRARY_PATH)
#   lib/libnvjpeg.so.13.xz   PyPI's nvidia-nvjpeg (scripts/requirements.txt), for JPEG
#                  decode on the GPU, compressed likewise
#   models/        the bundled repository, model.pt exported by torch 2.11.0
#   photos         a link to the checkout's test photos (tests/fixtures/photos, with their
#                  sources; the registry set is left out), which travel with the checkout
#   client.tar.xz  tritonclient's gRPC client and CUDA shared-memory utilities, with what
#                  they import that the host lacks (cuda-bindings, grpcio, ...), for Python
#                  3.12, unpacked from their wheels without sources and stripped: the CUDA
#                  shared-memory check
#   gpu-check.sh   the check to run there (scripts/gpu-check.sh)
# The main build stays on tch 0.26 / torch 2.13.0. Then the kit's CPU mode runs here (the
# same binary on torch 2.11's CPU path), so the kit cannot rot unnoticed.
#   scripts/gpu-kit.sh [--no-check]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$VG_ROOT"

KIT_TORCH=2.11.0
KIT_TCH=0.24
KIT_HOME=$VG_HOME/gpu-kit
KIT=$VG_ROOT/gpu-kit
# What travels to a GPU host: the checkout's tracked files and the kit, 64 MiB together.
LIMIT=$((64 << 20))
say() { printf '\033[1mgpu-kit:\033[0m %s\n' "$*"; }

# 1. A venv with torch 2.11.0 and the model packages (scripts/requirements.txt, re-pinned).
venv=$KIT_HOME/venv
py=$venv/bin/python
reqs=$(sed -E "s/^torch==.*/torch==$KIT_TORCH/" scripts/requirements.txt)
if [[ $(cat "$venv/.requirements" 2>/dev/null) != "$reqs" ]]; then
  say "installing torch==$KIT_TORCH and the model packages into $venv (about 5 GB)"
  [[ -x $py ]] || python3 -m venv "$venv"
  "$py" -m pip install -q --disable-pip-version-check -r <(echo "$reqs")
  echo "$reqs" > "$venv/.requirements"
fi
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# 2. The crate with tch/torch-sys 0.24: the sources are this checkout's (links), only the
#    manifest differs. Cargo moves just those two crates in the copied lock file.
crate=$KIT_HOME/crate
mkdir -p "$crate"
# Cargo reads the targets Cargo.toml declares by name (an example, a test) to build.
for item in src proto static build.rs examples tests; do ln -sfn "$VG_ROOT/$item" "$crate/$item"; done
sed -E -e "s/^(tch = \{ version = )\"[^\"]+\"/\1\"$KIT_TCH\"/" \
  -e "s/^(torch-sys = \{ version = )\"[^\"]+\"/\1\"$KIT_TCH\"/" Cargo.toml > "$crate/Cargo.toml.new"
grep -q "^tch = { version = \"$KIT_TCH\"" "$crate/Cargo.toml.new" \
  && grep -q "^torch-sys = { version = \"$KIT_TCH\"" "$crate/Cargo.toml.new" \
  || { echo "gpu-kit: Cargo.toml has no tch/torch-sys version lines to re-pin" >&2; exit 1; }
if ! cmp -s "$crate/Cargo.toml.new" "$crate/Cargo.toml" || ! cmp -s Cargo.lock "$crate/Cargo.lock.base"; then
  mv "$crate/Cargo.toml.new" "$crate/Cargo.toml"
  cp Cargo.lock "$crate/Cargo.lock"
  cp Cargo.lock "$crate/Cargo.lock.base"
else
  rm "$crate/Cargo.toml.new"
fi
say "cargo build --release against torch $KIT_TORCH (tch $KIT_TCH; target: $KIT_HOME/target)"
(
  cd "$crate"
  export LIBTORCH=$site/torch CARGO_TARGET_DIR=$KIT_HOME/target
  unset LIBTORCH_USE_PYTORCH
  cargo build --release --quiet --bin visiongate
)

# 3. The kit.
# The client's wheels for the host's Python 3.12 (numpy comes with its torchvision), once.
wheels=$KIT_HOME/wheels
client=(tritonclient==2.73.0 grpcio==1.85.3 protobuf==6.33.6 python-rapidjson==1.25
  ml-dtypes==0.5.4 packaging==26.4 typing-extensions==4.16.0 cuda-bindings==13.0.3
  cuda-pathfinder==1.9.1)
if [[ $(cat "$wheels/.pins" 2>/dev/null) != "${client[*]}" ]]; then
  say "downloading ${client[*]} for Python 3.12 into $wheels"
  rm -rf "$wheels"
  "$py" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" "${client[@]}"
  echo "${client[*]}" > "$wheels/.pins"
fi
rm -rf "$KIT"
mkdir -p "$KIT/models" "$KIT/lib"
client_site=$KIT_HOME/client
rm -rf "$client_site" && mkdir -p "$client_site"
for wheel in "$wheels"/*.whl; do
  "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$client_site"
done
find "$client_site" \( -name '*.c' -o -name '*.cpp' -o -name '*.h' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' \) -delete
find "$client_site" -name '*.so' -exec strip --strip-unneeded {} +
tar -C "$client_site" -c . | xz -T0 -9 > "$KIT/client.tar.xz"
# xz: the kit travels within 64 MiB (gpu-check.sh unpacks with Python's lzma).
strip --strip-all -o "$KIT_HOME/visiongate" "$KIT_HOME/target/release/visiongate"
xz -T0 -6 -c "$KIT_HOME/visiongate" > "$KIT/visiongate.xz"
xz -T0 -6 -c "$site/nvidia/cu13/lib/libnvjpeg.so.13" > "$KIT/lib/libnvjpeg.so.13.xz"
# TorchScript only: the kit travels within 64 MiB, and the GPU host has no ONNX Runtime.
tar -C models --exclude='model.pt' --exclude='model.onnx' --exclude='model.pt2' --exclude='model.xml' --exclude='model.bin' --exclude='*.stamp' --exclude='*.tmp' -c . \
  | tar -C "$KIT/models" -x
"$py" scripts/export_model.py --repo "$KIT/models" --formats model.pt > /dev/null
rm -f "$KIT"/models/*/*/*.stamp
# The 40 test photos: the checkout's, which travel with it (gpu-check.sh leaves the registry
# set out).
ln -s ../tests/fixtures/photos "$KIT/photos"
cp scripts/gpu-check.sh "$KIT/gpu-check.sh"
cp scripts/fairness.py "$KIT/fairness.py"
cat > "$KIT/BUILD" <<EOF
visiongate $(git describe --always --dirty 2>/dev/null || echo unknown), torch $KIT_TORCH, tch $KIT_TCH, built $(date -u +%Y-%m-%dT%H:%MZ)
EOF
size=$(du -sb "$KIT" | cut -f1)
tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
say "gpu-kit/: $((size / 1024 / 1024)) MiB ($(du -h "$KIT/visiongate.xz" | cut -f1) binary, $(du -h "$KIT/lib/libnvjpeg.so.13.xz" | cut -f1) nvJPEG, $(du -h "$KIT/models/classifier/1/model.pt" | cut -f1) model, $(du -h "$KIT/client.tar.xz" | cut -f1) client), with the checkout's $((tracked / 1024 / 1024)) MiB"
((size + tracked < LIMIT)) || { echo "gpu-kit: $size bytes and the checkout's $tracked, over the 64 MiB a GPU host takes along" >&2; exit 1; }

# 4. Its CPU mode, here.
if [[ ${1:-} != --no-check ]]; then
  say "gpu-check.sh --cpu with torch $KIT_TORCH on this machine"
  PYTHON=$py bash "$KIT/gpu-check.sh" --cpu --out "$VG_ROOT/test-artifacts/gpu-check-cpu"
fi
