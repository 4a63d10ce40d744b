"""Config composition, resolvers, derived sizes and validation. Imports no torch."""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf_cli import schema
from rlhf_cli.choices import COMMANDS  # noqa: F401 - importable from here, as the CLI and the tests do
from rlhf_cli.errors import RlhfError

PACKAGE_DIR = Path(__file__).resolve().parent


def config_root(package_dir: Path = PACKAGE_DIR) -> Path:
    """The folder that holds conf/ and recipes/. A wheel carries them as rlhf_cli/_config/ (pyproject.toml
    maps the repository's top-level folders there when it builds), so an installed `rlhf` composes from any
    directory; a checkout or an editable install has them at the repository root, beside the package."""
    packaged = package_dir / "_config"
    return packaged if (packaged / "conf" / "config.yaml").is_file() else package_dir.parent


CONFIG_ROOT = config_root()
CONF_DIR = CONFIG_ROOT / "conf"
RECIPES_DIR = CONFIG_ROOT / "recipes"  # the shipped recipes; users add their own (recipe_dirs)
RECIPES_ENV = "RLHF_RECIPES"           # more recipe folders, separated by os.pathsep
# Hydra looks a config group up under its search-path roots (<root>/recipes/NAME.yaml), which a user folder
# of any name cannot be: a user recipe is loaded and stored in Hydra's ConfigStore as the option
# `recipes=user/NAME`.
USER_OPTION = "user/"

log = logging.getLogger("rlhf")


def register_resolvers() -> None:
    """`${pkg:demo/data/x.jsonl}` -> an absolute path inside the installed package; `${demo_only:...}` (below);
    `${job_dir_name:N,OVERRIDES}` -> the directory name of multirun job N (conf/config.yaml,
    hydra.sweep.subdir); `${run_name:RECIPE,TRAIN_PATH}` -> run_dir's name (`run_name`)."""
    if not OmegaConf.has_resolver("pkg"):
        OmegaConf.register_new_resolver("pkg", lambda rel: str(PACKAGE_DIR / rel))
    if not OmegaConf.has_resolver("job_dir_name"):
        OmegaConf.register_new_resolver("job_dir_name", job_dir_name)
    if not OmegaConf.has_resolver("demo_only"):
        OmegaConf.register_new_resolver("demo_only", demo_only)
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name)


DEMO_TRAIN = "demo/data/polite_train.jsonl"


def shipped(path) -> bool:
    """A data file shipped with rlhf (rlhf_cli/demo/data: the demo's, tiny-math's): the demo tokenizer covers it
    and its recipe names its own run directory."""
    return Path(str(path)).expanduser().resolve().parent == PACKAGE_DIR / "demo" / "data"


def run_name(recipe, train_path) -> str:
    """`${run_name:${recipe},${data.train_path}}`: the recipe's name, with the training file's stem added when it
    is not the demo's (runs/tiny-my_pairs for data.train_path=my_pairs.jsonl)."""
    if not train_path or demo_only(train_path, True) or shipped(train_path):
        return str(recipe)
    stem = Path(str(train_path).rstrip("/")).name.split(".")[0]
    stem = re.sub(r"[^\w.-]", "_", stem).strip("._") or "data"
    return f"{recipe}-{stem}"



def demo_only(train_path, value):
    """`${demo_only:${.train_path},VALUE}`: VALUE while the training file is the shipped demo's, else None. The demo
    data config gives its held-out file and its ground truth this way, so that a user's `data.train_path` alone is
    evaluated on its own split, with no demo checker, unless data.eval_path / data.ground_truth are set too."""
    return value if str(train_path) == str(PACKAGE_DIR / DEMO_TRAIN) else None


def job_dir_name(num, overrides: str = "", limit: int = 96) -> str:
    """`0_sft.learning_rate=0.001`: the job number, then the swept values as Hydra writes them
    (hydra.job.override_dirname), with path separators and other characters a file name should not carry
    replaced by `_`. The number alone keeps names unique, so a long tail is cut."""
    tail = re.sub(r"[^\w.,=+@-]", "_", str(overrides or ""))[:limit]
    return f"{num}_{tail}" if tail else str(num)


