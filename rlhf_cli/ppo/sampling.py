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

import copy
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
    """transformers' `generate()`; old log-probs and entropies from its raw logits at the scoring temperature,
    taken step by step (`StepStats`): one step's (B, V) logits alive at a time, never the (B, R, V) stack that
    `output_logits` keeps (for Qwen3's 151,936-row head, 32 sequences × 200 tokens: 3.9 GB in fp32)."""
    from transformers import LogitsProcessorList

    stats = StepStats(prompt_ids.shape[1], temperature, vocab_size, _eos_ids(gen_config),
                      int(gen_config.min_new_tokens or 0))
    # EOS masking before min_new_tokens moves into StepStats, after it has read the raw logits: generate()'s own
    # processors run before any given here, and would hide EOS from the scoring distribution
    gen_config = copy.deepcopy(gen_config)
    gen_config.output_logits, gen_config.min_new_tokens = False, 0
    out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config,
                          logits_processor=LogitsProcessorList([stats]), synced_gpus=synced_sampling(policy))
    response = out.sequences[:, prompt_ids.shape[1]:]
    logprobs, entropy = stats.finish(response)
    return {"response": response, "logprobs": logprobs, "entropy": entropy}


def _eos_ids(gen_config) -> list[int]:
    eos = gen_config.eos_token_id
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


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



class StepStats:
    """A generate() logits processor, called once per sampled token with that step's raw logits (B, V): keeps
    them (cut to the tokenizer's ids) until the next call, where the token sampled from them is known
    (`input_ids[:, -1]`), and takes its log-prob and the entropy at the scoring temperature, the formulas of
    `core.logprobs_and_entropy`. Then, for sampling only: ids past the tokenizer and, for the first
    `min_new_tokens` steps, the stop ids get -inf. `finish(response)` returns (logprobs, entropy), each (B, R)."""

    def __init__(self, prompt_length: int, temperature: float, vocab_size: int | None, eos_ids: list[int],
                 min_new_tokens: int) -> None:
        self.prompt_length, self.temperature, self.vocab_size = prompt_length, float(temperature), vocab_size
        self.eos_ids, self.min_new_tokens = eos_ids, min_new_tokens
        self.logprobs: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []
        self.pending: torch.Tensor | None = None  # (B, V) the last step's logits, its token not yet sampled

    def _take(self, tokens: torch.Tensor) -> None:
        lp, ent = core.logprobs_and_entropy(self.pending[:, None], tokens[:, None], self.temperature)
        self.logprobs.append(lp[:, 0])
        self.entropy.append(ent[:, 0])
        self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = core.limit_vocab(scores, self.vocab_size).clone()
        if self.vocab_size is not None and scores.shape[-1] > self.vocab_size:
            scores[:, self.vocab_size:] = float("-inf")
        if self.eos_ids and input_ids.shape[1] - self.prompt_length < self.min_new_tokens:
            scores[:, self.eos_ids] = float("-inf")
        return scores

    def finish(self, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R = response.shape[1]
        if self.pending is not None and len(self.logprobs) < R:
            self._take(response[:, len(self.logprobs)])
        if len(self.logprobs) < R:
            raise RuntimeError(f"generate() sampled {R} tokens but scored {len(self.logprobs)} steps")
        self.pending = None
        # a generate() that steps once past its stop (a deferred stop check) scored a token it then dropped
        return torch.stack(self.logprobs[:R], dim=1), torch.stack(self.entropy[:R], dim=1)
