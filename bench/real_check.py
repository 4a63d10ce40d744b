"""The real recipe on the exact Qwen3-0.6B architecture, here, with no download.

Builds Qwen3-0.6B's architecture with random weights (vocab rows 151,936, hidden 1024, 28 layers, 16 heads,
8 kv heads, head_dim 128, intermediate 3072, tied embeddings) and a tokenizer trained on the shipped demo data
(~2,000 tokens: smaller than the embedding, as real Qwen3's 151,669 tokens are), then runs the `qwen3-0.6b`
recipe's chain with small batches:

    sft -> reward -> ppo (2 updates) -> dpo (2 steps) -> eval -> export -> chat

and prints, per stage: exit code, wall time, peak RSS, and `rlhf doctor`'s plan for the same settings.

    .venv/bin/python bench/real_check.py                       # bf16 (the GPU dtype) on the CPU
    .venv/bin/python bench/real_check.py --stages sft,dpo      # some stages only (dpo and reward read sft's output)
    .venv/bin/python bench/real_check.py --precision fp32
    .venv/bin/python bench/real_check.py --device cuda          # the same chain on a GPU (see bench/gpu_check.sh)
    .venv/bin/python bench/real_check.py --tiny                 # the tiny demo model instead: proves the harness

Every stage is the real `rlhf` command in a child process; peak RSS is the child's own (`wait4`). Results go to
<run-dir>/real_check.json (rewritten after each stage, so a chain stopped part way keeps what it measured) and a
Markdown table on stdout.
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
STAGES = ("sft", "reward", "ppo", "dpo", "eval", "export", "chat")  # the chain, in order

ARCH = ["model.name_or_path=tiny", "model.tiny.hidden_size=1024", "model.tiny.intermediate_size=3072",
        "model.tiny.num_hidden_layers=28", "model.tiny.num_attention_heads=16", "model.tiny.num_key_value_heads=8",
        "model.tiny.head_dim=128", "model.tiny.embedding_rows=151936", "model.tiny.vocab_size=2000"]


TINY = ["model.name_or_path=tiny"]  # the tiny demo model at its own size: the chain in seconds per stage


def overrides(run_dir: Path, eval_file: Path, precision: str, device: str, threads: int,
              response_length: int, recipe_batches: bool = False, tiny: bool = False) -> list[str]:
    """The recipe with small batches (CPU), or with its own batch sizes and 2 PPO updates (`recipe_batches`);
    `tiny`: on the tiny demo model instead of Qwen3-0.6B's shape."""
    prec = {"bf16": ["model.dtype=bfloat16", "device.mixed_precision=bf16"],
            "fp32": ["model.dtype=float32", "device.mixed_precision=no"]}[precision]
    dev = ["device=cpu", f"device.threads={threads}"] if device == "cpu" else ["device=cuda"]
    common = ["recipe=qwen3-0.6b", f"run_dir={run_dir}", *(TINY if tiny else ARCH), *prec, *dev, "data=demo",
              "data.ground_truth=demo_polite", f"data.eval_path={eval_file}", "sft.max_steps=2", "reward.max_steps=2",
              f"ppo.response_length={response_length}", "ppo.save_every=1", "eval.num_prompts=4", "dpo.max_steps=2"]
    if recipe_batches:  # the recipe's own per-device batches: 32 episodes per update, 2 updates
        return [*common, "data.max_rows=256", "ppo.total_episodes=64"]
    return [*common, "data.max_rows=64",
            "sft.per_device_train_batch_size=2", "sft.gradient_accumulation_steps=1",
            "sft.per_device_eval_batch_size=4", "sft.eval_steps=100", "sft.logging_steps=1", "sft.max_length=128",
            "reward.per_device_train_batch_size=2", "reward.gradient_accumulation_steps=1",
            "reward.per_device_eval_batch_size=4", "reward.eval_steps=100", "reward.logging_steps=1",
            "reward.max_length=128",
            "ppo.total_episodes=4", "ppo.per_device_train_batch_size=2", "ppo.gradient_accumulation_steps=1",
            "ppo.num_mini_batches=1", "ppo.rollout_forward_batch_size=2", "ppo.learning_rate=1e-5",
            "dpo.per_device_train_batch_size=2", "dpo.gradient_accumulation_steps=1",
            "dpo.per_device_eval_batch_size=4", "dpo.eval_steps=100", "dpo.logging_steps=1", "dpo.max_length=128",
            "eval.batch_size=2"]