# ------------------------------------------------------------------------------------------------ recipes
@dataclass(frozen=True)
class Recipe:
    """A recipe file as the search found it. `hides`: the file of the same name further down the search path
    that this one replaces (a shipped recipe, or one in a later user folder)."""

    name: str
    path: Path
    shipped: bool
    hides: Path | None = None


def recipe_dirs() -> list[Path]:
    """Where `recipe=NAME` is looked up, first match wins: ./recipes in the working directory, the folders in
    $RLHF_RECIPES, then the recipes shipped with rlhf. A recipe is chosen before the config is composed, so
    its folders cannot come from a config key. Each folder is listed once (run from the repository root,
    ./recipes is the shipped folder)."""
    extra = [Path(p).expanduser() for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p.strip()]
    dirs, seen = [], set()
    for d in (Path.cwd() / "recipes", *extra, RECIPES_DIR):
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            dirs.append(d)
    return dirs


def find_recipes() -> dict[str, Recipe]:
    """Every recipe on the search path by name (sorted), user recipes before shipped ones of the same name."""
    shipped_dir = RECIPES_DIR.resolve()
    found: dict[str, Recipe] = {}
    for d in recipe_dirs():
        shipped = d.resolve() == shipped_dir
        for path in sorted(d.glob("*.yaml")):
            first = found.get(path.stem)
            if first is None:
                found[path.stem] = Recipe(path.stem, path, shipped)
            elif first.hides is None:
                found[path.stem] = Recipe(first.name, first.path, first.shipped, hides=path)
    return dict(sorted(found.items()))


def recipe_names() -> list[str]:
    return list(find_recipes())


def read_recipe(path: Path) -> str:
    """A recipe file's text; one that is not UTF-8 is an error naming the file and the place."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise RlhfError(f"recipe {path} is not UTF-8 (byte 0x{data[e.start]:02x} on line {line}); save it as UTF-8, "
                        f"e.g. iconv -f latin1 -t utf-8") from None


def recipe_summary(path: Path) -> str:
    """A recipe's description: its first paragraph of leading comments (without the `# @package` header),
    joined into one line."""
    try:
        text = read_recipe(path)
    except RlhfError:
        return "(not UTF-8: save it as UTF-8 to use it)"
    words = []
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("#"):
            break
        body = s.lstrip("#")
        s = body.strip()
        if s.startswith("@package"):
            continue
        if not s or body.startswith("  "):  # a blank comment line or an indented block (commands) ends it
            if words:
                break
            continue
        words.append(s)
    return " ".join(words)


def _package_header(text: str) -> str | None:
    """The `# @package X` line of a config file's leading comments, as Hydra reads it for files."""
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            return None
        m = re.match(r"#\s*@package\s+(\S+)", s)
        if m:
            return m.group(1)
    return None


def _store_user_recipe(recipe: Recipe) -> str:
    """Put a user recipe into Hydra's ConfigStore and return its option (`user/NAME`). A recipe sets keys of
    every group, so one without a `# @package` header is taken as `_global_`, like the shipped ones."""
    from hydra.core.config_store import ConfigStore

    text = read_recipe(recipe.path)
    try:
        node = OmegaConf.create(text)
    except Exception as e:  # noqa: BLE001 - yaml and OmegaConf errors alike
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RlhfError(f"recipe {recipe.path} is not valid YAML ({reason}); fix the file") from None
    if not isinstance(node, DictConfig):
        raise RlhfError(f"recipe {recipe.path} is not a mapping of keys; start it from "
                        "`rlhf recipes copy tiny NEW`")
    ConfigStore.instance().store(group="recipes/" + USER_OPTION.rstrip("/"), name=recipe.name, node=node,
                                 package=_package_header(text) or "_global_", provider="rlhf user recipes")
    return USER_OPTION + recipe.name


def default_recipe() -> str:
    """The recipe conf/config.yaml selects when the command line names none."""
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").get("defaults", []):
        if isinstance(entry, DictConfig) and "recipes" in entry:
            return str(entry["recipes"])
    return "tiny"


