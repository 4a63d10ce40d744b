#!/usr/bin/env bash
# The GPU check in one call of the lent GPU machine, everything it learns copied to one folder.
#
# The call (a GPU machine that runs one command in a copy of this checkout and brings back at most 8 files of
# $OUT). First, here where pip works: `bash bench/gpu_wheels.sh` (fills .whl/ and ignores it, so it can be carried).
#
#   command:   bash bench/gpu_check.sh "$OUT"
#   carry:     [".whl"]
#   timeout_s: 590
#
# Steps, each bounded by `timeout`, each run whatever the one before it gave (no `set -e`), all inside
# GPU_CHECK_BUDGET seconds (below) so that the files are copied before the call's limit:
#   setup      .whl/ there: its wheels on top of the machine's python3 (its CUDA torch), rlhf from this checkout
#   versions   python, torch (CUDA, GPUs), transformers, trl, peft, ... -> versions.txt (setup's output first)
#   pytest     -m gpu on every test file with CUDA cases: the speed paths give the stock code's numbers on CUDA
#              (device.fast_paths=on vs off, what `auto` needs before it turns a path on: rlhf_cli.accel.PROVEN_ON);
#              the sampling loop, the one-token step and the last-layer span against the stock forwards with
#              uneven left padding for sdpa, eager and flash_attention_2 (bf16; skipped without flash-attn)
#              -> pytest.log
#   chain      bench/real_check.py: Qwen3-0.6B's exact architecture (random weights, no download), bf16, the
#              qwen3-0.6b recipe's own batches (32 episodes per PPO update, 200-token responses, 2 updates),
#              sft -> reward -> ppo -> dpo -> eval -> export -> chat; per stage wall time, peak RSS and GPU memory
#              beside `rlhf doctor`'s plan, per PPO phase tokens/s -> real_check.json, and every stage's log
#              (and the chain's own output) one after the other in stages.log
#   multi-gpu  two GPUs or more, in the time left: the tiny demo's PPO under ddp and fsdp and a sharded sft, each
#              rank on its own GPU (NCCL takes only tensors on the process's GPU) -> multi-gpu.log
# and last summary.txt: each step's exit code and seconds. The script exits non-zero when a step failed, after
# every step ran and every file was copied.
#
#   bash bench/gpu_check.sh [OUT_DIR]        # OUT_DIR default: the run dir
#
# Environment:
#   GPU_CHECK_DEVICE=cuda|cpu   cpu: no CUDA asked for, the chain on the tiny demo model (bench/real_check.py
#                               --tiny, one thread): the script itself, proven on a CPU (tests/test_gpu_check.py)
#   GPU_CHECK_TESTS="a.py b.py::t"   the pytest selection (default: the test files with CUDA cases); -m gpu applies
#   GPU_CHECK_RUN_DIR           where the chain's checkpoints go (default runs/gpu-check; not copied)
#   GPU_CHECK_BUDGET            seconds for all steps (default 540: the call's 590 less time to copy and start)
#   GPU_CHECK_TEST_LIMIT        seconds for pytest (default 150; the chain gets what is left, ~3-5 min on an H100)
#   PY                          the python (default: python3 with the wheels where .whl/ is there, else .venv's)
set -uo pipefail
DEVICE=${GPU_CHECK_DEVICE:-cuda}
case "$DEVICE" in cuda|cpu) ;; *) echo "GPU_CHECK_DEVICE must be cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
OUT_DIR=
# resolved before the cd below: a relative OUT_DIR is the caller's
if [ -n "${1:-}" ]; then mkdir -p "$1" && OUT_DIR=$(cd "$1" && pwd) || exit 2; fi
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
RUN_DIR=${GPU_CHECK_RUN_DIR:-runs/gpu-check}
mkdir -p "$RUN_DIR" && RUN_DIR=$(cd "$RUN_DIR" && pwd) || exit 2
OUT_DIR=${OUT_DIR:-$RUN_DIR}
BUDGET=${GPU_CHECK_BUDGET:-540}
TEST_LIMIT=${GPU_CHECK_TEST_LIMIT:-150}
RESERVE=15   # kept back from the last step for the copies and the summary
T0=$SECONDS
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# this run's files only: a file left by an earlier run in the same folder must not come back as this one's
rm -f "$OUT_DIR"/{versions.txt,pytest.log,real_check.json,stages.log,summary.txt,multi-gpu.log}
CHAIN="$RUN_DIR/chain"
rm -rf "$CHAIN" "$RUN_DIR/multi" "$RUN_DIR/chain.out"

NAMES=() RCS=() SECS=()
left() { echo $((BUDGET - (SECONDS - T0))); }
# step NAME LOG CMD...: CMD's output to the console and appended to LOG, its exit code and seconds recorded
step() {
  local name=$1 log=$2 t=$SECONDS rc
  shift 2
  echo "=== $name ($(left) s of the budget left): $* ===" | tee -a "$log"
  "$@" < /dev/null 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "$name: stopped at its time limit (or killed)" | tee -a "$log"
  NAMES+=("$name") RCS+=("$rc") SECS+=($((SECONDS - t)))
}
skip() { NAMES+=("$1") RCS+=("-") SECS+=(0); echo "=== $1: skipped ($2) ==="; }
# bounded SECONDS CMD...: CMD stopped (with its children: timeout signals its process group) after SECONDS, at
# least 1 (timeout takes 0 as no limit at all)
bounded() { local s=$1; shift; [ "$s" -ge 1 ] || s=1; timeout --kill-after=10 "$s" "$@"; }

if [ -n "${PY:-}" ]; then
  :
