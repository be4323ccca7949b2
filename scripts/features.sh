#!/usr/bin/env bash
# `cargo check` of the server with each runtime alone, all of them, and none (the tests' fake
# only): every build a user can ask for compiles, warning-free. Each runtime is a Cargo
# feature (`torch`: libtorch, `onnx`: ONNX Runtime, `openvino`: OpenVINO); a model whose runtime a build lacks
# fails its own load, naming the feature.
#
# A warning fails the check. It is read from cargo's output rather than asked for with
# RUSTFLAGS="-D warnings": other flags than the build's would make cargo build every build
# script again and rerun them (the C and C++ libraries of aws-lc, libjpeg-turbo, jemalloc
# and torch-sys: minutes on a new machine), where the same flags share them with the build.
set -euo pipefail
cd "$(dirname "$0")/.."
for runtimes in "torch,onnx,openvino" "torch" "onnx" "openvino" ""; do
    echo "cargo check: runtimes [${runtimes}]"
    if ! out=$(cargo check --release --quiet --lib --bins --no-default-features \
        --features "jemalloc${runtimes:+,$runtimes}" 2>&1); then
        echo "$out"
        exit 1
    fi
    if grep -q '^warning' <<< "$out"; then
        echo "$out"
        echo "features: warnings in the build with runtimes [${runtimes}]" >&2
        exit 1
    fi
done
