#!/usr/bin/env bash
# The real recipe on one GPU: Qwen3-0.6B's exact architecture (random weights, no download), bf16, the qwen3-0.6b
# recipe's own batch sizes (32 episodes per PPO update, 200-token responses, 2 updates), sft -> reward -> ppo ->
# eval -> export -> chat. Prints per stage wall time and peak RSS, and per PPO phase (generation, scoring,
# training) seconds and response tokens/s, episodes/s and peak GPU memory beside `rlhf doctor`'s plan.
#
# First the GPU tests (-m gpu): the speed paths give the same numbers as the stock code on CUDA; on two GPUs or
# more, PPO under ddp and fsdp and a sharded sft on the tiny demo.
#
#   bash bench/gpu_check.sh [RUN_DIR]        # ~5 min on one H100/H200-class GPU; nothing in CI needs a GPU
#
# A GPU machine that cannot reach a package index: run `bash bench/gpu_wheels.sh` where pip works, bring .whl/
# along, and this script uses the machine's own python3 (its CUDA torch) with those wheels on top.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/gpu-check}
PY=.venv/bin/python
if [ -d .whl ]; then
  # a machine with no package index (bench/gpu_wheels.sh filled .whl/ elsewhere): its own python3 and CUDA torch,
  # the carried wheels on top, rlhf from this checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rlhf-site .whl/*.whl
  export PYTHONPATH="/tmp/rlhf-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
elif [ ! -x .venv/bin/rlhf ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'   # a CUDA build of torch comes with the GPU machine's default wheel
fi
RLHF=("$PY" -m rlhf_cli.cli)
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible"
from rlhf_cli.models import cuda_bf16_native, resolve_compute_dtype, resolve_dtype
print(f"{torch.cuda.get_device_name(0)}: capability {torch.cuda.get_device_capability(0)}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s)")
print(f"native bf16 {cuda_bf16_native('cuda')}; auto precision: weights {resolve_dtype('auto', 'cuda')}, "
      f"compute {resolve_compute_dtype('auto', 'cuda')}")
PY
# the speed paths of rlhf_cli/accel against the stock code on this GPU (device.fast_paths=on vs off): the same
# numbers are what a path needs before `auto` may turn it on for CUDA (rlhf_cli.accel.PROVEN_ON); the sampling
# loop, the one-token step and the last-layer span against the stock forwards with uneven left padding, for sdpa,
# eager and flash_attention_2 (bf16; skipped unless the flash-attn package is installed)
"$PY" -m pytest -q -rs -m gpu tests/test_fast_paths.py tests/test_tail.py tests/test_sampling.py
# several GPUs: the tiny demo chain's PPO replicated (ddp) and sharded (fsdp), and a sharded sft, each rank on its
# own GPU; NCCL takes only tensors on the process's GPU, so a misplaced one ends these runs
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  MULTI="$RUN_DIR/multi"
  Q=(device.num_processes=2 ppo.total_episodes=256 sft.max_steps=60 reward.max_steps=40 run_dir="$MULTI")
  "${RLHF[@]}" sft device=ddp "${Q[@]}" && "${RLHF[@]}" reward device=ddp "${Q[@]}"
  "${RLHF[@]}" ppo device=ddp "${Q[@]}" ppo.output_dir="$MULTI/ppo-ddp"
  "${RLHF[@]}" ppo device=fsdp "${Q[@]}" ppo.output_dir="$MULTI/ppo-fsdp"
  "${RLHF[@]}" ppo device=fsdp "${Q[@]}" ppo.output_dir="$MULTI/ppo-fsdp-layers" device.fsdp.gather_for_sampling=false
  "${RLHF[@]}" sft device=fsdp "${Q[@]}" sft.output_dir="$MULTI/sft-fsdp"
else
  echo "one GPU: the ddp / fsdp runs need two (skipped)"
fi
exec "$PY" bench/real_check.py --device cuda --precision bf16 --recipe-batches --response-length 200 \
  --run-dir "$RUN_DIR"
