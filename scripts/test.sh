#!/usr/bin/env bash
# `make test`, after the set-up: every step in turn, each one's wall time printed as it ends
# (CI's log says where a run's minutes went), the first failure ends the run.
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
step "module dependencies" bash -c 'bash scripts/module-deps.sh > /dev/null'
step "cargo deny" bash scripts/deny.sh
step "each runtime feature" bash scripts/features.sh
step "cargo test" cargo test --release
step "fuzz smoke" bash scripts/fuzz.sh smoke
step "pytest" "$VISIONGATE_PYTHON" -m pytest -q -rs tests/python
step "container test" bash scripts/container-test.sh
