"""The config check: the table of every key under the project's config groups with its type and allowed values
(`SCHEMA`, defined in rlhf_cli.keys), checked once after composition by `validate(cfg)`, before any stage starts or any model is
built. A bad value fails as one line naming the key, the value and what is allowed
(`ppo.total_episodes=abc is not an integer; use a whole number ≥ 1`), instead of deep inside a library
(`invalid literal for int()`, `ZeroDivisionError`, `Invalid learning rate: nan`).

Keys under the groups that the table does not know are refused too, with the closest known key:
`+sft.max_step=2` would otherwise be composed and silently ignored. `check_override_keys` does the same for
the command line before Hydra runs, so `sft.max_step=2` and `+sft.max_step=2` get the same answer. Top-level
keys other than the project's own, `hydra.*`, and free-form values (`eval.policies`, a dict of name ->
directory) are left alone.

Imports no torch or transformers (config errors answer in well under a second).
"""

from __future__ import annotations

import difflib
import math
import re
from urllib.parse import urlsplit

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf_cli.choices import SCHEDULERS, SCHEDULERS_NOT_RUN
from rlhf_cli.errors import RlhfError
from rlhf_cli.keys import GROUPS, REMOVED, RENAMED, SCHEMA, Rule
from rlhf_cli.stage_table import NEEDS_DATA  # commands that read data.train_path

# dict nodes above the keys (ppo.lora, device.fsdp, model.tiny): walked into, not checked as values
_PARENTS = {key.rsplit(".", i)[0] for key in SCHEMA for i in range(1, key.count(".") + 1)}


# ------------------------------------------------------------------------------------------------- checks
def validate(cfg: DictConfig) -> None:
    """Check every key of the composed config against `SCHEMA`; raise one RlhfError naming the first bad key
    (and listing the others). Keys missing from the config are skipped: an older or newer conf/ still runs."""
    problems = list(_problems(cfg))
    if problems:
        first, *rest = problems
        more = f" (also check {', '.join(key for key, _ in rest)})" if rest else ""
        raise RlhfError(first[1] + more)




def check_inputs(cfg: DictConfig) -> None:
    """Inputs a command cannot run without, checked before any model is fetched (a hub download can take long)."""
    if cfg.get("command") in NEEDS_DATA and not cfg.data.get("train_path"):
        raise RlhfError(f"data.train_path is not set: recipe {cfg.get('recipe')} trains on your preference file; "
                        f"e.g. rlhf {cfg.command} recipe={cfg.get('recipe')} data.train_path=pairs.jsonl")


def check_override_keys(overrides: list[str], command: str = "") -> None:
    """Refuse command-line overrides of keys that the groups do not have (`sft.max_step=2`, `+sft.max_step=2`)
    before Hydra composes anything, and top-level names that are neither a key nor a group (`+foo=bar`). Group
    choices (`device=cuda`), top-level keys and `hydra.*` keys pass."""
    # `recipes=` is the recipe group itself, as `rlhf_cli.launch` passes a recipe to the processes it starts
    tops = {k.split(".", 1)[0] for k in SCHEMA} | set(GROUPS) | {"hydra", "recipes"}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("~+").strip()
        head = key.split(".", 1)[0].split("@", 1)[0]
        if head not in tops:  # a top-level typo (`+foo=bar`, `sed=1`) is refused like a group key's
            close = difflib.get_close_matches(head, sorted(tops - {"hydra", "command"}), n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]}?" if close
                    else f"`rlhf {command or '<command>'} --cfg job` prints the keys")
            raise RlhfError(f"{key} is not a config key; {hint}")
        if "." not in key or "@" in key or head not in GROUPS:
            continue
        if key in SCHEMA or key in _PARENTS or any(key.startswith(k + ".") for k in SCHEMA):
            continue
        raise RlhfError(unknown_key_message(key, command))


