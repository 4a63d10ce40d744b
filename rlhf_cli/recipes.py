"""`rlhf recipes`: list the recipes, print one composed (`show`), or copy one to edit (`copy`).

Kept import-light (`rlhf recipes` answers without torch); Hydra composes only for `show`.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

from rlhf_cli.config import (
    CONF_DIR,
    CONFIG_ROOT,
    RECIPES_ENV,
    compose,
    copy_recipe,
    find_recipes,
    recipe_dirs,
    recipe_summary,
)
from rlhf_cli.errors import RlhfError

RECIPES_USAGE = ("usage: rlhf recipes [list] | rlhf recipes show NAME [key=value ...] | "
                 "rlhf recipes copy NAME [NEW]")


def recipes_command(args: list[str]) -> None:
    """`rlhf recipes ...`: list, show or copy recipes. A wrong use raises RlhfError with the usage line; the
    dispatcher prints errors as its one line."""
    sub, rest = (args[0], args[1:]) if args else ("list", [])
    if sub in ("-h", "--help", "help"):
        print(RECIPES_USAGE)
    elif sub == "list" and not rest:
        print("\n".join(recipe_listing()))
    elif sub == "show" and rest and "=" not in rest[0]:
        print(show_recipe(rest[0], rest[1:]), end="")
    elif sub == "copy" and len(rest) in (1, 2):
        path = copy_recipe(rest[0], rest[1] if len(rest) == 2 else None)
        name = path.stem
        found = find_recipes().get(name)
        used = found is not None and found.path.resolve() == path.resolve()
        print(f"wrote {path}; edit it, then: rlhf sft recipe={name}" if used else
              f"wrote {path}; it is not in a recipe folder: move it to ./recipes/ or add its folder to "
              f"${RECIPES_ENV}")
    else:
        raise RlhfError(RECIPES_USAGE)


def recipe_listing() -> list[str]:
    """`rlhf recipes`: one line per recipe (name, where it comes from, its first comment line), user recipes
    marked, and the folders searched."""
    recipes = find_recipes()
    rows = []
    for r in recipes.values():
        where = "shipped" if r.shipped else _short(r.path)
        note = recipe_summary(r.path)
        if r.hides is not None:
            hidden = "the shipped one" if r.hides.resolve().parent == (CONFIG_ROOT / "recipes").resolve() \
                else _short(r.hides)
            note = f"[replaces {hidden}] {note}"
        rows.append((r.name, where, note))
    w0 = max((len(a) for a, _, _ in rows), default=0)
    w1 = max((len(b) for _, b, _ in rows), default=0)
    width = max(shutil.get_terminal_size((110, 24)).columns, w0 + w1 + 40)
    lines = [textwrap.fill(c, width, initial_indent=f"{a:<{w0}}  {b:<{w1}}  ",
                           subsequent_indent=" " * (w0 + w1 + 4)) if c else f"{a:<{w0}}  {b}".rstrip()
             for a, b, c in rows]
    env = [Path(p).expanduser().resolve() for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep)
           if p.strip()]
    dirs = []
    for d in recipe_dirs():
        if d.resolve() == (CONFIG_ROOT / "recipes").resolve():
            label = f"shipped ({d})"
        elif d.resolve() in env:
            label = f"{d} (${RECIPES_ENV})"
        else:
            label = "./recipes"
        dirs.append(label if d.is_dir() else f"{label}, missing")
    if not env:
        dirs.insert(-1, f"${RECIPES_ENV} (not set; folders separated by '{os.pathsep}')")
    searched = (f"searched in order: {'; '.join(dirs)}\n`rlhf recipes show NAME` prints one composed; "
                "`rlhf recipes copy NAME NEW` writes ./recipes/NEW.yaml to edit")
    return [*lines, "", searched]


def _short(path: Path) -> str:
    """A path relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def show_recipe(name: str, overrides: list[str]) -> str:
    """The config recipe NAME composes to (with `overrides`), as YAML with its interpolations resolved
    (`${run_dir}/sft` as the directory it names); one that cannot be resolved without running (an unset
    environment variable) is printed as written. Checked against the schema like a run."""
    cfg = compose("sft", [f"recipe={name}", *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.pop("command", None)
    recipe = find_recipes()[name]
    origin = "shipped" if recipe.shipped else str(recipe.path)
    return (f"# recipe {name} ({origin}), composed with {CONF_DIR}; values resolved "
            f"(`rlhf sft recipe={name} --cfg job` shows where they come from)\n"
            + OmegaConf.to_yaml(OmegaConf.create(resolved(cfg))))


def resolved(node):
    """`node` as plain containers with every interpolation that resolves replaced by its value; one that does
    not (an unset environment variable, a value only a run knows) stays as written."""
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    written = OmegaConf.to_container(node, resolve=False)
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    out = {} if isinstance(node, DictConfig) else []
    for key in keys:
        try:
            value = node[key]
        except OmegaConfBaseException:
            value = written[key]
        value = resolved(value) if OmegaConf.is_config(value) else value
        if isinstance(out, dict):
            out[key] = value
        else:
            out.append(value)
    return out