def run_stage(args: list[str], log: Path) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in GiB) of one `rlhf` command."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen([*RLHF, *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss / 1024 ** 2  # Linux: KiB


def doctor_plans(ov: list[str]) -> dict[str, float]:
    """GiB per process that `rlhf doctor` plans for sft, reward, ppo and dpo with these overrides."""
    from rlhf_cli import memory
    from rlhf_cli.config import compose
    from rlhf_cli.stages.doctor import data_lengths

    cfg = compose("doctor", ov)
    arch = memory.arch_for_model(cfg.model)[0]
    setup = memory.setup_from(cfg, 0, data_lengths(cfg))  # the data's lengths, as `rlhf doctor` plans
    return {st: memory.plan_stage(cfg, st, arch, setup).peak / 1024 ** 3 for st in ("sft", "reward", "ppo", "dpo")}


def changed_share(run_dir: Path) -> dict[str, float]:
    """Share of the trainable elements of the policy adapter and of the value model's trainable part (its LoRA
    adapter + score head) that the last update changed: the final output against checkpoint-1 (a lower bound on
    the share that moved from the initial values)."""
    from safetensors.torch import load_file

    out = run_dir / "ppo"
    first = out / "checkpoints" / "checkpoint-1"
    shares = {}
    for name, sub in (("policy_adapter", "."), ("value_trainable", "value")):
        end = load_file(str(out / sub / "adapter_model.safetensors"))
        start = load_file(str(first / sub / "adapter_model.safetensors"))
        changed = sum(int((end[k].float() != start[k].float()).sum()) for k in end)
        shares[name] = round(changed / sum(v.numel() for v in end.values()), 4)
    return shares


def dpo_moved(run_dir: Path) -> float:
    """Share of the DPO adapter's B matrices that are no longer zero (LoRA starts them at zero; A starts random, so
    B's elements are the ones that show training moved the adapter)."""
    from safetensors.torch import load_file

    b = [v for k, v in load_file(str(run_dir / "dpo" / "adapter_model.safetensors")).items() if "lora_B" in k]
    return round(sum(int((v != 0).sum()) for v in b) / sum(v.numel() for v in b), 4)


def ppo_phases(m: dict, plan_gib: float) -> dict:
    """Per phase of the last PPO update: seconds and response tokens/s (generation, scoring, training), episodes/s,
    peak GPU memory beside the doctor's plan."""
    episodes = m["total_episodes"] / m["updates"]
    tokens = episodes * m["response/length_mean"]
    phases = {k: m.get(f"time/{k}_s") for k in ("generate", "score", "train")}
    out = {f"{k}_s": round(v, 3) for k, v in phases.items() if v}
    out.update({f"{k}_tokens_per_s": round(tokens / v, 1) for k, v in phases.items() if v})
    out["episodes_per_s"] = round(m["eps"], 3)
    if "memory/peak_gib" in m:
        out["gpu_peak_gib"] = round(m["memory/peak_gib"], 2)
        out.update({f"gpu_{k}_peak_gib": round(m[f"memory/{k}_peak_gib"], 2) for k in ("generate", "score", "train")
                    if f"memory/{k}_peak_gib" in m})
        out["doctor_plan_gib"] = round(plan_gib, 2)
    return out


