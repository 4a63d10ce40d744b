"""What a newcomer types that rlhf can read the intent of: a config-group option that does not exist
(`device=gpu`) and a key written as a command-line flag (`--max_steps 10`). Each becomes one line that says what
to type instead. Also each group option's one-line description, for `rlhf --help`. Torch-free, like the rest of
the command line.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from rlhf_cli.errors import RlhfError

# names people use for a group option that has another name here; difflib would answer `gpu` with `cpu`
ALIASES = {
    "device": {"gpu": "cuda", "nvidia": "cuda", "cuda0": "cuda", "gpus": "ddp", "multi-gpu": "ddp",
               "deepspeed": "zero2", "cpu-only": "cpu"},
}
_MISSING_OPTION = re.compile(r"Could not find '([\w-]+)/([^'/]+)'")


def group_options(conf_dir: Path, group: str) -> list[str]:
    """The options of config group `group` (conf/<group>/*.yaml), sorted."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def group_summaries(conf_dir: Path, group: str) -> list[tuple[str, str]]:
    """(option, what it is) for each option of `group`: the first sentence of its file's leading comment, up to a
    colon that starts its details (`ddp`: "Data parallel over GPUs")."""
    from rlhf_cli.config import recipe_summary

    rows = []
    for name in group_options(conf_dir, group):
        first = re.split(r"(?<=[^.])\.(?:\s|$)", recipe_summary(conf_dir / group / f"{name}.yaml"), maxsplit=1)[0]
        rows.append((name, first.split(": ", 1)[0].strip()))
    return rows


def closest_option(group: str, option: str, options: list[str]) -> str | None:
    alias = ALIASES.get(group, {}).get(option.lower())
    if alias in options:
        return alias
    close = difflib.get_close_matches(option.lower(), options, n=1, cutoff=0.6)
    return close[0] if close else None


def missing_option_message(error: str, conf_dir: Path) -> str | None:
    """`device=gpu is not a device option; use one of cpu, ..., zero3 (did you mean device=cuda?)` for Hydra's
    "Could not find 'device/gpu'"; None when `error` is another error or names no group of conf/."""
    m = _MISSING_OPTION.search(error)
    if not m:
        return None
    group, option = m.groups()
    options = group_options(conf_dir, group)
    if not options:
        return None
    close = closest_option(group, option, options)
    guess = f" (did you mean {group}={close}?)" if close else ""
    return f"{group}={option} is not a {group} option; use one of {', '.join(options)}{guess}"


def flag_as_key(command: str, args: list[str], keys, hydra_flags) -> None:
    """Refuse `--max_steps 10` / `--max_steps=10` / `--max-steps 10` when the name is a config key of the
    command's stage (`sft.max_steps`), a top-level key (`seed`), or a key of the data / model / device groups,
    naming the override to type instead. `keys`: every known dotted key; `hydra_flags`: flags Hydra owns."""
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg.split("=", 1)[0] in hydra_flags:
            continue
        name, sep, value = arg[2:].partition("=")
        key = _key_named(command, name.replace("-", "_"), keys)
        if key is None:
            continue
        if not sep:
            follows = args[i + 1] if i + 1 < len(args) else ""
            value = follows if follows and not follows.startswith("-") and "=" not in follows else "VALUE"
        raise RlhfError(f"--{name} is not an option: config keys are set as key=value; use "
                        f"`rlhf {command} {key}={value}`")


def _key_named(command: str, name: str, keys) -> str | None:
    if not name:
        return None
    for prefix in (command, "", "data", "model", "device", "logging"):
        key = f"{prefix}.{name}" if prefix else name
        if key in keys:
            return key
    return None
