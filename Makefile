# The two commands of the README: `make run` and `make test`. Both set up first
# (scripts/setup.sh: venv, libtorch, model export, build), which is a no-op when done.
SHELL := /bin/bash
ENV := source scripts/env.sh

.PHONY: setup run test deny fuzz load soak fairness scale-out container-test gpu-kit bench fmt clippy openapi

setup:
	@bash scripts/setup.sh

## Serve the bundled model repository on ports 8000 (HTTP).
run: setup
	@$(ENV) && exec "$$VISIONGATE_BIN" --model-repository models $(ARGS)

## Every test: no two modules using each other (scripts/module-deps.sh), `cargo deny check`
## (scripts/deny.sh: advisories, licenses, bans, sources by deny.toml), `cargo check` of each
## runtime feature alone, both and neither (scripts/features.sh), Rust unit + integration
## tests (real libtorch, real photos), 10 s of each fuzz target (scripts/fuzz.sh), the Python
## suite (fidelity against the Python reference, real HTTP clients) and the container test
## (the image and `docker compose up`, see container-test).
## scripts/test.sh runs them (the container image's build beside the compile-only steps)
## and prints each one's time.
test: setup
	@bash scripts/test.sh

## Every fuzz target for 10 million runs (an hour at most each); TARGET=name for one.
fuzz:
	@for t in $${TARGET:-decode multipart model_config kserve_json binary_tensors bytes_elements grpc_infer}; do \
	  bash scripts/fuzz.sh run $$t || exit 1; done

## Mixed load on the real binary (scripts/load.py): 10,000 requests of every kind at
## concurrency 64, each answer checked; ARGS="--requests N --concurrency C" to change.
load: setup
	@$(ENV) && "$$VISIONGATE_PYTHON" scripts/load.py $(ARGS)

## The same load for 10 minutes, the server's resident memory plotted to
## test-artifacts/soak.png (and .csv); fails if it grew 5% or more after warm-up.
soak: setup
	@mkdir -p test-artifacts
	@$(ENV) && "$$VISIONGATE_PYTHON" scripts/load.py --duration 600 --soak-png test-artifacts/soak.png $(ARGS)

## A single image's latency alone and during a 1000-photo upload (scripts/fairness.py).
fairness: setup
	@$(ENV) && "$$VISIONGATE_PYTHON" scripts/fairness.py $(ARGS)

## Kubernetes' scale-out, live on loopback (scripts/scale_out.py): three replicas of the
## rendered Deployment sharing one S3 bucket (moto) behind HAProxy, Prometheus with the
## autoscaling rules, the HPA's arithmetic, a rolling model update and a drained replica
## under load; report and plot in test-artifacts/scale-out/ (the test suite runs a short
## form). Then --study: one replica under each kind and level of load, every candidate
## signal beside its throughput (study.md). About 15 minutes in all.
scale-out: setup
	@$(ENV) && "$$VISIONGATE_PYTHON" scripts/scale_out.py $(ARGS) && "$$VISIONGATE_PYTHON" scripts/scale_out.py --study $(ARGS)

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
	@$(ENV) && VISIONGATE_WRITE_OPENAPI=1 cargo test --release --quiet --test it openapi_document_matches_the_code
