# rlhf: `make chain` runs the whole pipeline on the embedded tiny default; `make test` runs the tests.
# RECIPE=NAME picks recipes/NAME.yaml; ARGS="key=value ..." passes Hydra overrides to every command.
# TORCH_INDEX=URL installs torch from that wheel index (e.g. https://download.pytorch.org/whl/cpu for the CPU build).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RECIPE ?= tiny
ARGS ?=
TORCH_INDEX ?=
# pytest-xdist processes for make test / test-fast: every test runs torch on one thread, so one per core; each
# worker takes whole modules (their fixtures are built once) in tests/conftest.py's order, the costliest first
TEST_WORKERS ?= 2
RLHF := $(BIN)/rlhf
# the shipped recipes, as `make help` lists them: every recipes/*.yaml beside this Makefile
SHIPPED_RECIPES = $(sort $(basename $(notdir $(wildcard $(dir $(firstword $(MAKEFILE_LIST)))recipes/*.yaml))))

.PHONY: help install sft reward ppo dpo eval chain chain-grpo chain-rule chain-qlora chain-dpo chat test test-fast bench bench-real real-check gpu-check dist clean
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  variables: RECIPE=$(RECIPE) ARGS='$(ARGS)' TORCH_INDEX='$(TORCH_INDEX)'"
	@echo "  recipes (RECIPE=NAME; rlhf recipes describes them): $(SHIPPED_RECIPES)"
	@echo "  CPU-only machine, first install: make chain TORCH_INDEX=https://download.pytorch.org/whl/cpu"

install: $(VENV)/.installed ## create .venv with the project and its test tools

# Without nvidia-smi, torch 2.13.0 is installed first, from the default index (on Linux that is the CUDA build,
# several GB) unless TORCH_INDEX names another (https://download.pytorch.org/whl/cpu: the CPU build).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); fi
	$(BIN)/pip install -q -e '.[test,wandb,qlora]'  # wandb, bitsandbytes: their tests run instead of skipping
	@touch $@

sft: install ## supervised fine-tuning  -> runs/<recipe>/sft
	$(RLHF) sft recipe=$(RECIPE) $(ARGS)

reward: install ## reward model          -> runs/<recipe>/reward
	$(RLHF) reward recipe=$(RECIPE) $(ARGS)

ppo: install ## PPO (LoRA policy)     -> runs/<recipe>/ppo
	$(RLHF) ppo recipe=$(RECIPE) $(ARGS)

dpo: install ## DPO (LoRA policy)     -> runs/<recipe>/dpo
	$(RLHF) dpo recipe=$(RECIPE) $(ARGS)

eval: install ## SFT vs PPO report     -> runs/<recipe>/eval
	$(RLHF) eval recipe=$(RECIPE) $(ARGS)

chain: install ## sft -> reward -> ppo -> eval, in order
	$(RLHF) sft recipe=$(RECIPE) $(ARGS)
	$(RLHF) reward recipe=$(RECIPE) $(ARGS)
	$(RLHF) ppo recipe=$(RECIPE) $(ARGS)
	$(RLHF) eval recipe=$(RECIPE) $(ARGS)

chain-grpo: install ## the tiny chain with GRPO (4 responses per prompt, no value model)
	$(MAKE) chain RECIPE=tiny-grpo ARGS='$(ARGS)'

chain-rule: install ## the tiny chain rewarded by the politeness rule (no reward model in ppo)
	$(MAKE) chain RECIPE=tiny-rule ARGS='$(ARGS)'

chain-qlora: install ## the tiny chain on a 4-bit base: QLoRA sft, reward, ppo / eval with 4-bit frozen weights
	$(RLHF) sft recipe=tiny-qlora $(ARGS)
	$(RLHF) reward recipe=tiny-qlora $(ARGS)
	$(RLHF) ppo recipe=tiny-qlora $(ARGS)
	$(RLHF) eval recipe=tiny-qlora $(ARGS)

chain-dpo: install ## the tiny chain with DPO instead of reward + PPO: sft -> dpo -> eval (recipe tiny-dpo)
	@# an SFT output already finished with these settings is kept (its metrics.json's settings_sha256)
	$(BIN)/python -m rlhf_cli.resume finished sft recipe=tiny-dpo $(ARGS) || $(RLHF) sft recipe=tiny-dpo $(ARGS)
	$(RLHF) dpo recipe=tiny-dpo $(ARGS)
	$(RLHF) eval recipe=tiny-dpo $(ARGS)

chat: install ## chat with the newest trained policy (PPO, else SFT; ARGS="chat.model_dir=..." for another)
	$(RLHF) chat recipe=$(RECIPE) $(ARGS)

test: install ## all tests (unit + the CLI chain on the tiny recipe + 2-process runs), TEST_WORKERS processes
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

test-fast: install ## unit tests only: none that runs an rlhf command (markers cli, slow, dist)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=10 -m "not slow and not dist and not cli"

bench: install ## rlhf vs TRL 1.12 PPOTrainer, side by side (installs TRL 1.12 in bench/.venv-trl112)
	$(BIN)/python bench/run.py

bench-real: install ## rlhf vs TRL 1.12 on Qwen3-0.6B's shape (random weights), LoRA, fp32 and bf16 where the CPU has bf16 units (~40-50 min on 2 cores, ~20 GB RAM)
	$(BIN)/python bench/run.py --real

real-check: install ## the qwen3-0.6b recipe on Qwen3-0.6B's exact shape (random weights), bf16, CPU: every stage (~10 min)
	$(BIN)/python bench/real_check.py $(ARGS)

gpu-check: ## the same chain on one GPU with the recipe's own batches: per-phase tokens/s and GPU memory
	bash bench/gpu_check.sh

dist: install ## build the wheel into dist/ (conf/ and recipes/ inside: `pip install dist/*.whl` works anywhere)
	$(BIN)/pip wheel --no-deps --no-build-isolation -w dist .

clean: ## remove runs/ (checkpoints) but keep .venv
	rm -rf runs
