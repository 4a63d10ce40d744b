"""The shipped demo task: answer everyday questions politely (English and Chinese).

The data files hold preference pairs in the seed format, one JSON object per line::

    {"question": "...", "chosen": "<polite answer>", "rejected": "<rude answer>"}

:func:`is_polite` is the rule-based ground truth used to judge the demo. It looks only for fixed
marker phrases, so it cannot be fooled the way a learned reward model can: a reply counts as polite
only if it contains at least one polite marker and no rude marker anywhere.

Two example reward functions for `ppo.reward` (see rlhf_cli/ppo/rewards.py for the calling convention):
:func:`polite_reward` turns that checker into a reward (`ppo.reward=[rlhf_cli.demo:polite_reward]` trains
without a reward model), and :func:`length_format_reward` scores the shape of an answer from its tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "DATA_DIR",
    "TRAIN_FILE",
    "TEST_FILE",
    "SYSTEM_PROMPT",
    "EN_POLITE_MARKERS",
    "EN_RUDE_MARKERS",
    "ZH_POLITE_MARKERS",
    "ZH_RUDE_MARKERS",
    "is_polite",
    "has_polite_marker",
    "has_rude_marker",
    "polite_reward",
    "length_format_reward",
]

DATA_DIR: Path = Path(__file__).resolve().parent / "data"
TRAIN_FILE: Path = DATA_DIR / "polite_train.jsonl"
TEST_FILE: Path = DATA_DIR / "polite_test.jsonl"

# The demo prompts are plain user turns; no system message is used.
SYSTEM_PROMPT: str | None = None

# English markers are matched case-insensitively on word boundaries ("ugh" must not match "enough").
EN_POLITE_MARKERS: tuple[str, ...] = (
    "thank you",
    "thanks",
    "happy to help",
    "glad you asked",
    "great question",
    "hope this helps",
    "good luck",
    "feel free",
    "best wishes",
    "my pleasure",
)
EN_RUDE_MARKERS: tuple[str, ...] = (
    "ugh",
    "figure it out yourself",
    "dumb",
    "stupid",
    "whatever",
    "obviously",
    "bothering me",
    "waste my time",
    "leave me alone",
    "go away",
    "not my problem",
)
# Chinese markers are matched as plain substrings.
ZH_POLITE_MARKERS: tuple[str, ...] = (
    "感谢",
    "谢谢",
    "很高兴",
    "好问题",
    "乐意",
    "希望对你有帮助",
    "祝你",
    "欢迎随时",
)
ZH_RUDE_MARKERS: tuple[str, ...] = (
    "这都不会",
    "自己想",
    "烦死了",
    "真笨",
    "烦人",
    "懒得",
    "别再烦我",
    "少来问我",
    "浪费我时间",
    "自己看着办",
    "别问了",
)


def _en_pattern(markers: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True))
    return re.compile(rf"(?<![a-z])(?:{alternatives})(?![a-z])", re.IGNORECASE)


_EN_POLITE_RE = _en_pattern(EN_POLITE_MARKERS)
_EN_RUDE_RE = _en_pattern(EN_RUDE_MARKERS)


def has_polite_marker(text: str) -> bool:
    """True if ``text`` contains any polite marker (English or Chinese)."""
    if not text:
        return False
    return bool(_EN_POLITE_RE.search(text)) or any(m in text for m in ZH_POLITE_MARKERS)


def has_rude_marker(text: str) -> bool:
    """True if ``text`` contains any rude marker (English or Chinese)."""
    if not text:
        return False
    return bool(_EN_RUDE_RE.search(text)) or any(m in text for m in ZH_RUDE_MARKERS)


def is_polite(text: str) -> bool:
    """Rule-based ground truth: at least one polite marker and no rude marker. Empty text is not polite."""
    return has_polite_marker(text) and not has_rude_marker(text)


# ------------------------------------------------------------------------------------ example reward functions
def polite_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for a polite response (:func:`is_polite`), else 0.0: the ground truth itself as the reward.

    The simplest reward function: it needs only the response texts. A rule cannot be hacked the way a learned
    reward model can, but it rewards exactly what it checks (here: a marker phrase and no rude one).
    """
    return [1.0 if is_polite(r) else 0.0 for r in responses]


SENTENCE_ENDS = (".", "!", "?", "。", "！", "？")


def length_format_reward(prompts: list[str], responses: list[str], response_ids: list[list[int]],
                         truncated: list[bool], max_tokens: int = 24) -> list[float]:
    """0.5 for ending as a sentence ends (. ! ? or 。！？), + 0.5 for stopping on its own within `max_tokens`
    tokens (stop token included); 0.0 for an empty response.

    Shows how a function asks for more than the texts: declaring `response_ids` and `truncated` makes rlhf pass
    each response's token ids and whether it was cut at ppo.response_length. Weigh it with another source,
    e.g. `ppo.reward=[model,rlhf_cli.demo:length_format_reward] ppo.reward_weights=[1.0,0.5]`.
    """
    out = []
    for text, ids, cut in zip(responses, response_ids, truncated):
        text = text.strip()
        if not text:
            out.append(0.0)
            continue
        sentence = 0.5 if text.endswith(SENTENCE_ENDS) else 0.0
        length = 0.5 if not cut and len(ids) <= max_tokens else 0.0
        out.append(sentence + length)
    return out
