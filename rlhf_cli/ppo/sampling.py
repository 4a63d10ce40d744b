"""Sampling engines behind one interface: prompts in, responses with their log-probs and entropies out.

    generate_chunk(policy, tok, prompt_ids, prompt_mask, gen_config, stop_ids, temperature, fixed_length,
                   vocab_size, engine="generate")

An engine is a function `(policy, prompt_ids, prompt_mask, gen_config, stop_ids, temperature, vocab_size)` that
returns {"response" (B, R), "logprobs" (B, R), "entropy" (B, R)} at the scoring temperature, or None where it does
not implement the settings (then `generate` runs). `generate` is transformers' own `generate()` (what runs on GPUs
until a faster engine is proven there); `loop` is `rlhf_cli.accel.sample_loop` (the CPU default under
`device.fast_paths`). A third engine (vLLM, SGLang) registers itself with `register` and is named by the same
setting, without a change to the trainer.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlhf_cli.ppo import core
from rlhf_cli.ppo.shard import gathered, synced_sampling

Engine = Callable[..., "dict | None"]
_ENGINES: dict[str, Engine] = {}


def register(name: str, engine: Engine) -> None:
    _ENGINES[name] = engine


def engine(name: str) -> Engine:
    """The engine called `name`; `loop` is imported on first use."""
    if name == "loop" and name not in _ENGINES:
        from rlhf_cli.accel import sample_loop

        register("loop", sample_loop.sample)
    if name not in _ENGINES:
        raise ValueError(f"unknown sampling engine {name!r}; known: {', '.join(sorted(_ENGINES))}, loop")
    return _ENGINES[name]


def generate(policy, prompt_ids, prompt_mask, gen_config, stop_ids, temperature: float,
             vocab_size: int | None) -> dict:
    """transformers' `generate()`; old log-probs from its raw logits at the scoring temperature."""
    from transformers import LogitsProcessorList

    procs = LogitsProcessorList([_VocabLimit(vocab_size)] if vocab_size is not None else [])
    out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config,
                          logits_processor=procs, synced_gpus=synced_sampling(policy))
    response = out.sequences[:, prompt_ids.shape[1]:]
    logits = core.limit_vocab(torch.stack(out.logits, dim=1), vocab_size)  # (B, R, V) raw, before temperature
    logprobs, entropy = core.logprobs_and_entropy(logits, response, temperature)
    return {"response": response, "logprobs": logprobs, "entropy": entropy}


register("generate", generate)


@torch.no_grad()
def generate_chunk(policy, tokenizer, prompt_ids, prompt_mask, gen_config, stop_ids, temperature,
                   fixed_length: int | None, vocab_size: int | None = None, engine_name: str = "generate") -> dict:
    """Sample responses for one chunk with the named engine; old log-probs come from the sampling logits (no
    second forward). Returns the engine's fields plus "mask" (B, R), 1 on valid tokens (the stop included)."""
    with gathered(policy):  # a sharded policy's weights gathered once for all tokens (rlhf_cli.ppo.shard)
        g = engine(engine_name)(policy, prompt_ids, prompt_mask, gen_config, stop_ids, temperature, vocab_size)
        if g is None:
            g = generate(policy, prompt_ids, prompt_mask, gen_config, stop_ids, temperature, vocab_size)
    response = g["response"]
    if fixed_length is not None and response.shape[1] < fixed_length:
        raise RuntimeError("generation stopped early although no stop token is configured")
    # tokens after a stop are pad (every engine emits pad there); their log-probs are masked
    response, mask = truncate_at_stop(response, stop_ids, tokenizer.pad_token_id)
    return {"response": response, "mask": mask, "logprobs": g["logprobs"], "entropy": g["entropy"]}


def truncate_at_stop(response: torch.Tensor, stop_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row after its first stop token: (tokens with pad after the stop, float mask incl. the stop)."""
    if not stop_ids:
        return response, torch.ones_like(response, dtype=torch.float32)
    is_stop = torch.isin(response, torch.tensor(stop_ids, device=response.device))
    # a position is valid while no stop token occurred strictly before it
    stops_before = torch.cumsum(is_stop.int(), dim=-1) - is_stop.int()
    mask = (stops_before == 0).float()
    return torch.where(mask.bool(), response, torch.full_like(response, pad_id)), mask



class _VocabLimit:
    """generate() logits processor: ids past the tokenizer get -inf (never sampled)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)

    def __call__(self, input_ids, scores):
        if scores.shape[-1] > self.vocab_size:
            scores[:, self.vocab_size:] = float("-inf")
        return scores
