"""The one sample-and-score path: prompts -> responses -> old / reference log-probs, values, reward-model scores,
as a typed `Experience` batch. PPO's rollout and `rlhf eval` both go through `make_experience`, so what eval
measures is what PPO trained on (same stop tokens, temperature, vocabulary limit and forward).

Sequence layout, shared by every forward pass of an update:

    input_ids  = [ pad … pad  prompt | response tokens … EOS  pad … pad ]
                 └──── P (left-padded) ──┘└────────── R (right-padded) ─────────┘

The logits at position P-1+t predict response token t, so per-token quantities over the response are read
from positions P-1 … P+R-2, and the reward model's score from the last valid response token (EOS included).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields, replace

import torch

from rlhf_cli import devices
from rlhf_cli.ppo import core
from rlhf_cli.ppo.forward import padding_counts, policy_logits
from rlhf_cli.ppo.reward_model import TextRewardModel
from rlhf_cli.ppo.sampling import generate_chunk


@dataclass(frozen=True)
class Sampling:
    """How responses are drawn and scored; one definition for PPO and eval."""

    max_new_tokens: int
    temperature: float                 # sampling temperature, and the scoring one (log-probs of π at τ)
    pad_id: int
    eos_id: int
    stop_ids: tuple[int, ...] = ()     # tokens that end a response; empty: fixed length (EOS masked while sampling)
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False               # argmax instead of sampling (eval); log-probs then at τ = 1
    forward_batch_size: int = 32       # prompts generated and scored together
    vocab_size: int | None = None      # logits past the tokenizer's last id are never sampled nor scored
    recompute_logprobs: bool = False   # old log-probs from the training forward instead of the sampling pass
    score_batch_size: int | None = None  # rows per scoring forward, grouped by prompt length (None: the chunk)
    engine: str = "generate"           # the sampling engine (rlhf_cli.ppo.sampling): generate | loop | registered

    @property
    def score_temperature(self) -> float:
        return 1.0 if self.greedy else float(self.temperature)

    def generation_config(self):
        from transformers import GenerationConfig

        stop = list(self.stop_ids)
        return GenerationConfig(
            max_new_tokens=int(self.max_new_tokens), do_sample=not self.greedy, temperature=float(self.temperature),
            top_k=int(self.top_k), top_p=float(self.top_p), pad_token_id=int(self.pad_id),
            eos_token_id=stop or int(self.eos_id), use_cache=True, return_dict_in_generate=True,
            output_logits=True,
            # no stop token: EOS is masked while sampling so every response has exactly max_new_tokens tokens
            min_new_tokens=0 if stop else int(self.max_new_tokens))


@dataclass
class Experience:
    """One batch of episodes. Per-token fields are over the R response positions."""

    input_ids: torch.Tensor       # (B, P+R) left-padded prompt ++ right-padded response
    attention_mask: torch.Tensor  # (B, P+R) 1 on real prompt and valid response tokens
    position_ids: torch.Tensor    # (B, P+R) cumsum(attention_mask) - 1: positions as generation saw them
    response_ids: torch.Tensor    # (B, R) sampled tokens, cut after the first stop token, pad after it
    response_mask: torch.Tensor   # (B, R) float, 1 on valid response tokens (EOS included), 0 on padding
    logprobs: torch.Tensor        # (B, R) log π_old(a_t|s_t) at the sampling temperature
    ref_logprobs: torch.Tensor    # (B, R) log π_ref(a_t|s_t), same temperature
    entropy: torch.Tensor         # (B, R) entropy of π_old(·|s_t) at the sampling temperature
    has_stop: torch.Tensor        # (B,) bool, a stop token was generated
    empty: torch.Tensor           # (B,) bool, nothing but the stop token (or whitespace) was generated
    texts: list[str]              # B decoded responses (special tokens skipped)
    prompts: list[str] | None = None       # B rendered prompts (a prompt sampled n times appears n times in a row)
    rows: list[dict] | None = None         # B dicts: the extra fields of each prompt's data row (reward functions)
    values: torch.Tensor | None = None     # (B, R) V_old(s_t); None without a value model (critic-free)
    rm_scores: torch.Tensor | None = None  # (B,) raw reward-model score at the last valid response token; None
                                           # without a reward model
    source_scores: dict | None = None      # reward source name -> (B,) its score before weighting (the model's
                                           # normalised, a function's as returned)
    scores: torch.Tensor | None = None     # (B,) the score optimised: Σ weight·source score, EOS / empty penalties
    rewards: torch.Tensor | None = None    # (B, R) per-token rewards: -β·KL, + score on the last token (gae,
                                           # reinforce_pp); (B,) score - β·ΣKL (rloo); None (grpo: KL in the loss)
    kl: torch.Tensor | None = None         # (B, R) per-token KL estimate, 0 on padding
    advantages: torch.Tensor | None = None  # (B, R) advantages of the estimator (ppo.advantage)
    returns: torch.Tensor | None = None     # (B, R) value targets: GAE advantages (before whitening) + values
    extras: dict = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return self.input_ids.shape[1] - self.response_ids.shape[1]

    @property
    def response_length(self) -> int:
        return self.response_ids.shape[1]

    def with_(self, **kw) -> Experience:
        return replace(self, **kw)

    @staticmethod
    def cat(parts: list[Experience]) -> Experience:
        """Concatenate chunks; responses are right-padded (and sequences extended) to the longest chunk."""
        r_max = max(p.response_ids.shape[1] for p in parts)
        out = {}
        for f in fields(Experience):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "extras":
                out[f.name] = {}
            elif isinstance(vals[0], dict):
                out[f.name] = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif vals[0] is None:
                out[f.name] = None
            else:
                out[f.name] = torch.cat([
                    torch.nn.functional.pad(t, (0, r_max - p.response_ids.shape[1]), value=0)
                    if t.dim() == 2 and r_max > p.response_ids.shape[1] else t
                    for t, p in zip(vals, parts)])
        return Experience(**out)

    def trim(self) -> Experience:
        """Drop response columns that are padding in every row (responses that stopped early cost nothing)."""
        keep = int(self.response_mask.sum(-1).max().item()) if self.response_mask.numel() else 0
        cut = self.response_ids.shape[1] - max(keep, 1)
        if cut <= 0:
            return self
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                t = t[:, : t.shape[1] - cut]
            out[f.name] = t
        return Experience(**out)


def _now(device) -> float:
    """The clock once `device` has done its queued work (a GPU runs ahead of the host)."""
    devices.synchronize(device)
    return time.perf_counter()


def score_groups(attention_mask: torch.Tensor, group: int | None) -> tuple[list[tuple], torch.Tensor | None]:
    """The row groups of the scoring forwards: `group` rows at a time (all rows if None), ordered by their
    prompt's leading padding so that rows of similar length go together, each with the number of leading columns
    that are padding in all its rows (its forward skips them: masked keys, and positions come from position_ids).
    Returns [(rows, start)] and the permutation that puts the groups' concatenated outputs back in row order
    (None when the rows keep their order)."""
    B = attention_mask.shape[0]
    lead = padding_counts(attention_mask)
    if not group or group >= B:
        return [(slice(None), int(lead.min()))], None
    order = torch.sort(lead, stable=True).indices
    starts = lead[order].tolist()  # ascending: a group's first row has its shared padding
    groups = [(order[i: i + group], starts[i]) for i in range(0, B, group)]
    return groups, torch.argsort(order)


def _in_row_order(outs: list, inverse: torch.Tensor | None):
    """Per-group outputs (tensors, or tuples of them) concatenated and put back in row order."""
    if isinstance(outs[0], tuple):
        return tuple(_in_row_order([o[k] for o in outs], inverse) for k in range(len(outs[0])))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if inverse is None else out[inverse]


def reference_logits(policy, ref_model, input_ids, attention_mask, position_ids, response_length: int,
                     vocab_size: int | None = None) -> torch.Tensor:
    """The reference's logits (B, R, V): an explicit frozen model, or the policy with its adapter disabled (a
    policy without an adapter is its own reference)."""
    adapter = ref_model is None and hasattr(policy, "disable_adapter")
    ctx = policy.disable_adapter() if adapter else contextlib.nullcontext()
    with ctx:
        return policy_logits(ref_model if ref_model is not None else policy, input_ids, attention_mask,
                             position_ids, response_length, vocab_size)


@torch.no_grad()
def make_experience(prompts: list[str], tok, policy, s: Sampling, *, ref_model=None, value_model=None,
                    reward_model=None, device="cpu", phase=None) -> Experience:
    """Sample a response per prompt and score it, `s.forward_batch_size` prompts at a time.

    policy: the model that samples (a PEFT model: its adapter-disabled self is the reference unless `ref_model`
    is given). value_model / reward_model: `TokenValueModel`s, optional (eval and critic-free PPO have no value
    model; a run rewarded by functions alone has no reward model; a `TextRewardModel` scores the decoded texts
    with its own tokenizer). The
    log-probs come from the sampling pass, or with `s.recompute_logprobs` from a full forward like the
    update's (the two disagree in low precision). The scoring forwards run `s.score_batch_size` rows at a time,
    rows of similar prompt length together (`score_groups`): a smaller peak and less padding than the chunk's.
    phase: name -> a context manager around each chunk's generation and scoring (`PhasePeaks.phase`)."""
    phase = phase or (lambda name: contextlib.nullcontext())
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen_config = s.generation_config()
    stop_ids = list(s.stop_ids)
    temp = s.score_temperature
    fixed = None if stop_ids or s.greedy else int(s.max_new_tokens)
    stop_t = torch.tensor(stop_ids, device=device) if stop_ids else None
    chunks, t_gen, t_score = [], 0.0, 0.0
    for i in range(0, len(prompts), max(int(s.forward_batch_size), 1)):
        t0 = _now(device)
        q_ids = enc["input_ids"][i: i + s.forward_batch_size].to(device)
        q_mask = enc["attention_mask"][i: i + s.forward_batch_size].to(device)
        with phase("generate"):
            g = generate_chunk(policy, tok, q_ids, q_mask, gen_config, stop_ids, temp, fixed, s.vocab_size,
                               s.engine)
            resp, rmask = g["response"], g["mask"]
            R = resp.shape[1]
        t1 = _now(device)
        with phase("score"):
            input_ids = torch.cat([q_ids, resp], 1)
            attn = torch.cat([q_mask, rmask.long()], 1)
            pos = core.position_ids_from(attn)
            logprobs, entropy = g["logprobs"], g["entropy"]
            groups, inverse = score_groups(attn, s.score_batch_size)

            def each(fn):
                """fn(ids, mask, positions, rows, start) over the row groups, the outputs in row order."""
                return _in_row_order([fn(input_ids[rows, st:], attn[rows, st:], pos[rows, st:], rows, st)
                                      for rows, st in groups], inverse)

            if s.recompute_logprobs:
                logprobs, entropy = each(lambda ids, am, ps, rows, st: core.logprobs_and_entropy(
                    policy_logits(policy, ids, am, ps, R, s.vocab_size), resp[rows], temp))

            def ref_logprobs_of(ids, am, ps, rows, st):
                logits = reference_logits(policy, ref_model, ids, am, ps, R, s.vocab_size)
                # divided in place (the same numbers as passing the temperature): one (b, R, V) buffer less at
                # the peak
                scaled = logits.div_(temp) if temp != 1.0 else logits
                return core.logprobs_from_logits(scaled, resp[rows], 1.0)

            ref_logprobs = each(ref_logprobs_of)
            values = None
            if value_model is not None:
                values = each(lambda ids, am, ps, rows, st: value_model(ids, am, ps, response_length=R))
            has_stop = torch.isin(resp, stop_t).any(-1) if stop_t is not None \
                else torch.zeros(resp.shape[0], dtype=torch.bool, device=device)
            texts = tok.batch_decode(resp, skip_special_tokens=True)
            rm_scores = None
            chunk_prompts = prompts[i: i + s.forward_batch_size]
            if isinstance(reward_model, TextRewardModel):  # its own tokenizer: the texts re-tokenized
                rm_scores = reward_model(chunk_prompts, texts, has_stop.tolist()).to(device)
            elif reward_model is not None:
                last = q_ids.shape[1] + core.last_token_index(rmask)
                rm_scores = each(lambda ids, am, ps, rows, st:
                                 reward_model.score_at(ids, am, ps, last[rows] - st))
            empty = torch.tensor([not t.strip() for t in texts], device=device)
        t_gen, t_score = t_gen + (t1 - t0), t_score + (_now(device) - t1)
        chunks.append(Experience(input_ids=input_ids, attention_mask=attn, position_ids=pos, response_ids=resp,
                                 response_mask=rmask, logprobs=logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
                                 has_stop=has_stop, empty=empty, texts=texts, values=values, rm_scores=rm_scores,
                                 prompts=list(prompts[i: i + s.forward_batch_size])))
    exp = Experience.cat(chunks).trim()
    exp.extras.update({"time/generate_s": t_gen, "time/score_s": t_score})
    return exp
