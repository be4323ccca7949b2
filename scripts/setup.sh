#!/usr/bin/env bash
# Sets visiongate up on a fresh machine (only the package registries reachable) and is a
# no-op when everything is already there: a second run downloads nothing.
#
#   scripts/setup.sh [--no-test-tools] [STEP...]
#
# Steps, in order (all of them when none is named):
#   packages  apt: cmake and nasm (libjpeg-turbo), g++ (compiles the .pt2 export, and the
#             shims beside libtorch), and for the tests chromium, node and curl, only when
#             missing; playwright-core from npm for the browser test, and azurite
#             (Azure Storage's emulator) from npm for the remote-repository tests; for the
#             Kubernetes proof, haproxy and prometheus (with promtool) from apt, and checkov
#             (the manifests' policy linter) in a venv of its own; kubectl must be there
#   venv      a venv outside the clone with torch==2.13.0 and the model packages
#             (scripts/requirements.txt), plus the test packages (requirements-test.txt)
#   model     models/classifier/1/model.pt (and .onnx, .pt2 beside it), each exported when
#             missing or stale
#   build     the `.libtorch` link to the venv's torch, then cargo build --release
# --no-test-tools leaves out what only the tests use (chromium, node, playwright-core and
# requirements-test.txt): what the Dockerfile's build stage runs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$VG_ROOT"

say() { printf '\033[1msetup [%4ss]:\033[0m %s\n' "$SECONDS" "$*"; }

test_tools=1
steps=()
for arg in "$@"; do
  case $arg in
    --no-test-tools) test_tools=0 ;;
    packages | venv | model | build) steps+=("$arg") ;;
    *) echo "setup: unknown argument '$arg' (steps: packages venv model build; --no-test-tools)" >&2; exit 2 ;;
  esac
done
((${#steps[@]})) || steps=(packages venv model build)
wants() { [[ " ${steps[*]} " == *" $1 "* ]]; }

if wants packages; then
  need=()
  for tool in cmake nasm g++; do command -v "$tool" >/dev/null || need+=("$tool"); done
  if ((test_tools)); then
    [[ -x /usr/bin/chromium ]] || need+=(chromium)
    command -v node >/dev/null || need+=(nodejs)
    command -v npm >/dev/null || need+=(npm)
    command -v curl >/dev/null || need+=(curl)
    for tool in haproxy prometheus; do command -v "$tool" >/dev/null || need+=("$tool"); done
    # kubectl (with its kustomize) is no Debian package: it comes with the machine, or from
    # the Kubernetes project's own apt repository.
    command -v kubectl >/dev/null || say "note: kubectl is missing; the Kubernetes tests need it (kubernetes.io: Install Tools)"
  fi
  if ((${#need[@]})); then
    say "installing ${need[*]} (apt)"
    sudo_cmd=(); [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  # playwright-core (npm) for tests/browser, as locked; skipped when already installed.
  ((test_tools)) && lock_sum=$(sha256sum tests/browser/package-lock.json | cut -d' ' -f1)
  if ((test_tools)) && [[ $(cat tests/browser/node_modules/.lock.sha256 2>/dev/null) != "$lock_sum" ]]; then
    say "installing playwright-core (npm) for the browser test"
    (cd tests/browser && npm ci --no-audit --no-fund --silent)
    echo "$lock_sum" > tests/browser/node_modules/.lock.sha256
  fi
  # azurite (npm), Azure Storage's emulator, for the remote-repository tests: as locked, in
  # VG_HOME beside the venv (360 MB: kept out of the clone, installed once per machine).
  if ((test_tools)); then
    az_sum=$(cat tests/storage/package.json tests/storage/package-lock.json | sha256sum | cut -d' ' -f1)
    if [[ $(cat "$VG_AZURITE_DIR/.lock.sha256" 2>/dev/null) != "$az_sum" ]]; then
      say "installing azurite (npm) into $VG_AZURITE_DIR for the remote-repository tests"
      rm -rf "$VG_AZURITE_DIR" && mkdir -p "$VG_AZURITE_DIR"
      cp tests/storage/package.json tests/storage/package-lock.json "$VG_AZURITE_DIR/"
      (cd "$VG_AZURITE_DIR" && npm ci --no-audit --no-fund --silent)
      echo "$az_sum" > "$VG_AZURITE_DIR/.lock.sha256"
    fi
  fi
  # checkov, the policy linter of tests/python/test_deploy.py: its many pins would fight the
  # test venv's, so it has a venv of its own beside it.
  if ((test_tools)) && [[ $(cat "$VG_CHECKOV_VENV/.requirements" 2>/dev/null) != "$CHECKOV_REQ" ]]; then
    say "installing $CHECKOV_REQ into $VG_CHECKOV_VENV"
    rm -rf "$VG_CHECKOV_VENV" && python3 -m venv "$VG_CHECKOV_VENV"
    "$VG_CHECKOV_VENV/bin/pip" install -q --disable-pip-version-check "$CHECKOV_REQ"
    echo "$CHECKOV_REQ" > "$VG_CHECKOV_VENV/.requirements"
  fi
fi

if wants venv; then
  # The torch wheel is libtorch for the build; the model packages export the model.
  reqs=(scripts/requirements.txt)
  ((test_tools)) && reqs+=(scripts/requirements-test.txt)
  want=$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
  if [[ ! -x $VG_PY ]]; then
    say "creating venv at $VG_VENV"
    mkdir -p "$(dirname "$VG_VENV")"
    python3 -m venv "$VG_VENV"
  fi
  if [[ $(cat "$VG_VENV/.requirements.sha256" 2>/dev/null) != "$want" ]]; then
    say "installing ${reqs[*]} into the venv (torch with its CUDA libraries: about 5 GB)"
    "$VG_PY" -m pip install -q --disable-pip-version-check "${reqs[@]/#/-r}"
    echo "$want" > "$VG_VENV/.requirements.sha256"
  fi
fi
source scripts/env.sh  # now that the venv exists, LIBTORCH is known

if wants model; then
  "$VG_PY" scripts/export_model.py
fi

if wants build; then
  # The link .cargo/config.toml points LIBTORCH at, for plain `cargo build` in this clone.
  if [[ $(readlink .libtorch 2>/dev/null) != "$LIBTORCH" ]]; then
    ln -sfn "$LIBTORCH" .libtorch
  fi
  say "cargo build --release (target: $CARGO_TARGET_DIR)"
  cargo build --release --quiet
  say "ready: $VG_BIN"
fi
