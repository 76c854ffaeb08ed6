# The README's commands. Each target sets up .venv first (a no-op when up to date).
PY := .venv/bin/python

.PHONY: setup quickstart test protos bench

setup:
	@bash scripts/setup.sh

## The main job: start the local services (the full GRPO quickstart arrives with the launcher issue).
quickstart: setup
	$(PY) -m flywheel.cli up --check

## Every test CI runs (including real vLLM-on-CPU tests).
test: setup
	$(PY) -m pytest

protos: setup
	$(PY) scripts/gen_protos.py

bench: setup
	$(PY) bench/codec.py
