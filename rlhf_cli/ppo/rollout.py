"""Sampling primitives: the KV-cache sampling loop (LoRA merged while it runs), stop-token truncation, the
logits of the response positions, per-token values from a sequence-classification model. The batch built from
them is `rlhf_cli.ppo.experience.Experience`."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from torch import nn

from rlhf_cli.ppo import core, cpu_linear, tail
from rlhf_cli.ppo.config import CPU_MERGE_MAX_BYTES
from rlhf_cli.ppo.decode import Decoder


class TokenValueModel(nn.Module):
    """Per-token outputs of a sequence-classification model: its backbone's hidden states through its score
    head, (B, L). As a module of its own it can be wrapped by DDP like any model."""

    def __init__(self, seq_cls_model: nn.Module) -> None:
        super().__init__()
        self.model = seq_cls_model

    def _parts(self):
        m = self.model
        if hasattr(m, "peft_config"):  # PeftModel: LoRA layers live inside the wrapped model
            m = m.base_model.model
        return getattr(m, m.base_model_prefix), m.score

    @property
    def head(self) -> nn.Module:
        """The score head (a Linear to one output)."""
        return self._parts()[1]

    def forward(self, input_ids, attention_mask, position_ids,
                response_length: int | None = None) -> torch.Tensor:
        """Values (B, L), or with `response_length` R those of the states that emit the response (B, R), the
        last layer run on those positions only where it can be (`rlhf_cli.ppo.tail`)."""
        backbone, head = self._parts()
        L = input_ids.shape[1]
        if response_length is None:
            return head(self._hidden(backbone, input_ids, attention_mask, position_ids)).squeeze(-1).float()
        start = L - response_length - 1
        h = self._hidden(backbone, input_ids, attention_mask, position_ids, (start, L - 1))
        return head(h if h.shape[1] == response_length else h[:, start: L - 1]).squeeze(-1).float()

    def score_at(self, input_ids, attention_mask, position_ids, index: torch.Tensor) -> torch.Tensor:
        """Score (B,) read at one position per row (the last valid response token)."""
        backbone, head = self._parts()
        lo, hi = (int(x) for x in torch.stack([index.min(), index.max()]).tolist()) \
            if tail.layer_of(self) is not None else (0, input_ids.shape[1] - 1)
        h = self._hidden(backbone, input_ids, attention_mask, position_ids, (lo, hi + 1))
        picked = h[torch.arange(h.shape[0], device=h.device), index - lo]
        return head(picked).squeeze(-1).float()

    def _hidden(self, backbone, input_ids, attention_mask, position_ids, span: tuple[int, int] | None = None):
        """The backbone's last hidden states: over positions [span) where the last layer can run on a span
        (`rlhf_cli.ppo.tail`), else over every position."""
        if span is None or tail.layer_of(self) is None:
            return backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        with tail.span(*span):
            return backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def truncate_at_stop(response: torch.Tensor, stop_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row after its first stop token: (tokens with pad after the stop, float mask incl. the stop)."""
    if not stop_ids:
        return response, torch.ones_like(response, dtype=torch.float32)
    is_stop = torch.isin(response, torch.tensor(stop_ids, device=response.device))
    # a position is valid while no stop token occurred strictly before it
    stops_before = torch.cumsum(is_stop.int(), dim=-1) - is_stop.int()
    mask = (stops_before == 0).float()
    return torch.where(mask.bool(), response, torch.full_like(response, pad_id)), mask


def policy_logits(model, input_ids, attention_mask, position_ids, response_length: int,
                  vocab_size: int | None = None) -> torch.Tensor:
    """Logits (B, R, V) predicting the R response tokens; the LM head runs on those positions only. With
    `vocab_size` smaller than the model's rows (real Qwen3: 151,669 tokens, 151,936 rows) the rows past the
    tokenizer are cut off, so they are never sampled and never enter a softmax."""
    L = input_ids.shape[1]
    start = L - response_length - 1
    if tail.layer_of(model) is not None:  # the last layer runs on those positions only: the head's input
        with tail.span(start, L - 1):
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        logits_to_keep=0, use_cache=False)
        if out.logits.shape[1] != response_length:
            raise RuntimeError(f"the last layer ran on {out.logits.shape[1]} positions, not the "
                               f"{response_length} response positions")
        return _vocab(out.logits, vocab_size)
    # exactly the R positions P-1 … P+R-2: a contiguous (B, R, d) input to the head, no slice of its output
    keep = torch.arange(start, L - 1, device=input_ids.device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=keep, use_cache=False)
    return _vocab(out.logits, vocab_size)


