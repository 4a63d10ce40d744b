"""Sampling time of rlhf's fast loop (rlhf_cli.accel.sample_loop.sample_loop) as shipped, with transformers' stock
KV cache instead of the preallocated one, and without the W·xᵀ sampling steps, alternating, on random-init Qwen3
models.

    .venv/bin/python bench/probes/sampling_probe.py --shape mid --dtype float32 --reps 3
    .venv/bin/python bench/probes/sampling_probe.py --shape real --dtype bfloat16 --reps 2

mid: hidden 256, 4 layers, vocabulary 1,500, batch 32, 24-token prompts, 64 sampled tokens (the bench's mid
workload). Prompts are left-padded to the longest, 60-100% of it real tokens. real: Qwen3-0.6B's shape with a
LoRA r 8 adapter on every linear layer (unmerged, as a CPU samples it), batch 8, 53-token prompts, 32 sampled
tokens. 1 thread; every variant draws the same tokens from the same
seed, which the probe checks. Figures measured with it: bench/results/NOTES.md.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {
    "mid": dict(cfg=dict(vocab_size=1500, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=768), batch=32, prompt=24, tokens=64),
    "real": dict(cfg=dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, intermediate_size=3072), batch=8, prompt=53,
                 tokens=32),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import torch
    from transformers import DynamicCache, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from rlhf_cli.accel import sample_loop as loop

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec, dtype = SHAPES[a.shape], getattr(torch, a.dtype)
    model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, **spec["cfg"])).to(dtype).eval()
    if a.shape == "real":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # trainable weights in fp32, as the trainer keeps them
    ids = torch.randint(3, spec["cfg"]["vocab_size"] - 1, (spec["batch"], spec["prompt"]))
    # prompts of different lengths, left-padded as the sampler gets them: 60-100% of the longest
    lengths = torch.randint(int(0.6 * spec["prompt"]), spec["prompt"] + 1, (spec["batch"],))
    mask = (torch.arange(spec["prompt"])[None] >= (spec["prompt"] - lengths)[:, None]).long()
    gen = GenerationConfig(max_new_tokens=spec["tokens"], do_sample=True, temperature=0.7, top_k=0,
                           pad_token_id=0, eos_token_id=None)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    shipped_cache, shipped_rule = loop.preallocated_cache, loop.weight_first
    variants = {
        "as shipped": (shipped_cache, shipped_rule),
        "stock KV cache": (lambda m, capacity: DynamicCache(config=m.config), shipped_rule),
        "x·Wᵀ steps": (shipped_cache, lambda rows, weight: False),
    }
    tokens = {}
    for rep in range(a.reps):
        for name, (cache, rule) in variants.items():
            loop.preallocated_cache, loop.weight_first = cache, rule
            torch.manual_seed(1)
            t0 = time.perf_counter()
            with cast, torch.no_grad(), loop.lora_merged(model) as m:
                out = loop.sample_loop(m, ids, mask, gen, [], 0.7)
            print(f"{a.shape} {a.dtype} rep {rep + 1}: {name:15s} {time.perf_counter() - t0:.3f} s", flush=True)
            tokens.setdefault(name, out["response"])
    loop.preallocated_cache, loop.weight_first = shipped_cache, shipped_rule
    same = all(torch.equal(t, tokens["as shipped"]) for t in tokens.values())
    print(f"same tokens in every variant: {same}")


if __name__ == "__main__":
    main()
