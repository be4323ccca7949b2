#!/usr/bin/env bash
# `cargo check` of the server with each runtime alone, all of them, and none (the tests' fake
# only): every build a user can ask for compiles, warning-free. Each runtime is a Cargo
# feature (`torch`: libtorch, `onnx`: ONNX Runtime, `openvino`: OpenVINO); a model whose runtime a build lacks
# fails its own load, naming the feature.
set -euo pipefail
cd "$(dirname "$0")/.."
for runtimes in "torch,onnx,openvino" "torch" "onnx" "openvino" ""; do
    echo "cargo check: runtimes [${runtimes}]"
    RUSTFLAGS="${RUSTFLAGS:-} -D warnings" cargo check --release --quiet --lib --bins \
        --no-default-features --features "jemalloc${runtimes:+,$runtimes}"
done
