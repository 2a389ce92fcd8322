# make demo | make test | make lint | make bench | make test-te
# Each target creates and uses .venv itself. torch is the CPU build 2.13.0: never a CUDA torch here.
# Where plain pip would pick a CUDA wheel for torch==2.13.0 (most Linux x86 hosts without a local
# wheel), point TORCH_INDEX at PyTorch's CPU wheel index: make demo TORCH_INDEX=<url>.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= torchao,report,slurm,tensorboard,wandb,dev
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench test-te install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

demo: $(STAMP)
	VENV=$(VENV) bash scripts/demo.sh

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not te"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not te and not slow and not slurm"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/shellcheck -S warning scripts/*.sh $(wildcard *.sbatch *.sh scripts/*.sbatch scripts/image/*.sh scripts/slurm/*.sh scripts/slurm/*.sbatch scripts/gpu/*.sh scripts/offline/*.sh)
	$(VENV)/bin/hadolint $(wildcard *.dockerfile)

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

test-te:
	bash scripts/setup_te_venv.sh
	$${TE_VENV:-.venv-te}/bin/python -m pytest -q -m te tests/models/te

clean:
	rm -rf $(VENV) runs .pytest_cache
