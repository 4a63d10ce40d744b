"""The reward model PPO and `rlhf eval` score with, in one of two forms chosen by its tokenizer:

    same tokenizer as the policy (token ids, chat template and EOS alike): a `TokenValueModel` that reads the
        policy's own token ids; the score at the last valid response token. No re-tokenization: the fast path.
    a tokenizer of its own (a published reward model on another base, e.g. a Llama reward model for a Qwen
        policy): a `TextRewardModel`. Each prompt's chat messages and the decoded response are rendered with the
        reward model's chat template, tokenized with its tokenizer (batched, left-padded, cut from the left at its
        length limit) and scored at the last token, where its training read scores.

How the text is rendered follows how the model was trained: a reward model written by `rlhf reward` saw the
rendered prompt (chat template + assistant header) + answer + EOS (`rlhf_cli.stages.reward`); any other reward
model gets the whole conversation through its chat template (prompt messages + an assistant turn), the usage
published reward models document. A response cut at ppo.response_length gets no EOS in the first form.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from rlhf_cli.data import prompt_text
from rlhf_cli.errors import RlhfError
from rlhf_cli.io import output_kind, read_json
from rlhf_cli.models import check_finite, load_seq_cls, load_tokenizer, same_tokenizer
from rlhf_cli.ppo.forward import TokenValueModel

log = logging.getLogger("rlhf")


class TextRewardModel(nn.Module):
    """A reward model with its own tokenizer, called with the policy's rendered prompts and decoded responses.

    It knows each rendered prompt's chat messages (`know`), so that the sampling path passes only what it already
    has (prompt strings, response texts, whether each response ended with a stop token)."""

    def __init__(self, scorer: TokenValueModel, tok, *, rlhf_format: bool, thinking: bool = False,
                 chat_template: bool = True, max_length: int | None = None) -> None:
        super().__init__()
        self.scorer = scorer
        self.tok, self.rlhf_format, self.thinking, self.chat_template = tok, rlhf_format, thinking, chat_template
        self.max_length = max_length
        self.conversations: dict[str, list[dict]] = {}

    def know(self, prompts: list[str], examples) -> None:
        """Record the chat messages behind each rendered prompt (`examples`: the `data.Example`s they came from)."""
        self.conversations.update({p: ex.prompt for p, ex in zip(prompts, examples)})

    def text(self, messages: list[dict], response: str, ended: bool) -> str:
        """One scored text, rendered as this reward model was trained to read it (see the module's docstring)."""
        if self.rlhf_format or not self.chat_template:
            prompt = prompt_text(self.tok, messages, self.thinking, self.chat_template)
            return prompt + response + (self.tok.eos_token if ended else "")
        turns = [*messages, {"role": "assistant", "content": response}]
        return self.tok.apply_chat_template(turns, tokenize=False, enable_thinking=self.thinking)

    def texts(self, prompts: list[str], responses: list[str], ended: list[bool]) -> list[str]:
        missing = [p for p in prompts if p not in self.conversations]
        if missing:  # a caller's mistake, not a user's: every prompt source calls `know` first
            raise RuntimeError(f"TextRewardModel: no chat messages recorded for prompt {missing[0][:60]!r}")
        return [self.text(self.conversations[p], r, e) for p, r, e in zip(prompts, responses, ended)]

    @torch.no_grad()
    def forward(self, prompts: list[str], responses: list[str], ended) -> torch.Tensor:
        """Scores (B,) in float32 on the model's device."""
        device = next(self.scorer.parameters()).device
        enc = self.tok(self.texts(prompts, responses, [bool(e) for e in ended]), return_tensors="pt",
                       padding=True, truncation=self.max_length is not None, max_length=self.max_length,
                       add_special_tokens=False).to(device)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        last = torch.full((ids.shape[0],), ids.shape[1] - 1, device=device)  # left-padded: the end of each row
        return self.scorer.score_at(ids, mask, pos, last)


def know_prompts(reward, *sources) -> None:
    """Tell a `TextRewardModel` the chat messages behind the rendered prompts of each (prompts, examples) source
    (None: skipped); nothing to do for the same-tokenizer form."""
    if isinstance(reward, TextRewardModel):
        for prompts, examples in (src for src in sources if src is not None):
            reward.know(prompts, examples)


def own_tokenizer(reward_dir: Path, tok, run):
    """The reward model's tokenizer when it differs from the policy's `tok`; None when they are the same (the
    reward model can read the policy's token ids). `run`: the run's settings (rlhf_cli.settings.of, or the
    composed config)."""
    rm_tok = load_tokenizer(reward_dir, run.model, scoring=True)
    if same_tokenizer(tok, rm_tok):
        return None
    return rm_tok


def load_reward_model(reward_dir: Path, tok, storage: torch.dtype, run, device, rm_tok=None, quant=None):
    """The frozen reward model at `reward_dir`, ready to score: a `TokenValueModel` when it shares the policy's
    tokenizer `tok`, else a `TextRewardModel` (`rm_tok`: its tokenizer, from `own_tokenizer`). `quant`: its
    decoder quantized (`rlhf_cli.models.quantization_config`); `run`: the run's settings (rlhf_cli.settings.of, or
    the composed config)."""
    model = load_seq_cls(reward_dir, rm_tok or tok, storage, run.model, trained_head=True, quant=quant)
    model = model.eval().requires_grad_(False)
    check_finite(model, "the reward model", reward_dir)
    scorer = TokenValueModel(model).to(device).eval()
    if rm_tok is None:
        return scorer
    config = read_json(Path(reward_dir) / "config.json")
    limits = [n for n in (config.get("max_position_embeddings"), rm_tok.model_max_length) if n and n < 10**7]
    rlhf_format = output_kind(reward_dir) == "reward"
    log.info("reward model %s has its own tokenizer (%d tokens): responses are re-rendered with its chat template "
             "(%s) and re-tokenized to score", reward_dir, len(rm_tok),
             "as rlhf reward trained it" if rlhf_format else "the whole conversation")
    return TextRewardModel(scorer, rm_tok, rlhf_format=rlhf_format, thinking=bool(run.model.enable_thinking),
                           chat_template=bool(run.data.chat_template),
                           max_length=int(min(limits)) if limits else None).eval()


def refuse_value_from(reward_dir: Path) -> RlhfError:
    return RlhfError(f"ppo.value_init=reward: the reward model at {reward_dir} has a tokenizer of its own, so a value "
                     "model started from it could not read the policy's tokens; set ppo.value_init=sft (or base)")
