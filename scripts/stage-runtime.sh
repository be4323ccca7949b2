#!/usr/bin/env bash
# Gathers what the runtime image carries into DEST (the Dockerfile's build stage runs it
# after setup.sh): the stripped binary, the model repository with its exported model, and
# the libraries the binary loads from the venv, kept at their absolute paths under
# DEST/opt so the binary's and libtorch's RUNPATHs still find them, and ONNX Runtime's,
# OpenVINO's and nvJPEG's.
#   scripts/stage-runtime.sh DEST
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$VG_ROOT"
dest=${1:?usage: stage-runtime.sh DEST}
mkdir -p "$dest"

# Every library the dynamic loader resolves for the binary (libtorch) and for
# libtorch_cuda, which the binary opens at start on a host with the NVIDIA driver (with
# the CUDA libraries they name), plus what libtorch loads only when it runs on a GPU:
# cuDNN's engine libraries and NVRTC's builtins (dlopen, so ldd cannot see them). The
# host's NVIDIA driver (libcuda) is not among them. libtorch_cuda_linalg (linear algebra
# on the GPU, loaded on first use) and profiler libraries are left out.
loaded=("$VG_BIN")
cuda=$LIBTORCH/lib/libtorch_cuda.so
[[ -e $cuda ]] && loaded+=("$cuda")
deps=$(ldd "${loaded[@]}")
if grep 'not found' <<<"$deps" >&2; then exit 1; fi
libs=$( (awk '$2 == "=>" && $3 ~ /^\// {print $3}' <<<"$deps"; [[ -e $cuda ]] && echo "$cuda") \
  | xargs realpath | grep -F "$(realpath "$VG_VENV")/" || true)
[[ -n $libs ]] || { echo "stage-runtime: ldd found no libraries under $VG_VENV" >&2; exit 1; }
site=$(dirname "$LIBTORCH")
extra=$(ls "$site"/nvidia/cudnn/lib/libcudnn_*.so.* "$site"/nvidia/*/lib/libnvrtc-builtins.so.* 2>/dev/null || true)
# Paths relative to / (coreutils 9.1's `cp --parents` mishandles absolute sources).
(cd / && printf '%s\n' $libs $extra | sed 's|^/||' | sort -u | xargs cp -a --parents -t "$dest")
echo "stage-runtime: $(printf '%s\n' $libs $extra | sort -u | wc -l) libraries, $(du -sh "$dest/opt" | cut -f1)"

# ONNX Runtime (opened by the binary when an ONNX model loads): the venv's wheel's library,
# self-contained, under the one name the image's VISIONGATE_ONNXRUNTIME_LIBRARY gives.
[[ -f ${VISIONGATE_ONNXRUNTIME_LIBRARY:-} ]] \
  || { echo "stage-runtime: no ONNX Runtime library in the venv (scripts/requirements.txt)" >&2; exit 1; }
mkdir -p "$dest/opt/visiongate/lib"
cp "$VISIONGATE_ONNXRUNTIME_LIBRARY" "$dest/opt/visiongate/lib/libonnxruntime.so"
echo "stage-runtime: ONNX Runtime $(basename "$VISIONGATE_ONNXRUNTIME_LIBRARY")"

# OpenVINO (opened by the binary when a model of backend "openvino" loads): the wheel's C
# API with what it loads for IR and ONNX models on the CPU (the core, the CPU plugin, the
# IR and ONNX frontends, oneTBB with its NUMA binding and hwloc), in a directory of their
# own, as the wheel keeps them (they find each other there).
[[ -f ${VISIONGATE_OPENVINO_LIBRARY:-} ]] \
  || { echo "stage-runtime: no OpenVINO library in the venv (scripts/requirements.txt)" >&2; exit 1; }
ov_libs=$(dirname "$VISIONGATE_OPENVINO_LIBRARY")
mkdir -p "$dest/opt/visiongate/lib/openvino"
for lib in libopenvino_c.so.* libopenvino.so.* libopenvino_intel_cpu_plugin.so \
    libopenvino_ir_frontend.so.* libopenvino_onnx_frontend.so.* libtbb.so.* libtbbbind_2_5.so.* \
    libtbbmalloc.so.* libhwloc.so.*; do
  cp -a "$ov_libs"/$lib "$dest/opt/visiongate/lib/openvino/"
done
echo "stage-runtime: OpenVINO $(basename "$VISIONGATE_OPENVINO_LIBRARY"), $(du -sh "$dest/opt/visiongate/lib/openvino" | cut -f1)"

# nvJPEG (opened at start where an instance runs on a GPU), self-contained likewise.
[[ -f ${VISIONGATE_NVJPEG_LIBRARY:-} ]] \
  || { echo "stage-runtime: no nvJPEG library in the venv (scripts/requirements.txt)" >&2; exit 1; }
cp "$VISIONGATE_NVJPEG_LIBRARY" "$dest/opt/visiongate/lib/libnvjpeg.so.13"
echo "stage-runtime: nvJPEG $(basename "$VISIONGATE_NVJPEG_LIBRARY")"

strip --strip-debug -o "$dest/visiongate" "$VG_BIN"
echo "stage-runtime: binary $(du -h "$VG_BIN" | cut -f1) -> $(du -h "$dest/visiongate" | cut -f1) stripped"
rm -rf "$dest/models"
cp -a models "$dest/models"