elif [ -d .whl ]; then
  # no package index on the lent machine: its own python3 and CUDA torch, the carried wheels on top
  step setup "$OUT_DIR/versions.txt" bounded 120 python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/rlhf-site .whl/*.whl
  export PYTHONPATH="/tmp/rlhf-site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
else
  if [ ! -x .venv/bin/rlhf ]; then
    python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip &&
      .venv/bin/pip install -q -e '.[test]'   # a CUDA build of torch comes with the GPU machine's default wheel
    T0=$SECONDS   # a machine with a package index is not the lent one: the install is outside the call's limit
  fi
  PY=.venv/bin/python
fi

versions() {
  bounded 90 "$PY" - "$DEVICE" <<'PY'
import importlib.metadata as md
import platform
import subprocess
import sys

device = sys.argv[1]
print(f"python {platform.python_version()} ({sys.executable})")
for dist in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "hydra-core", "omegaconf",
             "tokenizers", "safetensors", "numpy", "pytest", "bitsandbytes", "flash-attn"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    print(f"checkout {rev.stdout.strip() or 'not a git checkout'}")
except (OSError, subprocess.SubprocessError):
    print("checkout: no git")
import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
for i in range(n):
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}, capability {torch.cuda.get_device_capability(i)}, "
          f"{torch.cuda.get_device_properties(i).total_memory / 1024 ** 3:.1f} GiB")
print(f"GPU count: {n}")
if n:
    from rlhf_cli.models import cuda_bf16_native, resolve_compute_dtype, resolve_dtype

    print(f"native bf16 {cuda_bf16_native('cuda')}; auto precision: weights {resolve_dtype('auto', 'cuda')}, "
          f"compute {resolve_compute_dtype('auto', 'cuda')}")
if device == "cuda" and not n:
    sys.exit("no CUDA GPU visible (GPU_CHECK_DEVICE=cpu runs the check on the CPU)")
PY
}
step versions "$OUT_DIR/versions.txt" versions
GPUS=$(awk '/^GPU count:/{print $3}' "$OUT_DIR/versions.txt")

if [ -n "${GPU_CHECK_TESTS:-}" ]; then
  read -r -a TESTS <<< "$GPU_CHECK_TESTS"
else
  # every test file with CUDA cases: marked gpu itself, or taking its places from tests/places.py
  mapfile -t TESTS < <(grep -lE 'pytest\.mark\.gpu|from places import|on_cuda\(' tests/test_*.py)
fi
T=$(left)
T=$(( T - 60 < TEST_LIMIT ? T - 60 : TEST_LIMIT ))   # a minute at least stays for the chain
step pytest "$OUT_DIR/pytest.log" bounded "$T" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu "${TESTS[@]}"

if [ "$DEVICE" = cuda ]; then
  CHAIN_ARGS=(--device cuda --precision bf16 --recipe-batches --response-length 200)
else
  CHAIN_ARGS=(--tiny --device cpu --threads 1)
fi
step chain "$RUN_DIR/chain.out" bounded $(( $(left) - RESERVE )) "$PY" bench/real_check.py "${CHAIN_ARGS[@]}" \
  --run-dir "$CHAIN"

multi_gpu() {
  local m="$RUN_DIR/multi" rc=0 r
  local q=(device.num_processes=2 ppo.total_episodes=256 sft.max_steps=60 reward.max_steps=40 run_dir="$m")
  # each run's exit code in the log; the first failure is the block's
  multi_run() { echo "--- rlhf $*"; bounded $(( $(left) - RESERVE )) "$PY" -m rlhf_cli.cli "$@"; r=$?
                echo "--- exit $r"; [ "$rc" != 0 ] || rc=$r; return "$r"; }
  if multi_run sft device=ddp "${q[@]}" && multi_run reward device=ddp "${q[@]}"; then
    multi_run ppo device=ddp "${q[@]}" ppo.output_dir="$m/ppo-ddp"
    multi_run ppo device=fsdp "${q[@]}" ppo.output_dir="$m/ppo-fsdp"
    multi_run ppo device=fsdp "${q[@]}" ppo.output_dir="$m/ppo-fsdp-layers" device.fsdp.gather_for_sampling=false
    multi_run sft device=fsdp "${q[@]}" sft.output_dir="$m/sft-fsdp"
  fi
  return "$rc"
}
if [ "${GPUS:-0}" -lt 2 ]; then
  skip multi-gpu "${GPUS:-0} GPU(s): ddp / fsdp need two"
elif [ "$(left)" -lt $((60 + RESERVE)) ]; then
  skip multi-gpu "$(left) s left"
else
  step multi-gpu "$OUT_DIR/multi-gpu.log" multi_gpu
fi

# one file for all stage logs: the call brings back 8 files at most
{
  echo "===== real_check.py output ($CHAIN) ====="
  cat "$RUN_DIR/chain.out" 2>/dev/null
  for s in sft reward ppo dpo eval export chat; do
    echo "===== stage $s: $CHAIN/$s.log ====="
    cat "$CHAIN/$s.log" 2>/dev/null || echo "(not run)"
  done
} > "$OUT_DIR/stages.log"
cp "$CHAIN/real_check.json" "$OUT_DIR/" 2>/dev/null || echo "no real_check.json: the chain wrote none" >&2

failed=()
{
  echo "gpu_check on $DEVICE: $((SECONDS - T0)) s of a $BUDGET s budget"
  for i in "${!NAMES[@]}"; do
    printf '%-10s exit %-4s %5s s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
    case "${RCS[$i]}" in 0|-) ;; *) failed+=("${NAMES[$i]}") ;; esac
  done
  if [ "${#failed[@]}" -eq 0 ]; then echo "result: ok"; else echo "result: FAILED (${failed[*]})"; fi
} > "$OUT_DIR/summary.txt"
cat "$OUT_DIR/summary.txt"
[ "${#failed[@]}" -eq 0 ]