def recipe_option(name: str, recipes: dict[str, Recipe] | None = None) -> str:
    """`recipes=...` option for recipe NAME: the shipped file's name, or a user recipe stored for Hydra."""
    recipes = find_recipes() if recipes is None else recipes
    recipe = recipes.get(name)
    if recipe is None:
        where = ", ".join(str(d) for d in recipe_dirs())
        raise RlhfError(f"unknown recipe '{name}': choose one of {', '.join(recipes)} (`rlhf recipes` lists "
                        f"them; searched {where})")
    return name if recipe.shipped else _store_user_recipe(recipe)


RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def recipe_copy_text(text: str, source: str, name: str, origin: str) -> str:
    """A recipe file's text made into recipe `name`: the `recipe:` key renamed, and a header that says where
    it came from and how to run it above the source's own notes (kept, they explain its choices)."""
    lines = text.splitlines()
    head = []
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        head.append(lines.pop(0))
    package = [ln for ln in head if re.match(r"#\s*@package\s", ln.strip())] or ["# @package _global_"]
    notes = [ln for ln in head if ln not in package]
    while notes and not notes[-1].strip():
        notes.pop()
    if name == source:
        intro = (f"# {name}: your copy of recipe {source} ({origin}), used instead of it where this folder "
                 "is searched first")
    else:
        intro = f"# {name}: a copy of recipe {source} ({origin}), to edit"
    header = [
        *package,
        intro,
        f"#   rlhf sft recipe={name}          # then reward, ppo and eval with the same recipe={name}",
        f"#   rlhf recipes show {name}        # the composed config: any key in it can be set below",
        f"# Outputs go to runs/{name} (run_dir: runs/${{recipe}}).",
    ]
    if notes:
        header += ["#", f"# Notes of {source}:", *notes]
    body = "\n".join(lines)
    body, n = re.subn(r"(?m)^recipe:.*$", f"recipe: {name}", body)
    if not n:
        body = body.rstrip("\n") + f"\n\nrecipe: {name}"
    return "\n".join(header) + "\n" + body.rstrip("\n") + "\n"


def copy_recipe(name: str, dest: str | None = None) -> Path:
    """Write recipe NAME as a file to edit and return its path. DEST: a new recipe name (written to
    ./recipes/DEST.yaml, the first folder searched) or a path ending in .yaml; default ./recipes/NAME.yaml,
    which then replaces the shipped NAME. An existing file is never overwritten."""
    recipes = find_recipes()
    if name not in recipes:
        recipe_option(name, recipes)  # the unknown-recipe error
    source = recipes[name]
    if dest is None or not dest.endswith(".yaml"):
        new = name if dest is None else dest
        target = Path("recipes") / f"{new}.yaml"
    else:
        target = Path(dest).expanduser()
        new = target.stem
    if not RECIPE_NAME.fullmatch(new):
        raise RlhfError(f"'{new}' cannot be a recipe name: use letters, digits, '.', '_' and '-' "
                        "(e.g. my-tiny)")
    _check_copy_target(target, name)
    origin = "shipped with rlhf" if source.shipped else str(source.path)
    text = recipe_copy_text(read_recipe(source.path), name, new, origin)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: never through a symlink (one made since the check included), never over a file
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        raise RlhfError(f"{target} exists (or is a link); choose another name or delete it") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return target


def _check_copy_target(target: Path, name: str) -> None:
    """A recipe copy is written only where it is the user's: not into the folder rlhf ships its recipes in (run
    from rlhf's own checkout, ./recipes is that folder), not through a symlink, not over a file."""
    if target.is_symlink():
        raise RlhfError(f"{target} is a symlink (to {os.readlink(target)}); a recipe copy is not written "
                        "through one: delete the link or choose another name")
    if target.parent.resolve() == RECIPES_DIR.resolve():
        raise RlhfError(f"{target.parent.resolve()} is the folder of rlhf's shipped recipes; write your copy "
                        f"outside it: rlhf recipes copy {name} ~/rlhf-recipes/NEW.yaml, then add that folder to "
                        f"${RECIPES_ENV} (or run from another directory, where ./recipes is yours)")
    if target.exists():
        raise RlhfError(f"{target} exists; choose another name (rlhf recipes copy {name} NEW_NAME) or "
                        "delete it")


