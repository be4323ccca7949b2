# The two commands of the README: `make run` and `make test`. Both set up first
# (scripts/setup.sh: venv, libtorch, model export, build), which is a no-op when done.
SHELL := /bin/bash
ENV := source scripts/env.sh

.PHONY: setup run test bench fmt clippy openapi

setup:
	@bash scripts/setup.sh

## Serve the bundled model repository on ports 8000 (HTTP).
run: setup
	@$(ENV) && exec "$$VISIONGATE_BIN" --model-repository models $(ARGS)

## Every test: Rust unit + integration tests (real libtorch, real photos) and the Python
## suite (fidelity against the Python reference, real HTTP clients).
test: setup
	@$(ENV) && cargo test --release
	@$(ENV) && "$$VISIONGATE_PYTHON" -m pytest -q tests/python

## Benchmarks (prints figures; not a test).
bench: setup
	@$(ENV) && cargo run --release --quiet --example bench -- $(ARGS)

fmt:
	cargo fmt

clippy: setup
	@$(ENV) && cargo clippy --release --all-targets -- -D warnings

## Rewrites openapi/openapi.json from the code (a test fails while they differ).
openapi: setup
	@$(ENV) && VISIONGATE_WRITE_OPENAPI=1 cargo test --release --quiet --test openapi_document_matches_the_code