def unknown_key_message(key: str, command: str = "") -> str:
    """`sft.max_step is not a config key; did you mean sft.max_steps?`"""
    if key in RENAMED:
        return f"{key} is now {RENAMED[key]}; rename it in your command line or recipe"
    if key in REMOVED:
        return f"{key} is not a config key any more: {REMOVED[key]}"
    group, rest = key.split(".", 1)
    known = sorted(k for k in (*SCHEMA, *_PARENTS) if k.split(".", 1)[0] == group)
    # matched below the group name, which every candidate shares (it would make `ppo.lr` look like `ppo.lam`)
    leaves = [k.split(".", 1)[1] for k in known if k in SCHEMA]
    close = difflib.get_close_matches(rest, leaves, n=1, cutoff=0.75)
    if close:
        return f"{key} is not a config key; did you mean {group}.{close[0]}?"
    parent = key.rsplit(".", 1)[0]
    siblings = [k.rsplit(".", 1)[1] for k in known if "." in k and k.rsplit(".", 1)[0] == parent]
    if 0 < len(siblings) <= 10:
        return f"{key} is not a config key; {parent} has {', '.join(siblings)}"
    where = f"`rlhf {command} --cfg job`" if command else "`rlhf <command> --cfg job`"
    return f"{key} is not a config key; {where} prints the keys"


def _problems(cfg: DictConfig):
    """(key, message) for every bad value and unknown key, in config order."""
    try:
        command = str(cfg.get("command") or "")
    except OmegaConfBaseException:
        command = ""
    for key in map(str, cfg.keys()):
        if key not in GROUPS and key not in SCHEMA:
            continue  # hydra.*, and top-level keys of the user's own
        value = _read(cfg, key)
        if isinstance(value, tuple):
            yield value
        elif key in SCHEMA:
            yield from _checked(key, value)
        elif isinstance(value, DictConfig):
            yield from _walk(value, key, command)
        else:
            yield key, f"{key}={_show(value)} is not a config group; set its keys instead ({key}.KEY=VALUE)"


def _walk(node: DictConfig, prefix: str, command: str):
    for name in map(str, node.keys()):
        path = f"{prefix}.{name}"
        value = _read(node, name, path)
        if isinstance(value, tuple):
            yield value
        elif path in SCHEMA:
            yield from _checked(path, value)
        elif path in _PARENTS and isinstance(value, DictConfig):
            yield from _walk(value, path, command)
        elif path in _PARENTS:
            yield path, f"{path}={_show(value)} is not a group of keys; set its keys ({path}.KEY=VALUE)"
        else:
            yield path, unknown_key_message(path, command)


def _read(node: DictConfig, name: str, path: str | None = None):
    """The resolved value, or (path, message) when an interpolation or a ??? cannot be resolved."""
    path = path or name
    try:
        value = node[name]
        if isinstance(value, (DictConfig, ListConfig)) and not (path in _PARENTS or path in GROUPS):
            value = OmegaConf.to_container(value, resolve=True)
        return value
    except OmegaConfBaseException as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return path, f"{path} cannot be resolved ({reason}); set it: {path}=VALUE"


def _checked(key: str, value):
    message = check_value(key, value, SCHEMA[key])
    if message:
        yield key, message


