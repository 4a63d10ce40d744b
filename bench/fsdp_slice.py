"""PPO sharded on a slice of a real architecture, here, with no download: Qwen3-8B's widths (hidden 4096, 32 heads,
8 kv heads, head_dim 128, intermediate 12288, 151,936 vocabulary rows, untied output layer) with 2 decoder layers
and random weights in bf16, one PPO update of a few short episodes, whole (`device=cpu`) and sharded
(`device=cpu-fsdp`, 2 processes). Prints per run: exit code, wall time, each process's peak RSS (VmHWM), whether
the first-update KL check passed (the run would have stopped) and whether the adapter moved.

    .venv/bin/python bench/fsdp_slice.py [--work DIR] [--runs cpu,cpu-fsdp]

The policy is the random base itself (no SFT: PPO reads any plain model directory); the reward model is the same
weights as a sequence classifier with a random score head; the value model a LoRA on it (ppo.value_lora).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RLHF = [sys.executable, "-m", "rlhf_cli.cli"]  # also where no `rlhf` script sits beside python
WIDTHS = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, embedding_rows=151936)


def build(work: Path) -> tuple[Path, Path]:
    """(policy dir, reward dir): the slice in bf16 with its own output layer, and the same as a classifier."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.tiny import build_tiny_base

    policy, reward = work / "policy", work / "reward"
    if (policy / "config.json").is_file() and (reward / "config.json").is_file():
        return policy, reward
    tiny = build_tiny_base(work / "tiny", **WIDTHS)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    m.config.tie_word_embeddings = False
    m.lm_head.weight = torch.nn.Parameter(torch.randn_like(m.lm_head.weight) * 0.02)  # untied, as Qwen3-8B
    tok = AutoTokenizer.from_pretrained(tiny)
    m.save_pretrained(policy)
    tok.save_pretrained(policy)
    del m
    rm = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.bfloat16)
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(reward)
    tok.save_pretrained(reward)
    return policy, reward


def peak_rss(root: int) -> dict[int, float]:
    """Each process under `root` (itself included) -> its peak RSS in GiB so far (VmHWM)."""
    import psutil

    out = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[p.pid] = int(line.split()[1]) / 1024 ** 2
        except OSError:
            pass
    return out


def current_rss(root: int) -> list[tuple[float, float]]:
    """(anonymous, file-backed) resident GiB of each process under `root` (RssAnon, RssFile + RssShmem): memory
    the process allocated, and pages of mapped files (safetensors) it touched, shared with the page cache."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []
    out = []
    for p in procs:
        try:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in
                                                    Path(f"/proc/{p.pid}/status").read_text().splitlines())
                  if k in ("RssAnon", "RssFile", "RssShmem")}
        except (OSError, ValueError):
            continue
        out.append((kb.get("RssAnon", 0) / 1024 ** 2, (kb.get("RssFile", 0) + kb.get("RssShmem", 0)) / 1024 ** 2))
    return out


def run(work: Path, device: str, policy: Path, reward: Path, gather: bool = True) -> dict:
    out = work / f"ppo-{device}"
    args = ["ppo", f"run_dir={work / 'run'}", f"device={device}", "device.threads=1", f"ppo.policy_dir={policy}",
            f"ppo.reward_dir={reward}", f"ppo.output_dir={out}", "ppo.fresh=true", "model.dtype=bfloat16",
            "device.fast_paths=off",  # the whole run on the sharded run's code path (fsdp turns them off itself)
            "device.mixed_precision=bf16", "data=demo", "data.max_rows=32", "ppo.value_lora=true",
            # 4 episodes, one update: 2 processes × 2, or one process × 2 × 2 accumulation
            "ppo.total_episodes=4", "ppo.per_device_train_batch_size=2",
            f"ppo.gradient_accumulation_steps={1 if device == 'cpu-fsdp' else 2}", "ppo.num_mini_batches=1",
            "ppo.num_ppo_epochs=1",
            "ppo.rollout_forward_batch_size=2", "ppo.response_length=8", "ppo.eval_every=0", "ppo.learning_rate=1e-3",
            "ppo.lora.target_modules=all-linear"]
    if device == "cpu-fsdp" and not gather:  # sampling gathers layer by layer, per token: no whole policy
        args.append("device.fsdp.gather_for_sampling=false")
        out = work / "ppo-cpu-fsdp-layerwise"
        args[args.index(f"ppo.output_dir={work / 'ppo-cpu-fsdp'}")] = f"ppo.output_dir={out}"
        device = "cpu-fsdp-layerwise"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    log = work / f"ppo-{device}.log"
    t0 = time.perf_counter()
    peaks: dict[int, float] = {}
    timeline = []  # (seconds, anonymous GiB, file-backed GiB) of the process with the most: where the peak falls
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen([*RLHF, *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
        while proc.poll() is None:
            for pid, gib in peak_rss(proc.pid).items():
                peaks[pid] = max(peaks.get(pid, 0.0), gib)
            anon, file = max(current_rss(proc.pid) or [(0.0, 0.0)], key=sum)
            timeline.append((round(time.perf_counter() - t0, 1), round(anon, 2), round(file, 2)))
            time.sleep(0.5)
    (work / f"ppo-{device}.rss.json").write_text(json.dumps(timeline) + "\n", encoding="utf-8")
    text = log.read_text(encoding="utf-8", errors="replace")
    moved = None
    if (out / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        b = [v for k, v in load_file(str(out / "adapter_model.safetensors")).items() if "lora_B" in k]
        moved = sum(int((v != 0).sum()) for v in b) / max(sum(v.numel() for v in b), 1)
    return {"device": device, "exit": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_gib": sorted((round(g, 2) for g in peaks.values()), reverse=True)[:3],
            "kl_check_passed": proc.returncode == 0 and "before any update" not in text,
            "adapter_B_nonzero_fraction": moved, "log": str(log)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(REPO / "bench" / "work" / "fsdp_slice"))
    ap.add_argument("--runs", default="cpu,cpu-fsdp")
    ap.add_argument("--gather-for-sampling", default="true", choices=("true", "false"),
                    help="cpu-fsdp: the policy gathered whole for sampling (true) or layer by layer (false)")
    a = ap.parse_args()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    policy, reward = build(work)
    results = [run(work, d, policy, reward, a.gather_for_sampling == "true") for d in a.runs.split(",")]
    (work / "fsdp_slice.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
