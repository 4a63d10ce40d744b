"""Config composition, resolvers, derived sizes and validation. Imports no torch."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf_cli.errors import RlhfError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CONF_DIR = REPO_DIR / "conf"
RECIPES_DIR = REPO_DIR / "recipes"
COMMANDS = ("sft", "reward", "ppo", "eval", "chat", "export", "doctor")

log = logging.getLogger("rlhf")


def register_resolvers() -> None:
    """`${pkg:demo/data/x.jsonl}` -> an absolute path inside the installed package."""
    if not OmegaConf.has_resolver("pkg"):
        OmegaConf.register_new_resolver("pkg", lambda rel: str(PACKAGE_DIR / rel))


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def searchpath_override() -> str:
    # recipes/ lives beside conf/ (a top-level folder users edit), so the repo root joins Hydra's search path
    # and `recipes` becomes a config group of whole-chain presets.
    return f"hydra.searchpath=[file://{REPO_DIR}]"


def _quote(value: str) -> str:
    # Inside Hydra's quoted strings a backslash is literal unless it is part of a run of backslashes before a
    # quote (or before the closing quote): only those runs are doubled, and quotes escaped.
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"


def _free_text(override: str, command: str) -> str:
    """Quote free text that Hydra's override lexer rejects unquoted (non-ASCII, spaces, punctuation):
    `rlhf chat prompt="你好, world?"` is `chat.prompt='你好, world?'`."""
    key, sep, value = override.partition("=")
    if not sep or value[:1] in ("'", '"'):
        return override
    if command == "chat" and key in ("prompt", "system_prompt"):
        return f"chat.{key}={_quote(value)}"
    # special-token spellings such as <|endoftext|> are never Hydra syntax
    if key in ("chat.prompt", "chat.system_prompt", "data.system_prompt") or not value.isascii() \
            or any(c in value for c in "<|>"):
        return f"{key}={_quote(value)}"
    return override


def translate_overrides(command: str, overrides: list[str]) -> list[str]:
    """User overrides -> Hydra overrides: `recipe=NAME` selects recipes/NAME.yaml; free text is quoted. Keys
    that the config groups do not have are refused here, before Hydra (see rlhf_cli.schema)."""
    from rlhf_cli import schema

    schema.check_override_keys(overrides, command)
    out = [searchpath_override(), f"command={command}"]
    for o in overrides:
        o = _free_text(o, command)
        if o.startswith("recipe="):
            name = o.split("=", 1)[1]
            if name not in recipe_names():
                raise RlhfError(f"unknown recipe '{name}': choose one of {', '.join(recipe_names())} "
                                f"(files in {RECIPES_DIR})")
            o = f"recipes={name}"
        out.append(o)
    return out


def compose(command: str, overrides: list[str] | None = None, validate: bool = True) -> DictConfig:
    """Compose the config as the CLI would, without Hydra's run directory or logging (tests, notebooks), and
    check it against the schema as the CLI does (`validate=False`: a test of a later check)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlhf_cli import schema

    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = hydra_compose(config_name="config", overrides=translate_overrides(command, overrides or []))
    if validate:
        schema.validate(cfg)
    return cfg


@dataclass(frozen=True)
class PPOSizes:
    """Batch arithmetic of one PPO update, computed once (names as in the PPO stage).

    local_batch_size     episodes one process generates per update
    batch_size           episodes per update over all processes
    mini_batch_size      episodes per optimizer step over all processes
    local_mini_batch_size  episodes per optimizer step on one process
    num_updates          updates in the run (total_episodes // batch_size)
    """

    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    num_mini_batches: int
    local_mini_batch_size: int
    local_batch_size: int
    mini_batch_size: int
    batch_size: int
    rollout_forward_batch_size: int
    num_updates: int


def ppo_sizes(p: DictConfig, world_size: int = 1) -> PPOSizes:
    """Derive and validate the PPO batch sizes; every failure names the keys to change. Episodes beyond the
    last whole batch are not trained (a warning says how many are), so that every update has the same size."""
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                "rollout_forward_batch_size", "num_ppo_epochs", "total_episodes"):
        if int(p[key]) < 1:
            raise RlhfError(f"ppo.{key} must be >= 1 (got {p[key]})")
    if int(p.response_length) < 1:
        raise RlhfError(f"ppo.response_length must be >= 1 (got {p.response_length}): it is the number of "
                        "tokens generated per episode")
    micro = int(p.per_device_train_batch_size)
    accum = int(p.gradient_accumulation_steps)
    local_mini = micro * accum
    local_batch = local_mini * int(p.num_mini_batches)
    batch = local_batch * world_size
    fwd = int(p.rollout_forward_batch_size)
    if local_batch % fwd != 0 and fwd < local_batch:
        raise RlhfError(
            f"ppo.rollout_forward_batch_size={fwd} does not divide the per-process rollout of {local_batch} "
            f"episodes (per_device_train_batch_size {micro} × gradient_accumulation_steps {accum} × "
            f"num_mini_batches {p.num_mini_batches}); pick a divisor such as {math.gcd(fwd, local_batch)}")
    num_updates = int(p.total_episodes) // batch
    if num_updates < 1:
        raise RlhfError(f"ppo.total_episodes={p.total_episodes} is smaller than one update of {batch} episodes "
                        f"({world_size} process(es) × {local_batch}); raise ppo.total_episodes to at least {batch}")
    if int(p.total_episodes) % batch:
        trained = num_updates * batch
        log.warning("ppo.total_episodes=%s is not a multiple of the %d-episode batch; training %d episodes "
                    "(%d update%s); a multiple of %d uses them all", p.total_episodes, batch, trained,
                    num_updates, "" if num_updates == 1 else "s", batch)
    return PPOSizes(world_size=world_size, micro_batch_size=micro, gradient_accumulation_steps=accum,
                    num_mini_batches=int(p.num_mini_batches), local_mini_batch_size=local_mini,
                    local_batch_size=local_batch, mini_batch_size=local_mini * world_size, batch_size=batch,
                    rollout_forward_batch_size=min(fwd, local_batch), num_updates=num_updates)


def require_dir(path: str | Path, what: str, made_by: str, marker: str | None = None) -> Path:
    """A stage input that an earlier command writes; the error names that command."""
    p = Path(path)
    if not p.is_dir() or (marker is not None and not (p / marker).exists()):
        raise RlhfError(f"{what} not found at {p}: run `{made_by}` first, or point the config at one")
    return p
