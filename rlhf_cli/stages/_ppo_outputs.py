"""What `rlhf ppo` writes and says around its training loop: the published outputs (adapter or policy, tokenizer,
value/, merged/, metrics.json), the model cards, and the warnings about what the earlier stages did not learn."""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf_cli import cards, quantization
from rlhf_cli.hardware import resolve_precision
from rlhf_cli.io import write_json
from rlhf_cli.learned import earlier_stage_warnings, watch_gaming
from rlhf_cli.models import merge_lora, merge_unquantized
from rlhf_cli.ppo import checkpoint
from rlhf_cli.ppo.trainer import PPOTrainer

log = logging.getLogger("rlhf")


def warn_what_did_not_learn(trainer: PPOTrainer, p) -> None:
    """Before the first update: the warnings of the SFT and reward stages (rlhf_cli.learned), then the watch for a
    gamed reward during the run."""
    for warning in earlier_stage_warnings(p.policy_dir, p.reward_dir if trainer.c.uses_reward_model else None):
        log.warning(warning)
    watch_gaming(trainer)


def write_cards(work: Path, cfg, rows: dict) -> None:
    """The model cards of the run (rlhf_cli.cards): the policy's, then best/'s and merged/'s where they are. `cfg`
    is the composed config itself (a DictConfig), which each card records (cards.stage_record)."""
    cards.write_card(work, cfg, "ppo", rows)
    if (work / "best").is_dir():
        cards.write_card(work / "best", cfg, "best", rows)
    if (work / "merged").is_dir():
        cards.write_card(work / "merged", cfg, "export", after=work)


def write_outputs(trainer: PPOTrainer, tok, work: Path, run, seconds: float) -> None:
    """Adapter (or policy) + tokenizer at the top, value/, merged/ with `ppo.merge=true`, metrics.json; `run`: the
    run's settings (rlhf_cli.settings.of, or the composed config)."""
    p, c = run.ppo, trainer.c
    checkpoint.save_model(trainer.unwrapped, work)
    tok.save_pretrained(str(work))
    if trainer.value is not None:
        checkpoint.save_model(trainer.value_model(), work / "value", root=work.parent)  # a base in the run: relative
    if p.merge and p.lora.enabled:
        import copy

        if quantization.mode(run.model):  # into the base unquantized, as rlhf export merges
            merged = merge_unquantized(trainer.unwrapped, p.policy_dir, resolve_precision(run)[0], run.model)
        else:
            merged = merge_lora(copy.deepcopy(trainer.unwrapped))
        merged.save_pretrained(str(work / "merged"))
        tok.save_pretrained(str(work / "merged"))
    write_json(work / "metrics.json", {
        **trainer.progress.metrics, "updates": trainer.sizes.num_updates, "total_episodes": trainer.progress.episodes,
        "train_seconds": round(seconds, 2), "world_size": trainer.world,
        "policy_dir": str(Path(p.policy_dir).resolve()),
        "reward_dir": str(Path(p.reward_dir).resolve()) if c.uses_reward_model else None,
        "advantage": c.advantage, "reward": list(c.reward),
        **({"best": {k: v for k, v in trainer.best.items() if k != "eval"}} if trainer.best else {})})
