"""The forwards that score a batch: the policy's logits at the response positions and per-token values or scores
of a sequence-classification model, plus the padding arithmetic of the sequence layout (`rlhf_cli.ppo.experience`).

Where `rlhf_cli.accel` has taught a model's last decoder layer to run on a span of positions (`accel.tail`), these
forwards ask for the read positions only; the outputs are the same either way.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf_cli.accel import tail
from rlhf_cli.ppo.core import limit_vocab


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
        return limit_vocab(out.logits, vocab_size)
    # exactly the R positions P-1 … P+R-2: a contiguous (B, R, d) input to the head, no slice of its output
    keep = torch.arange(start, L - 1, device=input_ids.device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=keep, use_cache=False)
    return limit_vocab(out.logits, vocab_size)


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
