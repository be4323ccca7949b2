# visiongate on a GPU host: `docker compose up` (see docker-compose.yml and the README).
#
# Build stage: the README's set-up (scripts/setup.sh) without the test tools, in layers
# that change at different rates: the venv with the torch wheel (libtorch and its CUDA
# libraries) only when scripts/requirements.txt changes, the model export only when the
# exporter or the model repository changes, then the release binary (which opens
# libtorch_cuda.so at start where the NVIDIA driver is). A source change re-runs only the last step, an incremental
# cargo build (cargo's registry and target directory live in cache mounts).
FROM rust:1-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv cmake nasm binutils \
    && rm -rf /var/lib/apt/lists/*
ENV VISIONGATE_HOME=/opt/visiongate \
    CARGO_TARGET_DIR=/cache/target \
    PIP_CACHE_DIR=/cache/pip
WORKDIR /src
COPY scripts/env.sh scripts/setup.sh scripts/requirements.txt scripts/
RUN --mount=type=cache,target=/cache/pip \
    bash scripts/setup.sh --no-test-tools venv
COPY scripts/export_model.py scripts/
COPY models models
RUN bash scripts/setup.sh --no-test-tools model
COPY .cargo .cargo
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY static static
COPY src src
# Targets Cargo.toml declares by name (with required features): cargo reads them to build.
COPY examples/bench.rs examples/
COPY tests/cuda_support_loads_at_run_time.rs tests/
COPY scripts/stage-runtime.sh scripts/
# The image's binary has its debug information stripped (stage-runtime.sh): it is built
# without the line tables the release profile keeps for a developer's backtraces.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/cache/target \
    CARGO_PROFILE_RELEASE_DEBUG=false bash scripts/setup.sh --no-test-tools build \
    && bash scripts/stage-runtime.sh /stage

# Runtime stage: no compiler, no Python; the stripped binary, the model repository and
# the libraries the binary loads (libtorch, its CUDA libraries, cuDNN's kernel libraries),
# at the paths the binary and libtorch find each other by (their RUNPATHs), ONNX Runtime's
# library (CPU) and OpenVINO's, which the binary opens when such a model loads, and nvJPEG's,
# which it opens at start where an instance runs on a GPU. The NVIDIA driver comes from the
# host (NVIDIA Container Toolkit, asked for by the compose file's GPU reservation); its
# `video` capability is the GPU's JPEG decoder (without it nvJPEG's CUDA decoder runs).
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent visiongate
COPY --from=build /stage/opt /opt
COPY --from=build /stage/models /models
COPY --from=build /stage/visiongate /usr/local/bin/visiongate
# Triton's manifests run `tritonserver --model-repository=...`: the same binary answers.
RUN ln -s visiongate /usr/local/bin/tritonserver
ENV VISIONGATE_MODEL_REPOSITORY=/models \
    VISIONGATE_ONNXRUNTIME_LIBRARY=/opt/visiongate/lib/libonnxruntime.so \
    VISIONGATE_OPENVINO_LIBRARY=/opt/visiongate/lib/openvino/libopenvino_c.so.2641 \
    VISIONGATE_NVJPEG_LIBRARY=/opt/visiongate/lib/libnvjpeg.so.13 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility,video
USER visiongate
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/v2/health/ready"]
ENTRYPOINT ["/usr/local/bin/visiongate"]
