"""`rlhf export`: the PPO policy (base + LoRA adapter) merged into a full model directory that loads with
`AutoModelForCausalLM` alone. Writes `<ppo.output_dir>/merged` (or `export.output_dir=...`).

The base is always loaded unquantized, in the run's storage precision (`model.dtype`), whatever
`model.quantization` says: an adapter trained on a 4-bit / 8-bit base (QLoRA) merges into plain weights, which
differ from the trained policy by the base's quantization error, as every QLoRA merge does."""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf_cli import quantization, settings
from rlhf_cli.cards import write_card
from rlhf_cli.config import require_dir
from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import resolve_precision, setup_torch
from rlhf_cli.io import atomic_dir, check_output_dir
from rlhf_cli.models import load_policy, load_tokenizer

log = logging.getLogger("rlhf")


def run(cfg) -> None:
    """The composed config `cfg` is only recorded (the model card); what the stage reads is its typed settings."""
    typed = settings.of(cfg)
    setup_torch(typed)
    ppo_dir = require_dir(typed.ppo.output_dir, "PPO output (ppo.output_dir)", "rlhf ppo")
    if not (ppo_dir / "adapter_config.json").exists():
        raise RlhfError(f"{ppo_dir} holds no LoRA adapter (adapter_config.json); a full fine-tune is already a "
                        "complete model")
    base_dir = require_dir(typed.ppo.policy_dir, "SFT policy (ppo.policy_dir)", "rlhf sft")
    target = Path(typed.export.output_dir or ppo_dir / "merged")
    check_output_dir(target, "export", [ppo_dir, base_dir])  # before the model loads (atomic_dir checks again)
    storage = resolve_precision(typed)[0]
    model = load_policy(ppo_dir, storage, typed.model, base_dir=base_dir, merge=True)
    tok = load_tokenizer(ppo_dir, typed.model)
    with atomic_dir(target, "export", [ppo_dir, base_dir]) as out:
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
        write_card(out, cfg, "export", after=ppo_dir)
    dtype, q = str(storage).removeprefix("torch."), quantization.mode(typed.model)
    how = f" (the {q} base of training loaded unquantized in {dtype})" if q else f" ({dtype})"
    log.info("export: wrote the merged policy to %s", target)
    print(f"merged model: {target}{how}")
