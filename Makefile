# make demo | make test | make lint | make bench | make test-te | make test-torch214
# Each target creates and uses .venv itself. torch is the CPU build 2.13.0: never a CUDA torch here
# (test-torch214 has its own venv, see there).
# Where plain pip would pick a CUDA wheel for torch==2.13.0 (most Linux x86 hosts without a local
# wheel), point TORCH_INDEX at PyTorch's CPU wheel index: make demo TORCH_INDEX=<url>.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= torchao,report,slurm,tensorboard,wandb,prometheus,mlflow,otlp,s3,dev
STAMP := $(VENV)/.installed
# The real MLflow tracking server the tests start (pyproject's mlflow-server extra: the full mlflow package) lives in
# a venv of its own: the full package brings SciPy, and transformers imports scipy.optimize at its own import wherever
# SciPy is installed, so every training process of the suite paid for it (0.35 CPU s per rank here; about 400 such
# processes in a run of make test). The training venv keeps mlflow-skinny, the client a run needs.
MLFLOW_VENV ?= .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
# Python writes the compiled form of the package's modules (and pytest its rewritten tests) even where the
# environment says not to: the suite starts hundreds of processes, and each would otherwise compile every module it
# imports again (the package's 182 modules compile in 0.36 s of CPU; a training rank imports about half). The
# folders are ignored by git and left out of the image.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-fast lint bench test-te test-torch214 install clean

install: $(STAMP)

# --no-compile: pip would compile every module of every package it installs (transformers' thousands of model
# files, most never imported here); the modules a run imports are compiled by its first import instead (above).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e ".[$(EXTRAS)]"
	@touch $@

$(MLFLOW_STAMP): pyproject.toml
	@test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q --no-compile \
		$$(sed -n 's/^mlflow-server = \[\(.*\)\]$$/\1/p' pyproject.toml | tr -d '",')
	@touch $@

demo: $(STAMP)
	VENV=$(VENV) bash scripts/demo.sh

# Three pytest-xdist workers, on two cores too: many tests wait (for Slurm jobs, servers, a hang to be seen) while a
# core is free. Two workers left the CPU idle 14-15 % of a full run on a 2-core machine, three 4 % (1194 s for the
# suite against 1324-1326 s with two; docs/testing.md). Tests that share a session fixture (the local Slurm cluster,
# the S3 server) run in one worker (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

# The two venvs install side by side: they are independent, and pip keeps about one core busy.
test:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(MLFLOW_STAMP)
	LLAMA_FP8_MLFLOW_VENV=$(abspath $(MLFLOW_VENV)) $(PY) -m pytest -q $(XDIST) --durations=30 -m "not gpu and not te"

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not gpu and not te and not slow and not slurm and not container"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/shellcheck -S warning scripts/*.sh $(wildcard *.sbatch *.sh scripts/*.sbatch scripts/image/*.sh scripts/slurm/*.sh scripts/slurm/*.sbatch scripts/gpu/*.sh scripts/offline/*.sh scripts/container/*.sh scripts/container/standin/*.sh)
	$(VENV)/bin/hadolint $(wildcard *.dockerfile scripts/container/standin/*.dockerfile tests/cluster/container/*.dockerfile)

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

test-te:
	bash scripts/setup_te_venv.sh
	$${TE_VENV:-.venv-te}/bin/python -m pytest -q -m te tests/models/te

# The torch of the NGC image line (26.09: NVIDIA's 2.14 build) beside the pinned CPU 2.13: the tests that cover
# what a torch upgrade can break (FSDP2, DTensor/TP, DCP checkpoints and their safe reader, torchao FP8,
# torch.compile, the fault matrix's checkpoint rows, the memory estimate's fake-mode corrections and its equality
# with a real run: the pre-job check runs in the image's torch), in their own venv, on CPU. torch 2.14.1 here is the
# CUDA build from local disk (as for test-te); elsewhere point TORCH_INDEX at PyTorch's CPU wheel index so pip
# never fetches a multi-GB CUDA build: make test-torch214 TORCH_INDEX=<url>. Two workers, as make test.
TORCH214_VENV ?= .venv-torch214
TORCH214_SPEC ?= torch==2.14.1
TORCH214_TESTS ?= \
	tests/parallel/test_distributed.py::test_two_rank_fsdp_trains_agrees_and_shards \
	'tests/parallel/test_nd.py::test_tensor_parallel_trains_like_one_rank[fp8]' \
	tests/parallel/test_nd.py::test_resume_reshards_between_layouts \
	tests/parallel/test_nd.py::test_causal_sdpa_for_context_parallelism_gives_hfs_logits \
	tests/parallel/test_nd.py::test_mesh_dims_fill_rank_coordinates_and_groups \
	tests/parallel/test_scale.py::test_compile_per_block_trains_like_eager \
	tests/parallel/test_scale.py::test_fp8_all_gather_tracks_plain_fp8 \
	tests/parallel/test_scale.py::test_activation_checkpointing_wraps_every_block \
	tests/checkpoint/test_save_resume.py::test_resume_reproduces_the_uninterrupted_run_bitwise \
	tests/checkpoint/test_save_resume.py::test_hf_export_gives_the_trained_models_logits \
	tests/checkpoint/test_save_resume.py::test_dcp_metadata_is_read_with_an_allow_list \
	tests/checkpoint/test_save_resume.py::test_per_rank_state_round_trips_exactly_without_pickles \
	tests/checkpoint/test_hostile_files.py \
	tests/checkpoint/test_block_reads.py \
	tests/reliability/test_damaged_checkpoints.py \
	tests/precision/test_precision.py \
	tests/precision/test_fp8_check.py::test_all_gather_bytes_of_fp8_weights_halve_with_fp8_all_gather_on_2_gloo_ranks \
	tests/precision/test_fp8_check.py::test_a_silent_bf16_all_gather_on_2_gloo_ranks_stops_the_run_naming_it \
	tests/models/test_common.py \
	tests/models/te/test_te_model.py \
	tests/models/te/test_te_master_weights.py \
	tests/estimate/test_corrections.py \
	tests/estimate/test_equality.py::test_estimate_equals_the_real_run_to_the_byte \
	tests/estimate/test_equality.py::test_estimate_equals_a_tracked_step_of_train_itself \
	tests/estimate/test_closed_forms.py

test-torch214:
	@$(MAKE) --no-print-directory install VENV=$(TORCH214_VENV) TORCH_SPEC="$(TORCH214_SPEC)" EXTRAS=torchao,dev
	CUDA_VISIBLE_DEVICES= $(TORCH214_VENV)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) --durations=15 \
		-m "not gpu and not te and not slurm and not container" $(TORCH214_TESTS)

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) runs .pytest_cache
