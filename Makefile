# Quick-start commands (README): `make demo`, `make test` and `make lint` (ruff, pyproject [tool.ruff]). All three
# create/reuse .venv and install first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# torch: on a machine without an NVIDIA GPU take the local CPU wheel (torch==2.13.0) so that the package's
# torch>=2.11 requirement does not pull a multi-GB CUDA build; with a GPU, pip resolves torch normally.
TORCH_PIN ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "torch==2.13.0")

.PHONY: install demo lint test gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(if $(TORCH_PIN),$(PIP) install -q "$(TORCH_PIN)")
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moestack train

lint: $(STAMP)
	$(VENV)/bin/ruff check moestack tests

test: $(STAMP)
	$(PY) -m pytest

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf runs .pytest_cache
