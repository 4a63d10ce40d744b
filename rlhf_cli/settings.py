"""A config group as one frozen, typed object: `view("sft", cfg.sft)` has a field per key of `sft.*` in
`rlhf_cli.keys.SCHEMA` (a subgroup such as `sft.lora` a nested view), each value cast by its key's kind
(`cast`). The keys' types, ranges and meanings stay written once, in keys.py; a stage builds its views once at its
entry and hands them to its helpers instead of the DictConfig.

Imports no torch or transformers."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import fields, make_dataclass
from dataclasses import replace as _replace
from types import MappingProxyType

from rlhf_cli.keys import SCHEMA, Rule

# kind -> how a value is cast; list kinds become tuples of the item type
CAST = {"int": int, "float": float, "bool": bool, "text": str, "enum": str, "scheduler": str, "function": str}
ITEMS = {"int_list": int, "number_list": float, "sources": str, "enum_list": str}
# kind -> the field's annotation (a view is read, not type-checked: the annotation documents the value)
_TYPES = {**{k: f"{t.__name__} | None" for k, t in CAST.items()},
          **{k: f"tuple[{t.__name__}, ...] | None" for k, t in ITEMS.items()},
          "modules": "str | tuple[str, ...] | None", "mapping": "Mapping[str, str | None]"}


def annotation(rule: Rule) -> str:
    """The type a value of `rule` holds once cast, as an annotation ("float", "tuple[int, ...] | None"): None only
    where the key takes null (a view's fields all admit None: a key its node lacks reads None)."""
    base = _TYPES[rule.kind].removesuffix(" | None")
    return f"{base} | None" if rule.nullable else base


def cast(rule: Rule, v):
    """A config value as a typed field holds it: None stays None; list kinds become tuples (a single entry a
    1-tuple); an enum is text (true / false as lower-case text); an int's named value beside its range
    (`device.num_processes=auto`) stays as it is; `modules` is a name or a tuple of names, `mapping` a read-only
    dict."""
    if v is None:
        return None
    kind = rule.kind
    if kind in ITEMS:
        item = ITEMS[kind]
        return (item(v),) if isinstance(v, (str, int, float)) else tuple(item(i) for i in v)
    if kind == "modules":
        return str(v) if isinstance(v, str) else tuple(str(i) for i in v)
    if kind == "mapping":
        return MappingProxyType({str(k): None if x is None else str(x) for k, x in v.items()})
    if kind == "int" and isinstance(v, str) and v in rule.choices:
        return v
    return str(v).lower() if isinstance(v, bool) and kind == "enum" else CAST[kind](v)


class Settings:
    """What every view has beside its fields: `get` and `[name]` as a DictConfig node has them, so that a function
    reading a group by attribute, `.get` or `[name]` takes either."""

    __slots__ = ()

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def __getitem__(self, name: str):
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None


def _key(group: str, name: str) -> str:
    return f"{group}.{name}" if group else name


@functools.cache
def view_type(group: str) -> type:
    """The frozen dataclass of `group` ("sft", "device", "sft.lora", ...; "": the whole config, every group a
    field): its keys in SCHEMA's order, a subgroup as one field holding its own view."""
    prefix = group + "." if group else ""
    names: dict[str, object] = {}
    for key, rule in SCHEMA.items():
        if key.startswith(prefix):
            head, _, rest = key[len(prefix):].partition(".")
            names.setdefault(head, view_type(prefix + head) if rest else _TYPES[rule.kind])
    cls_name = "".join(p.title() for p in group.split(".")) or "Run"
    return make_dataclass(cls_name + "Settings", list(names.items()), bases=(Settings,), frozen=True, slots=True,
                          namespace={"GROUP": group})


def view(group: str, node) -> Settings:
    """The typed view of `group` from its node of the composed config (a DictConfig or a mapping; group "": the
    composed config itself); a key the node does not hold is None."""
    cls = view_type(group)
    node = {} if node is None else node
    values = {}
    for f in fields(cls):
        key = _key(group, f.name)
        values[f.name] = cast(SCHEMA[key], node.get(f.name)) if key in SCHEMA else view(key, node.get(f.name))
    return cls(**values)


def of(cfg) -> Settings:
    """The whole composed config as one typed view: `of(cfg).sft.lora.r`, `of(cfg).seed`. It reads as the
    DictConfig does (attributes, `get`), so a function that reads a config by attribute takes either."""
    return view("", cfg)


def with_values(settings: Settings, values: Mapping[str, object]) -> Settings:
    """A copy of the view `settings` with `values` set: each a dotted key below the view's group
    (`{"ppo.value_lora": True}` on `of(cfg)`, `{"lora.r": 8}` on its `sft`), cast by its key's kind (`cast`);
    the view itself is unchanged (views are frozen). A key the view has no field for is a KeyError."""
    group = type(settings).GROUP
    leaves: dict[str, object] = {}
    below: dict[str, dict[str, object]] = {}
    for dotted, value in values.items():
        head, _, rest = dotted.partition(".")
        key = _key(group, head)
        if rest and not isinstance(getattr(settings, head, None), Settings):
            raise KeyError(_key(group, dotted))
        if rest:
            below.setdefault(head, {})[rest] = value
        elif key in SCHEMA:
            leaves[head] = cast(SCHEMA[key], value)
        else:
            raise KeyError(key)
    return _replace(settings, **leaves, **{head: with_values(getattr(settings, head), sub)
                                           for head, sub in below.items()})
