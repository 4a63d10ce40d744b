"""Peak memory of PPO's sampling step on Qwen3-0.6B's exact shape (random weights, no download), beside the plan
of `rlhf doctor`.

Each engine runs in a child process of its own: the LoRA policy (r 32, all linear layers, as the recipe) on the
bf16 model, computing under bf16 autocast as PPO does, samples `--prompts` left-padded prompts of
`--prompt-length` tokens for `--tokens` new tokens (fixed length, as without a stop token). The figure is the
process's peak resident memory during the sampling call above its resident memory just before it (VmHWM, reset
through /proc/self/clear_refs), against the doctor's sampling phase for the same sizes: with `--live` (glibc
gives freed memory back at once) and `--warmup` the tensors alone, as a GPU's allocator counts them, against the
phase itself; otherwise against the phase with the CPU allocator's slack plus the stock code's runtime:

    .venv/bin/python bench/sampling_memory.py                       # generate (the engine) and stacked
    .venv/bin/python bench/sampling_memory.py --engines generate --prompts 32 --tokens 200

Engines: `generate` (rlhf_cli.ppo.sampling.generate: log-probs and entropy step by step), `stacked` (what that
engine did before: generate() with output_logits, every step's raw logits stacked into (B, R, V), then
log-probs and entropy over the stack), `loop` (rlhf_cli.accel.sample_loop, the CPU speed path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
             rope_theta=1e6)
PAD, EOS = 151643, 151645
ARCH = ["model.name_or_path=tiny", "model.tiny.hidden_size=1024", "model.tiny.intermediate_size=3072",
        "model.tiny.num_hidden_layers=28", "model.tiny.num_attention_heads=16", "model.tiny.num_key_value_heads=8",
        "model.tiny.head_dim=128", "model.tiny.embedding_rows=151936"]


def status(key: str) -> float:
    """A /proc/self/status field in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def child(engine: str, prompts: int, prompt_length: int, tokens: int, threads: int, warmup: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM

    from rlhf_cli.ppo import core, sampling
    from rlhf_cli.ppo.experience import Sampling

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of the weights at any time
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, pad_token_id=PAD, eos_token_id=EOS)).eval()
    torch.set_default_dtype(torch.float32)
    policy = get_peft_model(model, LoraConfig(r=32, lora_alpha=8, target_modules="all-linear")).eval()
    ids = torch.randint(0, 151000, (prompts, prompt_length))
    mask = torch.ones_like(ids)
    for i in range(0, prompts, 2):  # uneven left padding
        mask[i, : i % prompt_length] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    s = Sampling(max_new_tokens=tokens, temperature=0.7, pad_id=PAD, eos_id=EOS, vocab_size=151669)

    def run(n: int):
        g = Sampling(**{**s.__dict__, "max_new_tokens": n}).generation_config()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            if engine == "generate":
                return sampling.generate(policy, ids, mask, g, [], 0.7, s.vocab_size)
            if engine == "loop":
                return sampling.engine("loop")(policy, ids, mask, g, [], 0.7, s.vocab_size)
            out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=g,
                                  logits_processor=LogitsProcessorList([cut]))
            logits = core.limit_vocab(torch.stack(out.logits, dim=1), s.vocab_size)
            return core.logprobs_and_entropy(logits, out.sequences[:, ids.shape[1]:], 0.7)

    def cut(input_ids, scores):  # the tokenizer's ids only, as the engines sample
        scores[:, s.vocab_size:] = float("-inf")
        return scores

    if warmup:  # the runtime's first-call allocations kept apart (glibc returns what the call freed: see main)
        del_ = run(warmup)
        del del_
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    out = run(tokens)
    peak = status("VmHWM") - before
    del out
    return {"engine": engine, "prompts": prompts, "prompt_length": prompt_length, "tokens": tokens,
            "threads": threads, "warmup_tokens": warmup, "peak_above_start_mib": round(peak, 1)}


def planned(prompts: int, prompt_length: int, tokens: int) -> dict:
    """The doctor's sampling phase for these sizes (LoRA policy, bf16, fast paths off), with the CPU's slack."""
    from rlhf_cli import memory
    from rlhf_cli.config import compose

    cfg = compose("doctor", ["recipe=qwen3-0.6b", *ARCH, "device=cpu", "device.fast_paths=off",
                             "model.dtype=bfloat16", "device.mixed_precision=bf16",
                             f"data.max_prompt_length={prompt_length}", f"ppo.response_length={tokens}",
                             f"ppo.rollout_forward_batch_size={prompts}", "ppo.per_device_train_batch_size=8",
                             f"ppo.gradient_accumulation_steps={max(1, prompts // 8)}"])
    arch = memory.arch_for_model(cfg.model)[0]
    plan = memory.plan_stage(cfg, "ppo", arch, memory.setup_from(cfg, 0))
    names = ("KV cache", "sampling step logits", "prompt forward (one layer)", "autocast copies (sampling)",
             "stock code runtime")
    items = {i.name: round(i.bytes / 2 ** 20, 1) for i in plan.items if i.name in names}
    runtime = items.get("stock code runtime", 0.0)
    return {"sampling_phase_mib": round(plan.phases["sampling"] / 2 ** 20, 1), "slack": plan.slack,
            "with_slack_mib": round(plan.slack * plan.phases["sampling"] / 2 ** 20 + runtime, 1), "items_mib": items}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="generate,stacked")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=0,
                    help="tokens of a first sampling call before the measured one (0: none; the runtime's first-call "
                         "allocations then count, as the plan's 'stock code runtime')")
    ap.add_argument("--live", action="store_true",
                    help="glibc gives freed memory back at once (fixed mmap threshold, trim at 0): the peak is then "
                         "live memory, to compare with the plan's sampling phase without the allocator's slack")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.prompts, a.prompt_length, a.tokens, a.threads, a.warmup)))
        return 0
    plan = planned(a.prompts, a.prompt_length, a.tokens)
    print(json.dumps({"plan": plan}), flush=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if a.live:
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    for engine in a.engines.split(","):
        args = [sys.executable, __file__, "--child", engine, "--prompts", str(a.prompts), "--prompt-length",
                str(a.prompt_length), "--tokens", str(a.tokens), "--threads", str(a.threads), "--warmup", str(a.warmup)]
        out = subprocess.run(args, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["live"] = a.live
        row["within_plan"] = row["peak_above_start_mib"] <= plan["sampling_phase_mib" if a.live else "with_slack_mib"]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