def check_value(key: str, value, rule: Rule) -> str | None:
    """None if `value` is allowed for `key`, else one line: key=value, what is wrong, what to use."""
    shown = f"{key}={_show(value)}"
    allowed = describe(rule)
    if value is None:
        return None if rule.nullable else f"{shown} is not allowed; use {allowed}"
    if rule.kind == "int" and any(_same(value, c) for c in rule.choices):
        return None
    if rule.kind == "int":
        if not _is_int(value):
            return f"{shown} is not an integer; use {allowed}"
        return None if _in_range(value, rule) else f"{shown} is out of range; use {allowed}"
    if rule.kind == "float":
        if not _is_number(value):
            return f"{shown} is not a number; use {allowed}"
        if not math.isfinite(value):
            return f"{shown} is not a finite number; use {allowed}"
        return None if _in_range(value, rule) else f"{shown} is out of range; use {allowed}"
    if rule.kind == "bool":
        return None if isinstance(value, bool) else f"{shown} is not true or false; use {allowed}"
    if rule.kind == "text":
        if not isinstance(value, str):
            return f"{shown} is not text; quote it ({key}='{_show(value)}')"
        return None if value or rule.empty else f"{key} is empty; use {allowed}"
    if rule.kind == "enum":
        return None if any(_same(value, c) for c in rule.choices) else f"{shown} is unknown; use {allowed}"
    if rule.kind == "scheduler":
        return _check_scheduler(key, value)
    if rule.kind == "int_list":
        if not isinstance(value, list) or not all(_is_int(v) and _in_range(v, rule) for v in value):
            return f"{shown} is not a list of token ids; use {allowed}"
        return None
    if rule.kind == "enum_list":
        if not isinstance(value, list):
            return f"{shown} is not a list; use {allowed}"
        bad = [v for v in value if not any(_same(v, c) for c in rule.choices)]
        return f"{key}: {', '.join(map(_show, bad))} is unknown; use {allowed}" if bad else None
    if rule.kind == "modules":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            return f"{shown} is not a module name or a list of them; use {allowed}"
        return None
    if rule.kind == "function":
        if isinstance(value, str) and (value in rule.choices or _function_ref(value)):
            return None
        return f"{shown} is unknown; use {allowed}"
    if rule.kind == "sources":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names:
            return f"{shown} is not a list of reward sources; use {allowed}"
        url_errors = [server_url_error(key, v) for v in names if isinstance(v, str) and is_server_url(v)]
        if any(url_errors):
            return next(e for e in url_errors if e)
        bad = [v for v in names if not (isinstance(v, str) and (v in rule.choices or is_server_url(v)
                                                                or _function_ref(v)))]
        return f"{key}: {_show(bad[0])} is not a reward source; use {allowed}" if bad else None
    if rule.kind == "number_list":
        if not isinstance(value, list) or not value or not all(_is_number(v) and math.isfinite(v) for v in value):
            return f"{shown} is not a list of numbers; use {allowed}"
        return None
    if rule.kind == "mapping":
        if not isinstance(value, dict) or not value:
            return f"{shown} is not a mapping of names to directories; use {allowed}"
        bad = [k for k, v in value.items() if v is not None and (not isinstance(v, str) or not v)]
        if bad:
            return f"{key}.{bad[0]}={_show(value[bad[0]])} is not a directory; use {allowed}"
        return None if any(v is not None for v in value.values()) else f"{shown} leaves nothing; use {allowed}"
    raise AssertionError(f"schema: unknown rule kind {rule.kind!r} for {key}")


def describe(rule: Rule) -> str:
    """What a rule accepts, in words: `a whole number ≥ 1`, `a number in [0, 1)`, `one of k1, k3, mse`."""
    if rule.kind == "int":
        also = [_show(c) for c in rule.choices]
        base = f"a whole number {_range(rule)}".rstrip()
        text_ = " or ".join([*also, base]) if also else base
    elif rule.kind == "float":
        text_ = f"a number {_range(rule)}".rstrip()
    elif rule.kind == "bool":
        text_ = "true or false"
    elif rule.kind == "text":
        text_ = "a non-empty text" if not rule.empty else "a text"
    elif rule.kind == "enum":
        names = [_show(c) for c in rule.choices] + (["null"] if rule.nullable else [])
        return " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
    elif rule.kind == "scheduler":
        text_ = "one of " + ", ".join(SCHEDULERS)
    elif rule.kind == "int_list":
        text_ = "a list of token ids, e.g. [151643, 151645], or []"
    elif rule.kind == "enum_list":
        text_ = "a list of " + ", ".join(_show(c) for c in rule.choices)
    elif rule.kind == "modules":
        text_ = "a module name (all-linear) or a list such as [q_proj, v_proj]"
    elif rule.kind == "mapping":
        text_ = "NAME: DIRECTORY entries (eval.policies.NAME=DIR; eval.policies.NAME=null leaves one out)"
    elif rule.kind == "function":
        names = [_show(c) for c in rule.choices] + (["null"] if rule.nullable else [])
        return f"{' or '.join(names)}, or a function as module:function or /path/file.py:function"
    elif rule.kind == "sources":
        text_ = (f"a list of {', '.join(rule.choices)}, functions (module:function or /path/file.py:function) and "
                 f"reward server URLs (http(s)://host:port/path), e.g. [model] or [rlhf_cli.demo:polite_reward]")
    elif rule.kind == "number_list":
        text_ = "a list of numbers, e.g. [1.0, 0.5]"
    else:
        text_ = rule.kind
    return text_ + (", or null" if rule.nullable else "")


