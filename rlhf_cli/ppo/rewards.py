"""Rewards and ground truth written as Python functions: `ppo.reward` entries and `data.ground_truth`.

A function is named as `module:function` (an importable module, e.g. `rlhf_cli.demo:polite_reward`) or
`/path/file.py:function` (a file, relative to the working directory or absolute). It is loaded once, before any
model, and every call's result is checked, so that a broken function stops the run with one line naming it.

Reward function (`ppo.reward`): called once per batch as ``fn(prompts, responses, **wanted)`` and returns one
float per response. `prompts` are the rendered prompt texts the policy continued (chat template included),
`responses` the decoded responses (special tokens dropped). `wanted` holds only what the function declares as
parameters (all of it with ``**kwargs``): `prompt_ids` / `response_ids` (lists of token ids, no padding; a
response's ids end with its stop token when it has one), `truncated` (bools: cut at ppo.response_length
without a stop token), and every extra field of the data rows by its name (e.g. a reference `answer`).

Ground truth (`data.ground_truth`): called once per response as ``fn(response, **wanted)`` with `prompt` and the
row's extra fields on request; returns a bool, or a number in [0, 1] (partial credit). `demo_polite` is the
shipped demo's checker, `rlhf_cli.demo:is_polite`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_cli.choices import GROUND_TRUTH_SPECS
from rlhf_cli.errors import RlhfError

BUILTIN_GROUND_TRUTH = GROUND_TRUTH_SPECS
REWARD_INPUTS = ("prompt_ids", "response_ids", "truncated")  # besides prompts and responses, and the data's fields
SPEC_HELP = "module:function or /path/file.py:function"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


# -------------------------------------------------------------------------------------------------- loading
def split_spec(spec: str) -> tuple[str, str] | None:
    """`module:function` / `path.py:function` -> (target, function); None when `spec` has neither shape."""
    target, sep, name = str(spec).rpartition(":")
    if not sep or not target or not _NAME.match(name):
        return None
    if not _is_file(target) and not _NAME.match(target):
        return None
    return target, name


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def load_function(spec: str, key: str) -> Callable:
    """The callable `spec` names; `key` (the config key) is named in every error."""
    parts = split_spec(spec)
    if parts is None:
        raise RlhfError(f"{key}: {spec!r} is not a function reference; use {SPEC_HELP}")
    target, name = parts
    if _is_file(target):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RlhfError(f"{key}: {spec}: file {path} does not exist; give the path of a .py file")
        mod_name = f"rlhf_user_{re.sub(r'[^A-Za-z0-9_]', '_', str(path))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - any error in the user's file: one line naming it
                raise RlhfError(f"{key}: {spec}: importing {path} failed ({_first_line(e)})") from e
            sys.modules[mod_name] = module
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise RlhfError(f"{key}: {spec}: no module {e.name!r} (is it installed, or on PYTHONPATH? a file is "
                            "named as /path/file.py:function)") from e
        except Exception as e:  # noqa: BLE001
            raise RlhfError(f"{key}: {spec}: importing {target} failed ({_first_line(e)})") from e
    fn = module
    for part in name.split("."):
        if not hasattr(fn, part):
            raise RlhfError(f"{key}: {spec}: {target} has no {name!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RlhfError(f"{key}: {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _wanted(fn: Callable, spec: str, key: str, positional: int, offered: set[str]) -> set[str] | None:
    """The keyword inputs `fn` declares among `offered` (None: it takes **kwargs, so all). Refuses a function
    that cannot take `positional` arguments or needs a parameter nobody supplies."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins without a signature: positional arguments only
    params = list(sig.parameters.values())
    takes_all = any(q.kind is q.VAR_KEYWORD for q in params)
    pos = [q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    if len(pos) < positional and not any(q.kind is q.VAR_POSITIONAL for q in params):
        raise RlhfError(f"{key}: {spec} takes {len(pos)} positional argument(s); it is called as "
                        f"{'fn(prompts, responses, ...)' if positional == 2 else 'fn(response, ...)'}")
    rest = [q for q in params[positional:] if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)] \
        if len(pos) >= positional else [q for q in params if q.kind is q.KEYWORD_ONLY]
    missing = [q.name for q in rest if q.default is q.empty and q.name not in offered]
    if missing:
        raise RlhfError(f"{key}: {spec} needs {', '.join(missing)}, which rlhf does not supply; it can ask for "
                        f"{', '.join(sorted(offered)) or 'nothing more'}")
    return None if takes_all else {q.name for q in rest if q.name in offered}


# -------------------------------------------------------------------------------------------------- checks
def _number(v, i: int, what: str) -> float:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    try:
        if isinstance(v, (str, bytes)):
            raise TypeError
        x = float(v)
    except (TypeError, ValueError):
        raise RlhfError(f"{what} returned {v!r} ({type(v).__name__}) for response {i}; "
                        "return one float per response") from None
    if not math.isfinite(x):
        raise RlhfError(f"{what} returned a non-finite value ({x}) for response {i}; return finite floats")
    return x


