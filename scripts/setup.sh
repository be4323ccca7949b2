#!/usr/bin/env bash
# Sets visiongate up on a fresh machine (only the package registries reachable) and is a
# no-op when everything is already there: a second run downloads nothing.
#   1. apt: cmake and nasm (for libjpeg-turbo), chromium and node (browser test), only
#      when missing; playwright-core from npm for the browser test
#   2. a venv outside the clone with torch==2.13.0 and the model packages
#   3. the `.libtorch` link to the venv's torch
#   4. models/classifier/1/model.pt, exported when missing or stale
#   5. cargo build --release
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$VG_ROOT"

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }

# 1. System packages: cmake and nasm build libjpeg-turbo; chromium and node run the
#    browser test of the upload page.
need=()
for tool in cmake nasm; do command -v "$tool" >/dev/null || need+=("$tool"); done
[[ -x /usr/bin/chromium ]] || need+=(chromium)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
if ((${#need[@]})); then
  say "installing ${need[*]} (apt)"
  sudo_cmd=(); [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi

# playwright-core (npm) for tests/browser, as locked; skipped when already installed.
lock_sum=$(sha256sum tests/browser/package-lock.json | cut -d' ' -f1)
if [[ $(cat tests/browser/node_modules/.lock.sha256 2>/dev/null) != "$lock_sum" ]]; then
  say "installing playwright-core (npm) for the browser test"
  (cd tests/browser && npm ci --no-audit --no-fund --silent)
  echo "$lock_sum" > tests/browser/node_modules/.lock.sha256
fi

# 2. Python venv (torch wheel = libtorch for the build, plus the model packages).
req=scripts/requirements.txt
want=$(sha256sum "$req" | cut -d' ' -f1)
if [[ ! -x $VG_PY ]]; then
  say "creating venv at $VG_VENV"
  mkdir -p "$(dirname "$VG_VENV")"
  python3 -m venv "$VG_VENV"
fi
if [[ $(cat "$VG_VENV/.requirements.sha256" 2>/dev/null) != "$want" ]]; then
  say "installing $req into the venv (torch with its CUDA libraries: about 5 GB)"
  "$VG_PY" -m pip install -q --disable-pip-version-check -r "$req"
  echo "$want" > "$VG_VENV/.requirements.sha256"
fi
source scripts/env.sh  # now that the venv exists, LIBTORCH is known

# 3. The link .cargo/config.toml points LIBTORCH at, for plain `cargo build` in this clone.
if [[ $(readlink .libtorch 2>/dev/null) != "$LIBTORCH" ]]; then
  ln -sfn "$LIBTORCH" .libtorch
fi

# 4. The bundled model (skipped when up to date).
"$VG_PY" scripts/export_model.py

# 5. The server.
say "cargo build --release (target: $CARGO_TARGET_DIR)"
cargo build --release --quiet
say "ready: $VG_BIN"
