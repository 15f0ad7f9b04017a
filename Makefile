# CPU set-up and checks. `make test` is what CI runs (.ci/run) and what the README states.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The tested CPU stack (README, "Versions"). torch first: it is the CPU build; verl's own torch pins are CUDA-only.
TORCH_VERSION ?= 2.13.0
MEGATRON_CORE_VERSION ?= 0.16.1
export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TORCH_COMPILE_DISABLE := 1

.PHONY: setup lint test bench demo demo-mini clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e ".[dev]" "megatron-core==$(MEGATRON_CORE_VERSION)"
	$(PY) -c "import torch, verl, megatron.core, respo_verl; print('torch', torch.__version__, '| verl', verl.__version__, '| megatron-core', megatron.core.__version__)"
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

bench: setup
	$(PY) scripts/bench_losses.py

# The main job on a CPU machine: verl's own trainer with ReSPO and rollout reuse N = 4 (python -m respo_verl.main_ppo
# algorithm=respo +device=cpu), one line per step, then `respo-verl report` of the run (README, docs/cpu.md).
demo: setup
	$(VENV)/bin/respo-verl demo

# The paper's experiment in miniature, in-process on CPU (docs/mini.md).
demo-mini: setup
	$(VENV)/bin/respo-verl mini

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
