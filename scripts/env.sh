# Sourced by the other scripts: where visiongate keeps what it builds and installs,
# outside the clone so every checkout (and CI) reuses it.
VG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VG_HOME=${VISIONGATE_HOME:-$HOME/.cache/visiongate}
VG_VENV=${VISIONGATE_VENV:-$VG_HOME/venv}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$VG_HOME/target}
VG_PY=$VG_VENV/bin/python
VG_BIN=$CARGO_TARGET_DIR/release/visiongate
# libtorch from the venv's torch wheel. Exported as an absolute path (instead of the
# clone-relative `.libtorch` of .cargo/config.toml) so torch-sys is built once per machine,
# not once per checkout.
if [[ -x $VG_PY ]]; then
  VG_SITE=$("$VG_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  export LIBTORCH=$VG_SITE/torch
  # ONNX Runtime from the venv's onnxruntime wheel (a versioned file name), for ONNX models.
  for lib in "$VG_SITE"/onnxruntime/capi/libonnxruntime.so.*; do
    [[ -f $lib ]] && export VISIONGATE_ONNXRUNTIME_LIBRARY=${VISIONGATE_ONNXRUNTIME_LIBRARY:-$lib}
  done
  # OpenVINO's C API from the venv's openvino wheel (its CPU plugin beside it), for backend
  # "openvino".
  for lib in "$VG_SITE"/openvino/libs/libopenvino_c.so.*; do
    [[ -f $lib ]] && export VISIONGATE_OPENVINO_LIBRARY=${VISIONGATE_OPENVINO_LIBRARY:-$lib}
  done
  # nvJPEG from the venv's nvidia-nvjpeg wheel, for JPEG decode on GPUs.
  lib=$VG_SITE/nvidia/cu13/lib/libnvjpeg.so.13
  [[ -f $lib ]] && export VISIONGATE_NVJPEG_LIBRARY=${VISIONGATE_NVJPEG_LIBRARY:-$lib}
fi
export VISIONGATE_PYTHON=$VG_PY VISIONGATE_BIN=$VG_BIN
# Azure Storage's emulator for the remote-repository tests (scripts/setup.sh installs it).
VG_AZURITE_DIR=$VG_HOME/azurite
# The manifests' policy linter (setup.sh), in its own venv.
CHECKOV_REQ=checkov==3.3.30
VG_CHECKOV_VENV=$VG_HOME/checkov-venv
export VISIONGATE_CHECKOV=$VG_CHECKOV_VENV/bin/checkov
export VISIONGATE_AZURITE=$VG_AZURITE_DIR/node_modules/.bin/azurite-blob

# `install_tool CRATE VERSION`: a pinned cargo tool, built once per machine into the target
# cache (VG_TOOLS/bin); prints its path. Built quickly rather than small and fast (no LTO,
# parallel codegen, opt-level 1): cargo-deny's own release profile (fat LTO, one codegen
# unit) made it one of a new machine's longest builds, for a tool that runs seconds.
VG_TOOLS=$CARGO_TARGET_DIR/tools
install_tool() {
  local crate=$1 version=$2 bin=$VG_TOOLS/bin/$1
  if ! [[ -x $bin ]] || [[ $("$bin" --version 2>/dev/null) != *" $version"* ]]; then
    echo "building $crate $version into $VG_TOOLS (once per machine, a few minutes)" >&2
    CARGO_TARGET_DIR=$VG_TOOLS/build CARGO_PROFILE_RELEASE_LTO=false \
      CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 CARGO_PROFILE_RELEASE_OPT_LEVEL=1 \
      cargo install --locked --quiet "$crate@$version" --root "$VG_TOOLS" >&2
  fi
  echo "$bin"
}