def _check_scheduler(key: str, value) -> str | None:
    if isinstance(value, str) and value in SCHEDULERS:
        return None
    allowed = ", ".join(SCHEDULERS)
    if isinstance(value, str) and value in SCHEDULERS_NOT_RUN:
        return (f"{key}={value} needs a metric or scheduler arguments that rlhf does not pass; use one of "
                f"{allowed}")
    return f"{key}={_show(value)} is unknown; use one of {allowed}"


def scheduler_types() -> tuple[str, ...]:
    """transformers' SchedulerType names. Importing transformers takes seconds (it imports torch), so the
    lists above are written out and checked against this by the tests, not at run time."""
    from transformers.trainer_utils import SchedulerType

    return tuple(s.value for s in SchedulerType)


# ------------------------------------------------------------------------------------------------- helpers
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _function_ref(v: str) -> bool:
    """`module:function` or `path.py:function` in shape (whether it imports is checked when the stage starts)."""
    target, sep, name = v.rpartition(":")
    ident = r"[A-Za-z_][A-Za-z0-9_]*"
    if not sep or not target or not re.fullmatch(rf"{ident}(\.{ident})*", name):
        return False
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    return is_file or bool(re.fullmatch(rf"{ident}(\.{ident})*", target))


def is_server_url(v: str) -> bool:
    """A `ppo.reward` entry that names a reward server rather than a function (rlhf_cli.ppo.rewards.RemoteReward)."""
    return v[:8].lower().startswith(("http://", "https://"))


def server_url_error(key: str, v: str) -> str | None:
    """None if `v` is a usable http(s) URL (a host, a port in range if given, no spaces), else one line saying
    what is wrong with it."""
    if any(ch.isspace() for ch in v):
        problem = "it contains a space"
    else:
        try:
            parts = urlsplit(v)
            port = parts.port
        except ValueError as e:  # a port that is not a number or out of range
            problem = str(e)
        else:
            problem = "no host" if not parts.hostname else "port 0" if port == 0 else None
    return f"{key}: {v} is not a reward server URL ({problem}); use http(s)://host[:port]/path" if problem else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(a, b) -> bool:
    """Equal and of the same type: True is not 1, and "1" is not 1."""
    return type(a) is type(b) and a == b


def _in_range(v, rule: Rule) -> bool:
    if rule.lo is not None and (v < rule.lo or (rule.lo_open and v == rule.lo)):
        return False
    return not (rule.hi is not None and (v > rule.hi or (rule.hi_open and v == rule.hi)))


def _range(rule: Rule) -> str:
    lo, hi = rule.lo, rule.hi
    if lo is not None and hi is not None:
        return f"in {'(' if rule.lo_open else '['}{_show(lo)}, {_show(hi)}{')' if rule.hi_open else ']'}"
    if lo is not None:
        return f"{'>' if rule.lo_open else '≥'} {_show(lo)}"
    if hi is not None:
        return f"{'<' if rule.hi_open else '≤'} {_show(hi)}"
    return ""


def _show(v) -> str:
    """A value as the user would type it on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_show(x)}" for k, x in v.items()) + "}"
    if isinstance(v, str) and not v:
        return "''"
    return str(v)