# -------------------------------------------------------------------------------------------------- rewards
@dataclass(frozen=True)
class RewardFunction:
    """One `ppo.reward` function, loaded and checked once."""

    spec: str
    fn: Callable
    wanted: frozenset[str] | None   # keyword inputs it declared; None: all (it takes **kwargs)

    @property
    def name(self) -> str:
        return self.spec.rpartition(":")[2]

    @classmethod
    def load(cls, spec: str, extra_fields: set[str] = frozenset(), key: str = "ppo.reward") -> RewardFunction:
        fn = load_function(spec, key)
        wanted = _wanted(fn, spec, key, 2, set(REWARD_INPUTS) | set(extra_fields))
        return cls(spec, fn, None if wanted is None else frozenset(wanted))

    def __call__(self, prompts: list[str], responses: list[str], **inputs) -> list[float]:
        """Scores of `responses`: one finite float each, or an RlhfError naming the function."""
        kw = inputs if self.wanted is None else {k: v for k, v in inputs.items() if k in self.wanted}
        what = f"ppo.reward function {self.spec}"
        try:
            out = self.fn(prompts, responses, **kw)
        except RlhfError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
            raise RlhfError(f"{what} raised {_first_line(e)}; fix it (it got {len(responses)} responses) or "
                            "remove it from ppo.reward") from e
        if isinstance(out, torch.Tensor):
            out = out.detach().flatten().tolist()
        try:
            n = len(out)
        except TypeError:
            raise RlhfError(f"{what} returned a {type(out).__name__}, not a list; return one float per "
                            "response") from None
        if n != len(responses):
            raise RlhfError(f"{what} returned {n} values for {len(responses)} responses; return one float per "
                            "response")
        return [_number(v, i, what) for i, v in enumerate(out)]


def reward_inputs(exp, rows: list[dict]) -> dict:
    """What a reward function may ask for, from an `Experience` and the data rows' extra fields (one dict per
    row): prompt_ids, response_ids, truncated, and each extra field as a list."""
    P = exp.context_length
    prompt_ids = [ids[m.bool()].tolist()
                  for ids, m in zip(exp.input_ids[:, :P].cpu(), exp.attention_mask[:, :P].cpu())]
    response_ids = [ids[m.bool()].tolist() for ids, m in zip(exp.response_ids.cpu(), exp.response_mask.cpu())]
    inputs = {"prompt_ids": prompt_ids, "response_ids": response_ids,
              "truncated": [not bool(s) for s in exp.has_stop.tolist()]}
    for name in sorted({k for r in rows for k in r}):
        if name not in inputs and name not in ("prompts", "responses"):
            inputs[name] = [r.get(name) for r in rows]
    return inputs


def source_names(specs: tuple[str, ...]) -> list[str]:
    """Metric names of the reward sources (`reward/<name>`): "model", and each function's name (made unique)."""
    names = []
    for spec in specs:
        base = spec if ":" not in spec else spec.rpartition(":")[2]
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


def weighted_sum(scores: list[torch.Tensor], weights: tuple[float, ...]) -> torch.Tensor:
    """Σ_k w_k · s_k over the sources, each (B,) -> (B,). A single source of weight 1 is returned as it is."""
    if len(scores) == 1 and weights[0] == 1.0:
        return scores[0]
    total = torch.zeros_like(scores[0])
    for s, w in zip(scores, weights):
        total = total + float(w) * s
    return total


# ---------------------------------------------------------------------------------------------- ground truth
@dataclass(frozen=True)
class GroundTruth:
    """`data.ground_truth`: a checker of one response, returning a bool or a number in [0, 1]."""

    spec: str
    fn: Callable
    wanted: frozenset[str] | None

    @classmethod
    def load(cls, spec: str | None, extra_fields: set[str] = frozenset()) -> GroundTruth | None:
        """None for null; `demo_polite` is the demo's checker."""
        if spec in (None, ""):
            return None
        spec = BUILTIN_GROUND_TRUTH.get(str(spec), str(spec))
        fn = load_function(spec, "data.ground_truth")
        wanted = _wanted(fn, spec, "data.ground_truth", 1, {"prompt"} | set(extra_fields))
        return cls(spec, fn, None if wanted is None else frozenset(wanted))

    def __call__(self, responses: list[str], prompts: list[str] | None = None,
                 rows: list[dict] | None = None) -> list[float]:
        """One value in [0, 1] per response (a bool is 0 or 1); pass = value ≥ 0.5."""
        out = []
        what = f"data.ground_truth function {self.spec}"
        for i, text in enumerate(responses):
            offered = dict(rows[i]) if rows else {}
            if prompts is not None:
                offered["prompt"] = prompts[i]
            kw = offered if self.wanted is None else {k: v for k, v in offered.items() if k in self.wanted}
            try:
                v = self.fn(text, **kw)
            except Exception as e:  # noqa: BLE001
                raise RlhfError(f"{what} raised {_first_line(e)} on response {i} ({text[:40]!r}); fix it or set "
                                "data.ground_truth=null") from e
            x = _number(v, i, what)
            if not 0.0 <= x <= 1.0:
                raise RlhfError(f"{what} returned {x} for response {i}; return a bool or a number in [0, 1]")
            out.append(x)
        return out
