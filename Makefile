# The two commands of the README: `make run` and `make test`. Both set up first
# (scripts/setup.sh: venv, libtorch, model export, build), which is a no-op when done.
SHELL := /bin/bash
ENV := source scripts/env.sh

.PHONY: setup run test deny container-test gpu-kit bench fmt clippy openapi

setup:
	@bash scripts/setup.sh

## Serve the bundled model repository on ports 8000 (HTTP).
run: setup
	@$(ENV) && exec "$$VISIONGATE_BIN" --model-repository models $(ARGS)

## Every test: no two modules using each other (scripts/module-deps.sh), `cargo deny check`
## (scripts/deny.sh: advisories, licenses, bans, sources by deny.toml), Rust unit + integration tests (real libtorch, real photos), the Python
## suite (fidelity against the Python reference, real HTTP clients) and the container test
## (the image and `docker compose up`, see container-test).
test: setup
	@bash scripts/module-deps.sh > /dev/null
	@bash scripts/deny.sh
	@$(ENV) && cargo test --release
	@$(ENV) && "$$VISIONGATE_PYTHON" -m pytest -q tests/python
	@bash scripts/container-test.sh

## Known vulnerabilities, licenses, banned crates and sources of every dependency.
deny:
	@bash scripts/deny.sh

## The image built from the Dockerfile and `docker compose up` on the CPU, checked as users
## use it (rootful podman; prepares it first). About 25 minutes cold, a few after an edit.
container-test:
	@bash scripts/container-test.sh

## A visiongate build against torch 2.11 (tch 0.24) packed with the model, the test photos
## and scripts/gpu-check.sh into gpu-kit/ (under 64 MiB), then its check run on this CPU.
gpu-kit:
	@bash scripts/gpu-kit.sh

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
