"""Sampling time of a LoRA policy with its adapter merged into copies of the weights and unmerged, alternating, on
a random-init Qwen3 of the real width: the measurement behind rlhf_cli.accel.limits.CPU_MERGE_MAX_BYTES (on a
CPU a LoRA policy samples merged only while its adapted weights are at most that large).

    .venv/bin/python bench/probes/merge_probe.py --layers 28 --dtype float32 --reps 3

The merge is forced on and off by setting the threshold; batch 8, 53-token prompts, 32 sampled tokens, 1 thread.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from rlhf_cli.accel import sample_loop as loop

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=a.layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True)
    model = get_peft_model(Qwen3ForCausalLM(cfg).to(dtype),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights in fp32, as the trainer keeps them
    ids = torch.randint(0, 150000, (8, 53))
    mask = torch.ones_like(ids)
    gen = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.7, pad_token_id=0, eos_token_id=None,
                           top_k=0)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    for rep in range(a.reps):
        for merged in (True, False):
            loop.CPU_MERGE_MAX_BYTES = 2**62 if merged else 0
            t0 = time.perf_counter()
            with cast, loop.lora_merged(model) as m:
                loop.sample_loop(m, ids, mask, gen, [], 0.7)
            print(f"{a.dtype} {a.layers} layers rep {rep + 1}: {'merged' if merged else 'unmerged'} "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
