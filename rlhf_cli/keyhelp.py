"""`rlhf <command> --help`: the command's keys, grouped, each with its value in the composed config (after the
recipe and the overrides given) and its help, both read from their one definition: the value from the config
groups in conf/, the type and meaning from `rlhf_cli.keys.SCHEMA`. Imports no torch or transformers."""

from __future__ import annotations

import shutil
import textwrap

from rlhf_cli import schema
from rlhf_cli.config import CONF_DIR, compose
from rlhf_cli.keys import SCHEMA, Rule
from rlhf_cli.recipes import resolved
from rlhf_cli.stage_table import STAGES

# the groups every command reads besides its own, in the order shown
SHARED = (("model", "model: what is trained (model=NAME picks conf/model/NAME.yaml)"),
          ("data", "data: the rows (data=file: your own file)"),
          ("device", "device: where it runs (device=NAME picks conf/device/NAME.yaml)"),
          ("", "run: the run as a whole"),
          ("logging", "logging: where metrics go"))
# rule kinds whose allowed values are worth a bracket after the help (a range, the choices)
_SAY_ACCEPTS = ("int", "float", "enum", "enum_list", "scheduler")
_TOP = ("recipe", "run_dir", "seed", "debug", "dry_run", "export.output_dir")


def command_help(command: str, overrides: list[str], width: int | None = None) -> str:
    """The help page of `rlhf <command>`: its summary, the config groups' options and every key it reads."""
    cfg = compose(command, overrides)
    values = resolved(cfg)
    width = width or min(shutil.get_terminal_size((120, 24)).columns, 120)
    summary = next((s.summary for s in STAGES if s.name == command), command)
    out = [f"usage: rlhf {command} [recipe=NAME] [group=option ...] [key=value ...] [-m] [--cfg job]", "",
           f"{command}: {summary}", "",
           f"config groups (group=option; the recipe, now {cfg.recipe}, picks them unless you do):"]
    out += [f"  {g:<7} {', '.join(sorted(p.stem for p in (CONF_DIR / g).glob('*.yaml')))}"
            for g in ("model", "data", "device")]
    sections = [(command, f"{command}: this command's keys")] if command in cfg else []
    for prefix, title in (*sections, *SHARED):
        keys = _TOP if prefix == "" else [k for k in SCHEMA if k.startswith(prefix + ".")]
        if prefix == "logging" and "logging" not in cfg:
            continue
        out += ["", title + " (value now; what it means)"]
        out += [_line(k, _value(values, k), SCHEMA[k], width) for k in keys]
    out += ["", ("Set a key with key=value (ppo.kl_coef=0.1), a group with group=option (device=cuda); "
                 f"`rlhf {command} --cfg job` prints the composed config, `rlhf --help` the commands.")]
    return "\n".join(out) + "\n"


def _show(value) -> str:
    """A value as it is written on the command line: null, true, [a, b], {name: dir}."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _value(values: dict, key: str):
    node = values
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _line(key: str, value, rule: Rule, width: int) -> str:
    head = f"  {key} = {_show(value)}"
    accepts = schema.describe(rule) if rule.kind in _SAY_ACCEPTS else ""
    what = f"{rule.help} [{accepts}]" if accepts and accepts not in rule.help else rule.help
    body = textwrap.wrap(what, max(width - 8, 40))
    return "\n".join([head, *("      " + line for line in body)])