def gpu_peak(run_dir: Path, stage: str) -> float | None:
    """A stage's peak GPU memory from its metrics.json (sft / reward / dpo: the highest training window; ppo: the
    last update's highest phase); None off CUDA or without one."""
    f = run_dir / stage / "metrics.json"
    m = json.loads(f.read_text()) if f.is_file() else {}
    value = m.get("gpu_train_peak_gib", m.get("memory/peak_gib"))
    return round(value, 2) if value is not None else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "real-check"))
    ap.add_argument("--precision", choices=["bf16", "fp32"], help="default: bf16 (fp32 with --tiny)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, help="CPU threads per stage; default: 2 (1 with --tiny)")
    ap.add_argument("--response-length", type=int, help="default: 16 (8 with --tiny)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny demo model (not Qwen3-0.6B's shape) with batches of 2: the harness itself, e.g. "
                         "bench/gpu_check.sh on a CPU")
    ap.add_argument("--recipe-batches", action="store_true",
                    help="the recipe's own batch sizes (32 episodes per PPO update) instead of batches of 2")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="the stages to run, in this order (reward, ppo and dpo read sft's output, eval also ppo's, "
                         "export and chat ppo's): e.g. sft,dpo")
    a = ap.parse_args(argv)
    if a.tiny and a.recipe_batches:
        ap.error("--tiny runs batches of 2; --recipe-batches is for the real shape")
    a.precision = a.precision or ("fp32" if a.tiny else "bf16")
    a.threads = a.threads or (1 if a.tiny else 2)
    a.response_length = a.response_length or (8 if a.tiny else 16)
    chosen = [s for s in a.stages.split(",") if s]
    if not chosen or set(chosen) - set(STAGES):
        ap.error(f"--stages: choose from {', '.join(STAGES)}")
    run_dir = Path(a.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    eval_file = run_dir / "eval_prompts.jsonl"
    test_rows = (REPO / "rlhf_cli/demo/data/polite_test.jsonl").read_text(encoding="utf-8").splitlines()[:8]
    eval_file.write_text("\n".join(test_rows) + "\n", encoding="utf-8")
    ov = overrides(run_dir, eval_file, a.precision, a.device, a.threads, a.response_length, a.recipe_batches,
                   a.tiny)
    extra = {"eval": ["eval.policies.dpo=" + str(run_dir / "dpo")] if "dpo" in chosen else [],
             "chat": ["prompt=hello", "chat.model_dir=" + str(run_dir / "ppo"), "chat.max_new_tokens=8"]}
    stages = [(s, extra.get(s, [])) for s in STAGES if s in chosen]
    rows = []
    out_file = run_dir / "real_check.json"
    out_file.unlink(missing_ok=True)  # a JSON left by an earlier run must not pass for this one's
    for stage, extra in stages:
        rc, wall, rss = run_stage([stage, *ov, *extra], run_dir / f"{stage}.log")
        rows.append({"stage": stage, "rc": rc, "wall_s": round(wall, 1), "peak_rss_gib": round(rss, 2)})
        print(json.dumps(rows[-1]), flush=True)
        # a caller's time limit can end this process before the summary: what ran so far is on disk
        out_file.write_text(json.dumps({"precision": a.precision, "device": a.device, "threads": a.threads,
                                        "tiny": a.tiny, "partial": True, "stages": rows}, indent=2) + "\n")
        if rc != 0:
            print(f"{stage} failed: see {run_dir / (stage + '.log')}", file=sys.stderr)
            break
    plans = doctor_plans(ov)  # after the stages: the doctor reads the data's lengths with the built tokenizer
    for r in rows:
        plan = plans.get(r["stage"])
        r["plan_gib"] = round(plan, 2) if plan else None
        r["rss_vs_plan"] = round(r["peak_rss_gib"] / plan, 3) if plan else None
        r["gpu_peak_gib"] = gpu_peak(run_dir, r["stage"]) if a.device == "cuda" else None
    result = {"precision": a.precision, "device": a.device, "threads": a.threads, "tiny": a.tiny, "stages": rows}
    if all(r["rc"] == 0 for r in rows) and len(rows) == len(stages):
        if "eval" in chosen:
            result["eval"] = json.loads((run_dir / "eval" / "report.json").read_text())["policies"]
        if "ppo" in chosen:
            result["changed_in_last_update"] = changed_share(run_dir)
            m = result["ppo_metrics"] = json.loads((run_dir / "ppo" / "metrics.json").read_text())
            result["ppo_phases"] = ppo_phases(m, plans["ppo"])
            print(json.dumps(result["ppo_phases"]))
        if "dpo" in chosen:
            result["dpo_lora_b_moved"] = dpo_moved(run_dir)
            result["dpo_metrics"] = json.loads((run_dir / "dpo" / "metrics.json").read_text())
        print(json.dumps({k: result[k] for k in ("changed_in_last_update", "dpo_lora_b_moved", "eval") if k in result}))
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| stage | exit | wall (s) | peak RSS (GiB) | peak GPU (GiB) | doctor plan (GiB) | RSS / plan |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['rc']} | {r['wall_s']} | {r['peak_rss_gib']} | {r['gpu_peak_gib'] or '-'} | "
              f"{r['plan_gib'] or '-'} | {r['rss_vs_plan'] or '-'} |")
    return 0 if all(r["rc"] == 0 for r in rows) and len(rows) == len(stages) else 1


if __name__ == "__main__":
    sys.exit(main())
