# The two set-up commands (README): `make grpo` and `make test`. Each installs whatever is missing
# into .venv (a second run installs nothing) and then does its job. No sudo, no GPU needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forge-installed
ARGS ?=

.PHONY: install grpo test bench

install: $(STAMP)

$(STAMP): pyproject.toml
	@echo "forge: creating $(VENV) and installing the pinned stack (first run only: a few minutes, ~7.5 GB)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	$(PY) -m forge.native install
	@touch $(STAMP)
	@echo "forge: installed"

grpo: $(STAMP)
	$(PY) -m apps.grpo --config configs/grpo_tiny.yaml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)