def searchpath_override() -> str:
    # recipes/ lives beside conf/ (a top-level folder users edit), so their common root joins Hydra's search
    # path and `recipes` becomes a config group of whole-chain presets.
    return f"hydra.searchpath=[file://{CONFIG_ROOT}]"


def quote(value: str) -> str:
    """`value` as a quoted Hydra override value. Inside Hydra's quoted strings a backslash is literal unless it
    is part of a run of backslashes before a quote (or before the closing quote): only those runs are doubled,
    and quotes escaped."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"




def _free_text(override: str, command: str) -> str:
    """Quote free text that Hydra's override lexer rejects unquoted (non-ASCII, spaces, punctuation):
    `rlhf chat prompt="你好, world?"` is `chat.prompt='你好, world?'`."""
    key, sep, value = override.partition("=")
    quoted = value[:1] in ("'", '"')
    if command == "chat" and key in ("prompt", "system_prompt") and sep:
        return f"chat.{key}=" + (value if quoted else quote(value))
    if not sep or quoted:
        return override
    # special-token spellings such as <|endoftext|> are never Hydra syntax
    if key in ("chat.prompt", "chat.system_prompt", "data.system_prompt") or not value.isascii() \
            or any(c in value for c in "<|>"):
        return f"{key}={quote(value)}"
    return override


def translate_overrides(command: str, overrides: list[str]) -> list[str]:
    """User overrides -> Hydra overrides: `recipe=NAME` selects NAME.yaml from the recipe search path
    (recipe_dirs); free text is quoted. Keys that the config groups do not have are refused here, before Hydra
    (see rlhf_cli.schema)."""
    schema.check_override_keys([_free_text(o, command) for o in overrides], command)  # chat's prompt= as chat.prompt
    out = [searchpath_override(), f"command={command}"]
    recipes = find_recipes()
    chosen = False
    for o in overrides:
        o = _free_text(o, command)
        if o.startswith("eval.policies.") and "=" in o:  # a mapping of the user's: a new name is added (++)
            o = "++" + o
        if o.startswith("recipe="):
            # a multirun may sweep recipes: recipe=tiny,my-tiny
            names = o.split("=", 1)[1].split(",")
            o = "recipes=" + ",".join(recipe_option(n.strip(), recipes) for n in names)
            chosen = True
        elif o.startswith("recipes="):
            # the group itself, as processes started by `rlhf_cli.launch` get it: user options stored again
            for option in o.split("=", 1)[1].split(","):
                if option.strip().startswith(USER_OPTION):
                    recipe_option(option.strip()[len(USER_OPTION):], recipes)
            chosen = True
        out.append(o)
    if not chosen:
        default = default_recipe()
        if default in recipes and not recipes[default].shipped:
            out.insert(2, f"recipes={recipe_option(default, recipes)}")  # ./recipes/tiny.yaml replaces tiny
    return out


def compose(command: str, overrides: list[str] | None = None, validate: bool = True) -> DictConfig:
    """Compose the config as the CLI would, without Hydra's run directory or logging (tests, notebooks), and
    check it against the schema as the CLI does (`validate=False`: a test of a later check)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

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


def ppo_sizes(p, world_size: int = 1) -> PPOSizes:
    """Derive and validate the PPO batch sizes of `p` (the `ppo` group: its typed view, rlhf_cli.settings, or the
    DictConfig); every failure names the keys to change. Episodes beyond the
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


def require_dir(path: str | Path, what: str, made_by: str, marker: str | None = None, or_else: str = "") -> Path:
    """A stage input that an earlier command writes; the error names that command (and `or_else`, another way
    out)."""
    p = Path(path)
    if not p.is_dir() or (marker is not None and not (p / marker).exists()):
        raise RlhfError(f"{what} not found at {p}: run `{made_by}` first, or point the config at one"
                        + (f", or {or_else}" if or_else else ""))
    return p
