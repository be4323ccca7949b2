#!/usr/bin/env bash
# `make test`, after the set-up: every step in turn, each one's wall time printed as it ends
# (CI's log says where a run's minutes went); the first failure ends the run.
#
# The container image's build (scripts/container-test.sh build) runs beside the steps that
# only compile and fuzz: on a new machine it is about 20 minutes, half of them downloads and
# layer commits that leave the cores to the other steps. The steps that run servers and
# time them (cargo test, pytest, the container checks) start once it is done, on a quiet
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

t0=$(date +%s)
step() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  printf '\033[1mmake test:\033[0m %s: %s s (at %s s)\n' "$name" $((SECONDS - start)) $(($(date +%s) - t0))
}

mkdir -p test-artifacts
image_log=test-artifacts/container-image-build.log
# Its own process group, so that a failure here stops the build and all it started.
setsid bash scripts/container-test.sh build > "$image_log" 2>&1 &
image_pid=$!
trap '[[ -n ${image_pid:-} ]] && kill -- -"$image_pid" 2> /dev/null; true' EXIT
image_built() {
  local rc=0
  wait "$image_pid" || rc=$?
  image_pid=
  cat "$image_log"
  ((rc == 0)) || { echo "make test: the container image did not build (log above)" >&2; return 1; }
}

step "module dependencies" bash -c 'bash scripts/module-deps.sh > /dev/null'
step "cargo deny" bash scripts/deny.sh
step "each runtime feature" bash scripts/features.sh
step "fuzz smoke" bash scripts/fuzz.sh smoke
step "container image build (beside the steps above)" image_built
step "cargo test" cargo test --release
step "pytest" "$VISIONGATE_PYTHON" -m pytest -q -rs --durations=10 tests/python
step "container test" bash scripts/container-test.sh check
