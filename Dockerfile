# visiongate on a GPU host: `docker compose up` (see docker-compose.yml and the README).
#
# Build stage: the README's set-up, unchanged (scripts/setup.sh): a venv with the torch
# wheel (libtorch and its CUDA libraries), the bundled model exported to TorchScript, and
# the release binary, which links libtorch_cuda.so on purpose.
FROM rust:1-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv cmake nasm \
    && rm -rf /var/lib/apt/lists/*
ENV VISIONGATE_HOME=/opt/visiongate
WORKDIR /src
COPY . .
RUN bash scripts/setup.sh
# What the runtime needs: the binary, the model repository with its exported model, and
# libtorch with the CUDA libraries, kept at the same absolute paths (the binary and
# libtorch find each other through their RUNPATHs).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN site=$("$VISIONGATE_HOME/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && mkdir -p /stage \
    && cp -a --parents "$site/torch/lib" "$site/nvidia" /stage/ \
    && cp "$VISIONGATE_HOME/target/release/visiongate" /stage/visiongate \
    && cp -a models /stage/models

# Runtime stage: no compiler, no Python. The NVIDIA driver comes from the host (NVIDIA
# Container Toolkit, requested by the compose file's GPU reservation).
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /stage/opt /opt
COPY --from=build /stage/visiongate /usr/local/bin/visiongate
COPY --from=build /stage/models /models
ENV VISIONGATE_MODEL_REPOSITORY=/models \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/v2/health/ready"]
ENTRYPOINT ["/usr/local/bin/visiongate"]
