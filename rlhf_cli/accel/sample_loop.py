"""The fast sampling engine: a token-by-token loop with a KV cache, without `generate()`'s per-step machinery.

It draws from the distribution `generate()` draws from for the settings it supports (`supported`): EOS masked for
the first `min_new_tokens` tokens, logits / temperature, top-k, top-p, one draw per row. A LoRA policy samples with
its adapter merged into the base weights (`lora_merged`), the cache is preallocated for the whole sample, the steps
after the prefill go through `Decoder` (one-token steps of a Llama-style decoder) where it applies, and on a CPU the
few-row products of the steps run as W·xᵀ where that is the faster form (`weight_first`). Other settings, and
models the decoder does not cover, take the stock forward; `rlhf_cli.ppo.sampling` falls back to `generate()` for
settings the loop does not implement.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch import nn

from rlhf_cli.accel import cpu_linear
from rlhf_cli.accel.decode import Decoder
from rlhf_cli.accel.limits import CPU_MERGE_MAX_BYTES, cpu_fields
from rlhf_cli.hardware import cpu_flag
from rlhf_cli.ppo.core import limit_vocab, position_ids_from

# Generation settings the sampling loop below implements; anything else goes through `generate()`.
_LOOP_KEYS = {"max_new_tokens", "min_new_tokens", "do_sample", "use_cache", "temperature", "top_k", "top_p",
              "output_logits", "output_scores", "return_dict_in_generate", "pad_token_id", "eos_token_id",
              "bos_token_id", "transformers_version", "_from_model_config"}



# Settings that change nothing at these values (generate() would also ignore them).
_NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "typical_p": 1.0,
            "length_penalty": 1.0, "low_memory": None}


def supported(gen_config) -> bool:
    """Whether the loop implements these generation settings."""
    if not gen_config.use_cache or gen_config.max_new_tokens is None:
        return False
    return all(k in _LOOP_KEYS or v in (None, False) or (k in _NEUTRAL and v == _NEUTRAL[k])
               for k, v in gen_config.to_diff_dict().items())



def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row from categorical `probs` (B, V) by inverting the CDF: the first index whose cumulative
    probability exceeds u·total, u ~ U[0, 1). Same distribution as torch.multinomial(probs, 1), whose CPU kernel
    draws B·V exponential variates (25× the cost of this one); a token with probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


@contextlib.contextmanager
def lora_merged(model):
    """Inference with a PEFT LoRA policy at the cost of its base model: every LoRA linear layer temporarily gets
    the merged weight W + scale·B·A as its base weight, and the adapter path is switched off. The original
    weight tensors are put back afterwards (never W + ΔW − ΔW), so the reference model (adapter disabled) does
    not drift. Models without plain LoRA linear layers, and on a CPU adapted weights over CPU_MERGE_MAX_BYTES,
    are used as they are (the adapter then runs beside each weight)."""
    layers = []
    if hasattr(model, "peft_config") and hasattr(model, "disable_adapter"):
        try:
            from peft.tuners.lora.layer import Linear as LoraLinear
            from peft.tuners.lora.layer import LoraLayer
        except ImportError:  # pragma: no cover - peft without LoRA
            LoraLinear = LoraLayer = None
        if LoraLayer is not None:
            layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
            plain = all(type(m) is LoraLinear and isinstance(m.base_layer, nn.Linear) and not m.merged
                        and not any(a in getattr(m, "lora_variant", {}) for a in m.active_adapters)
                        for m in layers)
            if not plain:
                layers = []
    weights = [m.base_layer.weight for m in layers]
    if weights and weights[0].device.type == "cpu" and \
            sum(w.numel() * w.element_size() for w in weights) > CPU_MERGE_MAX_BYTES:
        layers = []
    if not layers:
        yield model
        return
    saved = []
    try:
        with torch.no_grad():
            for m in layers:
                w = m.base_layer.weight
                merged = w.detach().clone()
                for a in m.active_adapters:
                    if a in m.lora_A.keys():
                        merged += m.get_delta_weight(a).to(merged.dtype)
                saved.append((m, w))
                m.base_layer._parameters["weight"] = nn.Parameter(merged, requires_grad=False)
        with model.disable_adapter():
            yield model
    finally:
        for m, w in saved:
            m.base_layer._parameters["weight"] = w


def _choose(raw: torch.Tensor, p: torch.Tensor, masked: torch.Tensor | None, shared: bool, sample: bool,
            temperature: float, warpers: list) -> torch.Tensor:
    """One step's tokens (B,) from the raw logits (B, V): `masked` ids (EOS before min_new_tokens) excluded;
    with `shared`, drawn from `p`, the scoring distribution itself (no warper, same temperature)."""
    if shared:
        # p with the masked tokens at 0: _draw renormalises, which is softmax over the unmasked tokens
        return _draw(p.index_fill(-1, masked, 0.0) if masked is not None else p)
    scores = raw.index_fill(-1, masked, float("-inf")) if masked is not None else raw
    if not sample:
        return scores.argmax(-1)
    if temperature != 1.0:
        scores = scores / temperature
    for w in warpers:
        scores = w(None, scores)
    return _draw(torch.softmax(scores, dim=-1))




@functools.cache
def weight_first_cpu() -> str | None:
    """The kind of CPU `weight_first`'s rules were measured on that this one is: "amx" (Intel, with AMX tiles),
    "amd-f23" (AMD family 23, AVX2), or None (any other: every layer keeps F.linear)."""
    if cpu_flag("_is_amx_tile_supported"):
        return "amx"
    fields = cpu_fields()
    if fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "23":
        return "amd-f23"
    return None


def weight_first(rows: int, weight: torch.Tensor) -> bool:
    """Whether a CPU linear layer over `rows` input rows runs faster as W·xᵀ than as x·Wᵀ (what F.linear asks BLAS
    for), by rules measured per CPU kind for the sampling steps' few rows (bench/probes/linear_probe.py, 1 thread).
    With AMX tiles: bf16 from 2 to 48 rows; fp32 from 16 to 48 rows, or from 8 rows for weights of 1 M values and
    more. AMD family 23 (AVX2), fp32: 4 to 16 rows against weights of 2 M values and more. Other CPUs, and more
    rows, keep F.linear (there the two are even or F.linear wins)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    kind = weight_first_cpu()
    if kind == "amx":
        if weight.dtype == torch.bfloat16:
            return 2 <= rows <= 48
        if weight.dtype == torch.float32:
            return 16 <= rows <= 48 or (8 <= rows <= 48 and weight.numel() >= 2**20)
    if kind == "amd-f23" and weight.dtype == torch.float32:
        return 4 <= rows <= 16 and weight.numel() >= 2**21
    return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as W·xᵀ where `weight_first` says so (else as `cpu_linear.linear`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not weight_first(rows, weight):
        return cpu_linear.linear(x, weight, bias)
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def _weight_first_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


@contextlib.contextmanager
def weight_first_linears(model):
    """While it is open, the model's plain `nn.Linear` layers (PEFT's LoRA layers call theirs) compute through
    `weight_first` where it says so: for the sampling steps, a few rows against every weight."""
    layers = [(m, m.__dict__.get("forward")) for m in model.modules()
              if type(m) is nn.Linear and ("forward" not in m.__dict__ or cpu_linear.is_installed(m))]
    for m, _ in layers:
        m.forward = _weight_first_linear.__get__(m)
    try:
        yield model
    finally:
        for m, before in layers:
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = before


def preallocated_cache(model, capacity: int):
    """A `DynamicCache` whose full-attention layers write into buffers sized for the whole sample (prompt +
    response) and hand out views of the filled part. The stock layer concatenates each step's keys and values
    onto the cache, copying all of it every step (bench/probes/sampling_probe.py measures the share); the attention
    reads the same numbers either way. Other layer kinds (sliding windows, ...) are kept as they are."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class FilledLayer(DynamicLayer):
        def __init__(self) -> None:
            super().__init__()
            self.filled = 0

        def update(self, key_states, value_states, *args, **kwargs):
            n = key_states.shape[-2]
            if not self.is_initialized or self.filled + n > self._k.shape[-2]:
                size = max(capacity, 2 * (self.filled + n))
                k = key_states.new_empty(*key_states.shape[:-2], size, key_states.shape[-1])
                v = value_states.new_empty(*value_states.shape[:-2], size, value_states.shape[-1])
                if self.is_initialized:
                    k[..., : self.filled, :], v[..., : self.filled, :] = self.keys, self.values
                self._k, self._v, self.device, self.is_initialized = k, v, key_states.device, True
            self._k[..., self.filled: self.filled + n, :] = key_states
            self._v[..., self.filled: self.filled + n, :] = value_states
            self.filled += n
            self.keys, self.values = self._k[..., : self.filled, :], self._v[..., : self.filled, :]
            return self.keys, self.values

    cache = DynamicCache(config=getattr(model, "config", None))
    cache.layers = [FilledLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # built without a config: layers appear on first use
        cache.layer_class_to_replicate = FilledLayer
    return cache


def _warpers(gen_config, sample: bool) -> list:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    warpers = []
    if sample and gen_config.top_k:
        warpers.append(TopKLogitsWarper(int(gen_config.top_k)))
    if sample and gen_config.top_p is not None and float(gen_config.top_p) < 1.0:
        warpers.append(TopPLogitsWarper(float(gen_config.top_p)))
    return warpers


def sample_loop(model, prompt_ids, prompt_mask, gen_config, stop_ids, score_temperature: float = 1.0,
                keep_logits: bool = False, vocab_size: int | None = None) -> dict:
    """Token-by-token sampling with a KV cache: {"response" (B, R), "logprobs" (B, R), "entropy" (B, R)} and,
    with keep_logits, the raw "logits" (B, R, V).

    The distribution is generate()'s for these settings: EOS masked for the first `min_new_tokens` tokens,
    logits / temperature, top-k, top-p, then one draw per row (or argmax without sampling). A row that has
    produced a stop token gets pad tokens afterwards, and the loop ends as soon as every row has stopped.
    Log-probs and entropies are those of the raw logits / score_temperature (EOS not masked: the policy's own
    distribution, as the PPO update recomputes it), taken step by step while each (B, V) row block is small."""
    B, device = prompt_ids.shape[0], prompt_ids.device
    R, min_new = int(gen_config.max_new_tokens), int(gen_config.min_new_tokens or 0)
    eos = gen_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(i) for i in eos])
    stop = torch.tensor(stop_ids, device=device) if stop_ids else None
    suppress = torch.tensor(eos, device=device) if eos and min_new > 0 else None
    sample = bool(gen_config.do_sample)
    temperature = float(gen_config.temperature if gen_config.temperature is not None else 1.0)
    score_temperature = float(score_temperature)
    warpers = _warpers(gen_config, sample)
    # sampling at the scoring temperature without warpers: draw from the scoring distribution itself
    shared = sample and not warpers and temperature == score_temperature
    pad = int(gen_config.pad_token_id)

    attn = prompt_mask.long()
    pos = position_ids_from(attn)
    cache = preallocated_cache(model, prompt_ids.shape[1] + R)
    # The last position's logits by index, not `logits_to_keep=1`: that slices the hidden states to a
    # non-contiguous (B, 1, d) view, and for a frozen bf16 LM head torch.matmul then runs a bmm over the weight
    # expanded B times. An index gathers a contiguous copy of the B rows and the head is one matrix product.
    last = torch.tensor([prompt_ids.shape[1] - 1], device=device)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=last)
    next_pos = pos[:, -1:] + 1
    ones = torch.ones(B, 1, dtype=attn.dtype, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logprobs, entropies, logits_steps = [], [], [], []
    step = Decoder.of(model, cache, linear)  # None: the steps go through the stock forward
    last_logits = out.logits[:, -1, :]
    with weight_first_linears(model):
        for t in range(R):
            logits = limit_vocab(last_logits, vocab_size)
            if keep_logits:
                logits_steps.append(logits)
            raw = logits.float()
            z = raw if score_temperature == 1.0 else raw / score_temperature
            logp = torch.log_softmax(z, dim=-1)
            p = torch.softmax(z, dim=-1)  # not logp.exp(): see core.logprobs_and_entropy
            entropies.append(-(p * logp).nansum(-1))
            masked = suppress if suppress is not None and t < min_new else None
            nxt = _choose(raw, p, masked, shared, sample, temperature, warpers)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens.append(nxt)
            logprobs.append(logp.gather(-1, nxt[:, None]).squeeze(-1))
            if stop is not None:
                done = done | torch.isin(nxt, stop)
                if bool(done.all()):
                    break
            if t == R - 1:
                break
            attn = torch.cat([attn, ones], 1)
            if step is not None:
                last_logits = step(nxt, attn, next_pos)
            else:
                last_logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos, cache=cache,
                                    use_cache=True).logits[:, -1, :]
            next_pos = next_pos + 1
    result = {"response": torch.stack(tokens, 1), "logprobs": torch.stack(logprobs, 1),
              "entropy": torch.stack(entropies, 1)}
    if keep_logits:
        result["logits"] = torch.stack(logits_steps, 1)
    return result


def effective_generation_config(model, gen_config):
    """`gen_config` with the model's own generation defaults filling what it leaves unset, as generate() does."""
    eff = copy.deepcopy(gen_config)
    own = getattr(model, "generation_config", None)
    if own is not None:
        eff.update(**own.to_dict(), defaults_only=True)
    return eff


def sample(policy, prompt_ids, prompt_mask, gen_config, stop_ids, temperature: float,
           vocab_size: int | None) -> dict | None:
    """The engine's entry (`rlhf_cli.ppo.sampling`): {"response", "logprobs", "entropy"} for one chunk, or None
    where the loop does not implement `gen_config` (the caller then runs generate())."""
    eff = effective_generation_config(policy, gen_config)
    if not supported(eff):
        return None
    with lora_merged(policy):
        return sample_loop(policy, prompt_ids, prompt_mask, eff, stop_ids, score_temperature=temperature,
                           vocab_size=vocab_size)