def _vocab(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    return logits if vocab_size is None or vocab_size >= logits.shape[-1] else logits[..., :vocab_size]


def padding_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's number of leading padding columns (left-padded prompts)."""
    return (attention_mask.cumsum(-1) == 0).sum(-1)


def leading_padding(attention_mask: torch.Tensor, group: int) -> list[int]:
    """For each run of `group` consecutive rows: the number of leading columns that are padding in every row of
    the run (left-padded prompts of a micro-batch are often all shorter than the longest of the batch). Dropping
    them changes no output at a valid position: they are masked keys, and positions come from position_ids."""
    B, L = attention_mask.shape
    valid = attention_mask.bool().view(B // group, group, L).any(1)
    return valid.int().argmax(-1).tolist()


def response_slice(x: torch.Tensor, response_length: int) -> torch.Tensor:
    """Per-position outputs over the full sequence (B, P+R) -> the states that emit the response (B, R)."""
    return x[:, -response_length - 1: -1]


# Generation settings the sampling loop below implements; anything else goes through `generate()`.
_LOOP_KEYS = {"max_new_tokens", "min_new_tokens", "do_sample", "use_cache", "temperature", "top_k", "top_p",
              "output_logits", "output_scores", "return_dict_in_generate", "pad_token_id", "eos_token_id",
              "bos_token_id", "transformers_version", "_from_model_config"}


def _effective_generation_config(model, gen_config):
    """`gen_config` with the model's own generation defaults filling what it leaves unset, as generate() does."""
    import copy

    eff = copy.deepcopy(gen_config)
    own = getattr(model, "generation_config", None)
    if own is not None:
        eff.update(**own.to_dict(), defaults_only=True)
    return eff


# Settings that change nothing at these values (generate() would also ignore them).
_NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "typical_p": 1.0,
            "length_penalty": 1.0, "low_memory": None}


def _loop_supported(gen_config) -> bool:
    if not gen_config.use_cache or gen_config.max_new_tokens is None:
        return False
    return all(k in _LOOP_KEYS or v in (None, False) or (k in _NEUTRAL and v == _NEUTRAL[k])
               for k, v in gen_config.to_diff_dict().items())


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row from categorical `probs` (B, V) by inverting the CDF: the first index whose cumulative
    probability exceeds u·total, u ~ U[0, 1). Same distribution as torch.multinomial(probs, 1), whose CPU kernel
    draws B·V exponential variates (~1 ms for 32 × 1500, 25× this); a token with probability 0 is never drawn."""
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


def cpu_flag(name: str) -> bool | None:
    """One of torch.cpu's feature probes (`_is_amx_tile_supported`, `_is_avx512_bf16_supported`, ...); None
    where this torch has no such probe or it cannot answer."""
    probe = getattr(torch.cpu, name, None)
    if not callable(probe):
        return None
    try:
        return bool(probe())
    except RuntimeError:
        return None


@functools.cache
def weight_first_cpu() -> str | None:
    """The kind of CPU `weight_first`'s rules were measured on that this one is: "amx" (an Intel Xeon with AMX
    tiles), "zen2" (AMD family 23: Zen / Zen 2, AVX2), or None (any other: every layer keeps F.linear)."""
    if cpu_flag("_is_amx_tile_supported"):
        return "amx"
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    pairs = (ln.split(":", 1) for ln in info.splitlines()[:40] if ":" in ln)  # the first processor's fields
    fields = {k.strip(): v.strip() for k, v in pairs}
    if fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "23":
        return "zen2"
    return None


def weight_first(rows: int, weight: torch.Tensor) -> bool:
    """Whether a CPU linear layer over `rows` input rows runs faster as W·xᵀ than as x·Wᵀ (what F.linear
    asks BLAS for), by rules measured per CPU kind with bench/linear_probe.py (1 thread) for the sampling
    steps' few rows. Intel Xeon with AMX: fp32, 8-48 rows, W·xᵀ 1.1-1.8x faster (Qwen3-0.6B's shapes:
    1.4-1.8x at 8 rows), except weights under 1 M values at 8 rows (0.5-0.8x) and 2 rows (0.5x); bf16,
    2-48 rows, 1.1-2.2x; from 64 rows the two are even or F.linear wins (sampling Qwen3-0.6B's shape,
    bench/sampling_probe.py: fp32 1.26x, bf16 1.09x). AMD EPYC Zen 2 (AVX2), fp32: Qwen3-0.6B's layers of
    2 M values and more 1.1-1.2x at 8 rows, 1.3-1.8x at 16, 1.6-2.4x at 4, its 151,936 x 1,024 LM head 2.0x
    at 8 rows; 1024 x 1024 even at 8 rows; every bench mid / small shape (under 1 M values) 0.6-0.75x at
    8 rows, even from 16; 2 rows 0.6-0.8x. An AMD EPYC Zen 4 found W·xᵀ slower at most of these sizes: CPUs
    of other kinds keep F.linear for every layer."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    kind = weight_first_cpu()
    if kind == "amx":
        if weight.dtype == torch.bfloat16:
            return 2 <= rows <= 48
        if weight.dtype == torch.float32:
            return 16 <= rows <= 48 or (8 <= rows <= 48 and weight.numel() >= 2**20)
    if kind == "zen2" and weight.dtype == torch.float32:
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
    onto the cache, copying all of it every step (bench/sampling_probe.py: 8% of the mid workload's sampling
    time on a CPU, 2% of Qwen3-0.6B's in fp32); the attention reads the same numbers either way. Other layer kinds (sliding windows, ...) are kept as they are."""
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


def sample_loop(model, prompt_ids, prompt_mask, gen_config, stop_ids, score_temperature: float = 1.0,
                keep_logits: bool = False, vocab_size: int | None = None) -> dict:
    """Token-by-token sampling with a KV cache: {"response" (B, R), "logprobs" (B, R), "entropy" (B, R)} and,
    with keep_logits, the raw "logits" (B, R, V).

    The distribution is generate()'s for these settings: EOS masked for the first `min_new_tokens` tokens,
    logits / temperature, top-k, top-p, then one draw per row (or argmax without sampling). A row that has
    produced a stop token gets pad tokens afterwards, and the loop ends as soon as every row has stopped.
    Log-probs and entropies are those of the raw logits / score_temperature (EOS not masked: the policy's own
    distribution, as the PPO update recomputes it), taken step by step while each (B, V) row block is small.
    Without generate()'s per-step machinery, a step costs little more than the model forward itself."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    B = prompt_ids.shape[0]
    device = prompt_ids.device
    R = int(gen_config.max_new_tokens)
    min_new = int(gen_config.min_new_tokens or 0)
    eos = gen_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(i) for i in eos])
    stop = torch.tensor(stop_ids, device=device) if stop_ids else None
    suppress = torch.tensor(eos, device=device) if eos and min_new > 0 else None
    sample = bool(gen_config.do_sample)
    temperature = float(gen_config.temperature if gen_config.temperature is not None else 1.0)
    score_temperature = float(score_temperature)
    warpers = []
    if sample and gen_config.top_k:
        warpers.append(TopKLogitsWarper(int(gen_config.top_k)))
    if sample and gen_config.top_p is not None and float(gen_config.top_p) < 1.0:
        warpers.append(TopPLogitsWarper(float(gen_config.top_p)))
    # sampling at the scoring temperature without warpers: draw from the scoring distribution itself
    shared = sample and not warpers and temperature == score_temperature
    pad = int(gen_config.pad_token_id)

    attn = prompt_mask.long()
    pos = position_ids_from(attn)
    cache = preallocated_cache(model, prompt_ids.shape[1] + R)
    # The last position's logits by index, not `logits_to_keep=1`: that slices the hidden states to a
    # non-contiguous (B, 1, d) view, and for a frozen bf16 LM head torch.matmul then runs a bmm over the weight
    # expanded B times (8 x 151,936 x 1,024 bf16 values copied: seconds per prefill on a CPU). An index gathers a
    # contiguous copy of the B rows and the head is one matrix product.
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
            logits = _vocab(last_logits, vocab_size)
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


@torch.no_grad()
def generate_chunk(policy, tokenizer, prompt_ids, prompt_mask, gen_config, stop_ids, temperature,
                   fixed_length: int | None, vocab_size: int | None = None) -> dict:
    """Sample responses for one chunk; old log-probs come from the sampling logits (no second forward)."""
    eff = _effective_generation_config(policy, gen_config)
    if _loop_supported(eff):
        with lora_merged(policy):
            g = sample_loop(policy, prompt_ids, prompt_mask, eff, stop_ids, score_temperature=temperature,
                            vocab_size=vocab_size)
        response, logprobs, entropy = g["response"], g["logprobs"], g["entropy"]
    else:
        from transformers import LogitsProcessorList

        procs = LogitsProcessorList([_VocabLimit(vocab_size)] if vocab_size is not None else [])
        out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config,
                              logits_processor=procs)
        response = out.sequences[:, prompt_ids.shape[1]:]
        logits = _vocab(torch.stack(out.logits, dim=1), vocab_size)  # (B, R, V) raw logits, before temperature
        logprobs, entropy = core.logprobs_and_entropy(logits, response, temperature)
    if fixed_length is not None and response.shape[1] < fixed_length:
        raise RuntimeError("generation stopped early although no stop token is configured")
    # tokens after a stop are pad (the loop and generate() both emit pad there); their log-probs are masked
    response, mask = truncate_at_stop(response, stop_ids, tokenizer.pad_token_id)
    return {"response": response, "mask": mask, "logprobs": logprobs, "entropy": entropy}


class _VocabLimit:
    """generate() logits processor: ids past the tokenizer get -inf (never sampled)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)

    def __call__(self, input_ids, scores):
        if scores.shape[-1] > self.vocab_size:
            scores[:, self.vocab_size:] = float("-inf")
        return scores
