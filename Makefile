# The README's commands. Each target sets up .venv first (a no-op when up to date).
PY := .venv/bin/python

.PHONY: setup quickstart test protos bench

setup:
	@bash scripts/setup.sh

## The main job: GRPO on SmolLM2-135M-Instruct with local services (converts the model once; rerun resumes).
## `make quickstart SEED=n`: another seed, in its own run directory (runs/quickstart-seed<n>).
quickstart: setup
	$(PY) -m services.controller run examples/quickstart.yaml $(if $(SEED),--seed $(SEED))

## Every test CI runs (including real vLLM-on-CPU tests), on two workers (docs/testing.md).
test: setup
	$(PY) -m pytest -n 2

protos: setup
	$(PY) scripts/gen_protos.py

bench: setup
	$(PY) bench/codec.py
