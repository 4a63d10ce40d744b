"""Generation and scoring of one PPO batch into a `Rollout` (no gradients, no parameter updates).

Sequence layout, shared by every forward pass of an update:

    input_ids  = [ pad … pad  prompt | response tokens … EOS  pad … pad ]
                 └──── P (left-padded) ──┘└────────── R (right-padded) ─────────┘

The logits at position P-1+t predict response token t, so per-token quantities over the response are read
from positions P-1 … P+R-2, and the reward model's score from the last valid response token (EOS included).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from rlhf_cli.ppo import core


@dataclass
class Rollout:
    input_ids: torch.Tensor       # (B, P+R) left-padded prompt ++ right-padded response
    attention_mask: torch.Tensor  # (B, P+R) 1 on real prompt and valid response tokens
    position_ids: torch.Tensor    # (B, P+R) cumsum(attention_mask) - 1: positions as generate() saw them
    response_ids: torch.Tensor    # (B, R) sampled tokens, cut after the first stop token, pad after it
    response_mask: torch.Tensor   # (B, R) float, 1 on valid response tokens (EOS included), 0 on padding
    logprobs: torch.Tensor        # (B, R) log π_old(a_t|s_t) at the sampling temperature
    ref_logprobs: torch.Tensor    # (B, R) log π_ref(a_t|s_t), adapter disabled, same temperature
    values: torch.Tensor          # (B, R) V_old(s_t)
    scores: torch.Tensor          # (B,) score used as reward: normalised RM score, penalties applied
    rm_scores: torch.Tensor       # (B,) raw reward-model score
    has_stop: torch.Tensor        # (B,) bool, a stop token was generated
    empty: torch.Tensor           # (B,) bool, nothing but the stop token (or whitespace) was generated
    entropy: torch.Tensor         # (B, R) entropy of π_old(·|s_t) at the sampling temperature

    @property
    def context_length(self) -> int:
        return self.input_ids.shape[1] - self.response_ids.shape[1]

    def select(self, idx: torch.Tensor) -> Rollout:
        return Rollout(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        """Concatenate chunks; responses are right-padded (and sequences extended) to the longest chunk."""
        r_max = max(p.response_ids.shape[1] for p in parts)
        out = {}
        for f in fields(Rollout):
            ts = []
            for p in parts:
                t = getattr(p, f.name)
                grow = r_max - p.response_ids.shape[1]
                if grow and t.dim() == 2:
                    t = torch.nn.functional.pad(t, (0, grow), value=0)
                ts.append(t)
            out[f.name] = torch.cat(ts)
        return Rollout(**out)

    def trim(self) -> Rollout:
        """Drop response columns that are padding in every row (responses that stopped early cost nothing)."""
        keep = int(self.response_mask.sum(-1).max().item()) if self.response_mask.numel() else 0
        cut = self.response_ids.shape[1] - max(keep, 1)
        if cut <= 0:
            return self
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask", "position_ids"):
                t = t[:, :-cut]
            elif t.dim() == 2:
                t = t[:, : t.shape[1] - cut]
            out[f.name] = t
        return Rollout(**out)


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

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        backbone, head = self._parts()
        h = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).last_hidden_state
        return head(h).squeeze(-1).float()

    def score_at(self, input_ids, attention_mask, position_ids, index: torch.Tensor) -> torch.Tensor:
        """Score (B,) read at one position per row (the last valid response token)."""
        backbone, head = self._parts()
        h = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).last_hidden_state
        picked = h[torch.arange(h.shape[0], device=h.device), index]
        return head(picked).squeeze(-1).float()


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


def policy_logits(model, input_ids, attention_mask, position_ids, response_length: int) -> torch.Tensor:
    """Logits (B, R, V) predicting the R response tokens; the LM head runs on those positions only."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=response_length + 1, use_cache=False)
    return out.logits[:, :-1]


def response_slice(x: torch.Tensor, response_length: int) -> torch.Tensor:
    """Per-position outputs over the full sequence (B, P+R) -> the states that emit the response (B, R)."""
    return x[:, -response_length - 1: -1]


@torch.no_grad()
def generate_chunk(policy, tokenizer, prompt_ids, prompt_mask, gen_config, stop_ids, temperature,
                   fixed_length: int | None) -> dict:
    """Sample responses for one chunk; old log-probs come from generate's own logits (no second forward)."""
    out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config)
    P = prompt_ids.shape[1]
    response = out.sequences[:, P:]
    logits = torch.stack(out.logits, dim=1)  # (B, R, V) raw logits, temperature not yet applied
    if fixed_length is not None and response.shape[1] < fixed_length:
        raise RuntimeError("generation stopped early although no stop token is configured")
    response, mask = truncate_at_stop(response, stop_ids, tokenizer.pad_token_id)
    logprobs = core.logprobs_from_logits(logits, response, temperature)
    entropy = core.entropy_from_logits(logits, temperature)
    return {"response": response, "mask": mask, "logprobs": logprobs, "entropy": entropy}
