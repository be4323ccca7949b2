#!/usr/bin/env bash
# The fuzz targets (fuzz/, cargo-fuzz with libFuzzer and AddressSanitizer).
#   scripts/fuzz.sh smoke              every target for a few seconds (the test suite's smoke),
#                                      built at opt-level 1 (see below)
#   scripts/fuzz.sh run TARGET [RUNS]  one target for RUNS executions (default 10 million),
#                                      at most an hour, fully optimized
# Targets: decode multipart model_config kserve_json binary_tensors bytes_elements grpc_infer.
# Each starts from its seeds (fuzz/seeds/TARGET, made by fuzz/make_seeds.py) and keeps what
# it finds in the target cache ($CARGO_TARGET_DIR/fuzz-corpus/TARGET); a crash is written to
# $CARGO_TARGET_DIR/fuzz-artifacts/TARGET/ and fails the run. cargo-fuzz needs nightly
# compiler flags: RUSTC_BOOTSTRAP lets the stable toolchain take them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

TARGETS=(decode multipart model_config kserve_json binary_tensors bytes_elements grpc_infer)
fuzz=$(install_tool cargo-fuzz 0.13.2)
export RUSTC_BOOTSTRAP=1
# The targets build the crate without libtorch (fuzz/Cargo.toml): nothing of it to find.
unset LIBTORCH

# The smoke's build: the same instrumentation (AddressSanitizer, libFuzzer's coverage) and
# checks, at opt-level 1 instead of 3, in a target directory of its own so the two builds do
# not undo each other. Full optimization made it a new machine's longest compile (16 min of
# a cold CI) for ten seconds a target; the long runs keep it.
if [[ ${1:-smoke} == smoke ]]; then
  export CARGO_PROFILE_RELEASE_OPT_LEVEL=1
  FUZZ_TARGET_DIR=$CARGO_TARGET_DIR/fuzz-smoke
else
  FUZZ_TARGET_DIR=$CARGO_TARGET_DIR/fuzz
fi

run() {
  local target=$1; shift
  local corpus=$CARGO_TARGET_DIR/fuzz-corpus/$target
  local artifacts=$CARGO_TARGET_DIR/fuzz-artifacts/$target
  mkdir -p "$corpus" "$artifacts"
  "$fuzz" run --fuzz-dir fuzz --target-dir "$FUZZ_TARGET_DIR" "$target" \
    "$corpus" "fuzz/seeds/$target" -- \
    -artifact_prefix="$artifacts/" -rss_limit_mb=3072 -timeout=20 -print_final_stats=1 "$@"
}

# Each build of a changed crate leaves its targets' executables (about 200 MB each) beside
# the previous ones in deps/; the current ones are hard links of the top-level files, so a
# target's executable with a single link is a stale one.
prune_stale() {
  local deps=$FUZZ_TARGET_DIR/x86_64-unknown-linux-gnu/release/deps t
  for t in "${TARGETS[@]}"; do
    find "$deps" -maxdepth 1 -type f -name "$t-*" ! -name '*.d' -links 1 -delete 2>/dev/null || true
  done
}

case ${1:-smoke} in
  smoke)
    "$fuzz" build --fuzz-dir fuzz --target-dir "$FUZZ_TARGET_DIR"
    prune_stale
    for t in "${TARGETS[@]}"; do
      log=$CARGO_TARGET_DIR/fuzz-artifacts/$t.log
      mkdir -p "${log%/*}"
      if ! run "$t" -max_total_time=10 > "$log" 2>&1; then
        tail -40 "$log" >&2
        echo "fuzz smoke: $t failed (log: $log)" >&2
        exit 1
      fi
      echo "fuzz smoke: $t: $(grep -oE 'number_of_executed_units: [0-9]+' "$log" | grep -oE '[0-9]+') runs" >&2
    done ;;
  run)
    run "$2" -runs="${3:-10000000}" -max_total_time=3600 ;;
  *) echo "usage: $0 smoke | run TARGET [RUNS]" >&2; exit 2 ;;
esac
