"""PPO checkpoints: symmetric, atomic `save` / `load` of what trains, the counters and the RNG state. Nothing is
pickled: tensors go to safetensors files, everything else to JSON, so loading a checkpoint never runs code.

    checkpoint-N/
        adapter_model.safetensors + adapter_config.json   the policy's LoRA adapter (or model.safetensors: full)
        value/                                            the value model (its LoRA adapter + head, or all of it;
                                                          absent in critic-free runs)
        tokenizer files
        trainer_state.json                                counters, scheduler, KL controller, metrics, RNG (python),
                                                          the run's shape ("config": `PPOTrainer.run_config`)
        trainer_state.safetensors                         optimizer tensors, torch RNG states
        checksums.json                                    sha256 of every file above

A checkpoint must match the run that resumes it, or `load` refuses it in one line naming the file and what to do,
before any weight is touched: every file against its checksum, the JSON's fields, the run's shape against the one
it was written with (`ppo.resume=force` continues with the new values), and every tensor file against the keys and
shapes this run's models, optimizer and RNG expect (a foreign adapter never becomes a fresh LoRA published as
trained).
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import torch

from rlhf_cli import devices, resume
from rlhf_cli.errors import RlhfError

log = logging.getLogger("rlhf")

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
MANIFEST = resume.MANIFEST
# the fields of STATE_JSON that `load` reads ("metrics" and "config" are optional: older checkpoints lack them)
STATE_FIELDS = ("update", "episodes", "scheduler", "kl_ctl", "prompts_consumed", "optimizer", "rng")
# run-config keys that fix the shapes of the saved weights: ppo.resume=force cannot continue across them
WEIGHT_SHAPE_KEYS = ("ppo.lora.enabled", "ppo.lora.r", "ppo.lora.target_modules", "ppo.value_lora")
# run-config keys that follow from others (whether the value model is a LoRA follows from ppo.advantage): named
# after the keys the user changed
CONSEQUENCE_KEYS = ("ppo.value_lora", "ppo.lora.enabled")


def save_model(model, path: Path, root: Path | None = None) -> None:
    """The adapter (embeddings are never trained, so a LoRA on a tied output layer saves only its A and B), or
    the full model.

    An adapter records its base twice: peft's absolute `base_model_name_or_path` (plain peft's
    `AutoPeftModelForCausalLM.from_pretrained(dir)` works from anywhere while the run stays in place), and, when
    the base lies inside `root` (the run directory, which moves as one; default: the adapter directory's parent),
    the path relative to the adapter in adapter_base.json, e.g. "../sft", which `rlhf_cli.models.load_policy`
    follows first: a copied or moved run still loads in rlhf. After a move, plain peft needs the base loaded
    first: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)`."""
    if hasattr(model, "peft_config"):
        model.save_pretrained(str(path), save_embedding_layers=False)
        _record_base(Path(path), Path(path).parent if root is None else Path(root))
    else:
        model.save_pretrained(str(path))


def portable_path(target, start: Path, root: Path) -> str:
    """`target` as a run's files record it: relative to `start` when it lies inside `root` (the run directory),
    else absolute; a hub id (no such directory) as it is."""
    t = Path(target).expanduser()
    if not t.is_dir():
        return str(target)
    t = t.resolve()
    return os.path.relpath(t, Path(start).resolve()) if t.is_relative_to(Path(root).resolve()) else str(t)


BASE_FILE = "adapter_base.json"  # beside adapter_config.json: the base relative to the adapter (a run can move)


def _record_base(adapter: Path, root: Path) -> None:
    """adapter_config.json keeps peft's absolute `base_model_name_or_path` (plain peft loads the adapter from any
    working directory while the run stays where it is); `adapter_base.json` adds the base relative to the adapter
    when it lies inside `root`, which rlhf follows first, so a copied or moved run still loads, and the base's
    content identity, which `rlhf_cli.models.load_policy` checks."""
    from rlhf_cli.identity import identity

    conf = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    base = conf.get("base_model_name_or_path")
    record = {}
    if base and Path(base).is_absolute():
        rel = portable_path(base, adapter, root)
        if rel != base:
            record["relative"] = rel
    if identity(base) is not None:  # the base's content (rlhf_cli.identity), checked when the adapter is loaded
        record["identity"] = identity(base)
    if record:
        (adapter / BASE_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")


def weights_file(model, path: Path) -> Path:
    """The tensor file `save_model` writes for `model` into `path`."""
    return path / ("adapter_model.safetensors" if hasattr(model, "peft_config") else "model.safetensors")


def expected_weights(model) -> tuple[dict[str, tuple], dict[str, list[str]]]:
    """What `save_model` writes for `model`: {key: shape}, and for each key of a tensor shared by several keys
    (tied embeddings) the other keys, of which the file holds one."""
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}, {}
    sd = model.state_dict()
    by_storage: dict[tuple, list[str]] = {}
    for k, v in sd.items():
        by_storage.setdefault((v.data_ptr(), tuple(v.shape)), []).append(k)
    aliases = {k: [o for o in keys if o != k] for keys in by_storage.values() if len(keys) > 1 for k in keys}
    return {k: tuple(v.shape) for k, v in sd.items()}, aliases


def read_weights(model, path: Path, ckpt: Path) -> dict[str, torch.Tensor]:
    """The tensors `save_model` wrote for `model` into `path`, checked against `model`: every key present, none
    foreign, every shape this model's; else one error naming the file, the first keys and what to do."""
    from safetensors.torch import load_file

    file = weights_file(model, path)
    tensors = _read_tensors(file, load_file, ckpt)
    expected, aliases = expected_weights(model)
    check_keys(file, {k: tuple(v.shape) for k, v in tensors.items()}, expected, ckpt, aliases,
               "it was written for another model or LoRA shape: resume with the config it was written with")
    return tensors


def set_weights(model, tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Load checked `tensors` (`read_weights`) into `model`; what the loader reports unused is an error too."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        unexpected = set_peft_model_state_dict(model, tensors).unexpected_keys
    else:
        _, aliases = expected_weights(model)
        full = dict(tensors)
        for k, others in aliases.items():  # a tied weight: the file holds it under one of its names
            if k not in full:
                full[k] = next(tensors[o] for o in others if o in tensors)
        unexpected = model.load_state_dict(full, strict=True).unexpected_keys
    if unexpected:
        raise RlhfError(f"checkpoint file {file} holds keys this model does not have ({_few(unexpected)}); resume "
                        "with the config it was written with")


def load_model_weights(model, path: Path) -> None:
    """Inverse of `save_model` into an already built model (adapter or full weights), strictly."""
    set_weights(model, read_weights(model, path, path), weights_file(model, path))


def check_keys(file: Path, got: dict[str, tuple], expected: dict[str, tuple], ckpt: Path,
               aliases: dict[str, list[str]] | None = None, why: str = "") -> None:
    """`got` ({key: shape} read from `file`) must be `expected`: one error naming the first bad keys."""
    aliases = aliases or {}
    missing = [k for k in expected if k not in got and not any(o in got for o in aliases.get(k, ()))]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k} {list(got[k])} vs {list(expected[k])} here" for k in expected
              if k in got and tuple(got[k]) != tuple(expected[k])]
    parts = [f"{what}: {_few(keys)}" for what, keys in
             (("missing", missing), ("not expected", unexpected), ("other shapes", shapes)) if keys]
    if parts:
        raise RlhfError(f"checkpoint file {file} does not match this run ({'; '.join(parts)}); "
                        f"{why + ', or ' if why else ''}delete {ckpt} to resume from an earlier checkpoint")


def _few(keys: list[str], n: int = 3) -> str:
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


# ------------------------------------------------------------------------------------------------ RNG
def rng_state(device="cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part, tensor part) of this process's RNG state: Python's, torch's CPU generator and, on a GPU, the
    generator of this process's GPU only (`cuda`), so that a resume on a machine with fewer GPUs finds it."""
    version, internal, gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state()}
    index = devices.rng_index(device)
    if index is not None:
        tensors["cuda"] = torch.cuda.get_rng_state(index)
    return {"python": [version, list(internal), gauss]}, tensors


def set_rng_state(js: dict, tensors: dict[str, torch.Tensor], device="cpu") -> None:
    """Restore what `rng_state` saved. A GPU state restores into this process's GPU; a checkpoint of the CPU (or
    a GPU state resumed on the CPU) leaves the other generators as the seed set them."""
    version, internal, gauss = js["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(tensors["torch"])
    index = devices.rng_index(device)
    if index is not None and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], index)


def check_rng(js, tensors: dict[str, torch.Tensor], jfile: Path, tfile: Path, ckpt: Path, rank: int) -> None:
    """One rank's RNG state (JSON part, tensor part) must be one `set_rng_state` can restore."""
    try:
        version, internal, gauss = js["python"]
        random.Random().setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError) as e:
        raise RlhfError(f"checkpoint file {jfile}: field 'rng' holds no Python RNG state for process {rank}; delete "
                        f"{ckpt} to resume from an earlier checkpoint") from e
    got = {f"rng/{rank}/{k}": tuple(v.shape) for k, v in tensors.items() if k == "torch"}
    check_keys(tfile, got, {f"rng/{rank}/torch": tuple(torch.get_rng_state().shape)}, ckpt)
    for name in ("torch", "cuda"):
        if name in tensors and tensors[name].dtype != torch.uint8:
            raise RlhfError(f"checkpoint file {tfile}: rng/{rank}/{name} is {tensors[name].dtype}, not a torch RNG "
                            f"state (uint8); delete {ckpt} to resume from an earlier checkpoint")


# ------------------------------------------------------------------------------------------- optimizer
def split_optimizer_state(sd: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """`optimizer.state_dict()` -> (JSON part: param groups and scalar state, tensors by "param/name")."""
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}/{name}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = v
    return {"param_groups": sd["param_groups"], "scalars": scalars}, tensors


def join_optimizer_state(js: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state: dict = {}
    for key, t in tensors.items():
        pid, name = key.split("/", 1)
        state.setdefault(int(pid), {})[name] = t
    for pid, st in js["scalars"].items():
        state.setdefault(int(pid), {}).update(st)
    # JSON has no tuples: hyper-parameters such as AdamW's betas come back as lists
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in js["param_groups"]]
    return {"state": state, "param_groups": groups}


def check_optimizer_state(sd: dict, optimizer, jfile: Path, tfile: Path, ckpt: Path) -> None:
    """A joined state (`join_optimizer_state`) must fit `optimizer`: the same parameter groups of the same sizes,
    a state for every parameter once there is any (none is restarted silently) and for no other, each moment of
    its parameter's shape. A row-sparse parameter (it starts empty and grows: rlhf_cli.accel.sparse_rows)
    checks its own moments when the state is loaded."""
    fix = f"resume with the config it was written with, or delete {ckpt} to resume from an earlier checkpoint"
    saved = [len(g["params"]) for g in sd["param_groups"]]
    here = [len(g["params"]) for g in optimizer.param_groups]
    if saved != here:
        raise RlhfError(f"checkpoint file {jfile}: the optimizer's parameter groups hold {saved} tensors, this "
                        f"run's {here}; {fix}")
    owner = {pid: p for gs, g in zip(sd["param_groups"], optimizer.param_groups)
             for pid, p in zip(gs["params"], g["params"])}
    got = {f"optimizer/{pid}/{name}": tuple(v.shape) for pid, st in sd["state"].items() for name, v in st.items()
           if torch.is_tensor(v) and v.dim() and name != "rows"}  # the moments (steps are scalars)
    moments = sorted({k.rsplit("/", 1)[1] for k in got})
    expected = {}
    for pid, p in owner.items():
        st = sd["state"].get(pid, {})
        sparse = p.numel() == 0 or "rows" in st
        for m in moments:
            key = f"optimizer/{pid}/{m}"
            expected[key] = got.get(key, ()) if sparse else tuple(p.shape)
    check_keys(tfile, got, expected, ckpt, why="resume with the config it was written with")


# ------------------------------------------------------------------------------------------- save / load
def save(path: Path, policy, value_model, tok, state: dict, optimizer_state: dict,
         rng: list[tuple[dict, dict[str, torch.Tensor]]], root: Path | None = None) -> None:
    """Write checkpoint `path` atomically: the trainable weights, tokenizer, optimizer state, JSON-able `state`
    (counters, scheduler, KL controller, metrics, the run's shape as "config") and the RNG state of every process
    (`rng`, one per rank), then the checksums of all of it. `root`: the run directory, inside which adapters
    record their base by a relative path (`save_model`)."""
    from safetensors.torch import save_file

    from rlhf_cli.io import atomic_dir

    opt_js, opt_t = split_optimizer_state(optimizer_state)
    tensors = {f"optimizer/{k}": v for k, v in opt_t.items()}
    for rank, (_js, rt) in enumerate(rng):
        tensors.update({f"rng/{rank}/{k}": v.cpu().contiguous() for k, v in rt.items()})
    with atomic_dir(path, "checkpoint", every_rank=False) as tmp:  # the main process alone writes checkpoints
        save_model(policy, tmp, root)
        tok.save_pretrained(str(tmp))
        if value_model is not None:  # critic-free runs (grpo, rloo, reinforce_pp) have none
            save_model(value_model, tmp / "value", root)
        save_file(tensors, str(tmp / STATE_TENSORS))
        doc = {**state, "optimizer": opt_js, "rng": [js for js, _ in rng]}
        (tmp / STATE_JSON).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        write_checksums(tmp)


def load(path: Path, policy, value_model, rank: int, optimizer=None, run_config: dict | None = None,
         force: bool = False, states: dict[str, dict] | None = None) -> dict:
    """Read checkpoint `path` into `policy` and `value_model` (weights) and return its state: the JSON fields
    plus "optimizer" (a state dict for `optimizer.load_state_dict`), "rng" (this rank's, for `set_rng_state`)
    and "changed" (the run-config keys continued with new values, under `force`).

    Everything is checked before any weight is loaded, each failure one error naming the file: the checksums
    (a checkpoint without them, from an older rlhf, loads with a warning), the JSON's fields, `run_config`
    against the one saved (a changed key is an error naming it, unless `force`: a warning per key; keys that
    shape the weights cannot be forced), the saved `state_dict()`s of `states` (by field: scheduler, KL
    controller) against this run's keys, the RNG state, the optimizer state against `optimizer`, and each weight
    file against its model (`read_weights`)."""
    from safetensors.torch import load_file

    verify_checksums(path)
    jfile, tfile = path / STATE_JSON, path / STATE_TENSORS
    try:
        doc = json.loads(jfile.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RlhfError(f"checkpoint file {jfile} is missing or unreadable ({type(e).__name__}); delete "
                        f"{path} to resume from an earlier checkpoint, or drop ppo.resume=true") from e
    _check_fields(doc, jfile, path)
    doc["changed"] = compare_run_config(doc.get("config"), run_config, path, force) if run_config else []
    for name, here in (states or {}).items():
        check_state_keys(doc[name], here, name, jfile, path)
    tensors = _read_tensors(tfile, load_file)
    ranks = doc["rng"]
    r = rank if rank < len(ranks) else 0
    rng_t = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"rng/{r}/")}
    check_rng(ranks[r], rng_t, jfile, tfile, path, r)
    opt = {k[len("optimizer/"):]: v for k, v in tensors.items() if k.startswith("optimizer/")}
    try:
        doc["optimizer"] = join_optimizer_state(doc["optimizer"], opt)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RlhfError(f"checkpoint file {jfile}: field 'optimizer' is not an optimizer state ({type(e).__name__}: "
                        f"{e}); delete {path} to resume from an earlier checkpoint") from e
    if optimizer is not None:
        check_optimizer_state(doc["optimizer"], optimizer, jfile, tfile, path)
    weights = [(policy, path)] + ([(value_model, path / "value")] if value_model is not None else [])
    read = [(m, read_weights(m, d, path), weights_file(m, d)) for m, d in weights]  # all checked, then loaded
    for m, t, file in read:
        set_weights(m, t, file)
    doc["rng"] = (ranks[r], rng_t)
    return doc


def _check_fields(doc, jfile: Path, ckpt: Path) -> None:
    """The fields `load` and `PPOTrainer.resume` read, present and of the right kind."""
    fix = f"it was written by another version or edited: delete {ckpt} to resume from an earlier checkpoint"
    if not isinstance(doc, dict):
        raise RlhfError(f"checkpoint file {jfile} is not a trainer state (a JSON object); {fix}")
    for name in STATE_FIELDS:
        if name not in doc:
            raise RlhfError(f"checkpoint file {jfile} has no field '{name}'; {fix}")
    kinds = {"optimizer": dict, "rng": list, "prompts_consumed": list, "scheduler": dict, "kl_ctl": dict}
    for name, kind in kinds.items():
        if not isinstance(doc[name], kind) or (kind is list and not doc[name]):
            what = "a non-empty list" if kind is list else "a mapping"
            raise RlhfError(f"checkpoint file {jfile}: field '{name}' is not {what}; {fix}")
    for name in ("param_groups", "scalars"):
        if name not in doc["optimizer"]:
            raise RlhfError(f"checkpoint file {jfile} has no field 'optimizer.{name}'; {fix}")


def check_state_keys(saved: dict, here: dict, name: str, jfile: Path, ckpt: Path) -> None:
    """A saved `state_dict()` (scheduler, KL controller: field `name` of the JSON) holds every key of `here`."""
    missing = [k for k in here if k not in saved]
    if missing:
        raise RlhfError(f"checkpoint file {jfile} has no field '{name}.{missing[0]}'; it was written by another "
                        f"version or edited: delete {ckpt} to resume from an earlier checkpoint")


# ---------------------------------------------------------------------------------------- run config
def compare_run_config(saved: dict | None, here: dict, ckpt: Path, force: bool) -> list[str]:
    """The keys of `here` (the resuming run's shape, `PPOTrainer.run_config`) whose value differs from `saved`
    (the checkpoint's): an error naming the first, its two values and the way out; with `force` a warning per
    key, and the keys are returned (the run continues with the new values). Keys that shape the saved weights
    (WEIGHT_SHAPE_KEYS) are an error even with `force`. A checkpoint without a config (older rlhf) is not
    compared: a warning."""
    if saved is None:
        log.warning("checkpoint %s was written without its run config (an older rlhf): ppo.total_episodes, batch "
                    "sizes, LoRA and learning rates are not compared with this run's", ckpt)
        return []
    norm = json.loads(json.dumps(here))  # as saved: tuples as lists
    both = set(saved) & set(norm)  # a key an older checkpoint lacks is not compared
    changed = resume.changed_keys({k: saved[k] for k in both}, {k: norm[k] for k in both}, last=CONSEQUENCE_KEYS)
    fixed = [k for k in changed if k in WEIGHT_SHAPE_KEYS]
    if fixed:
        f = fixed[0]  # a key that follows from another is named through the one changed (the user's first)
        k = changed[0] if f in CONSEQUENCE_KEYS and changed[0] not in CONSEQUENCE_KEYS else f
        via = f", which changes {f} ({_show(saved[f])} -> {_show(norm[f])})" if f != k else ""
        raise RlhfError(f"ppo.resume: {k} was {_show(saved[k])} when checkpoint {ckpt} was written and is "
                        f"{_show(norm[k])} now{via}; its weights have the saved shape, so it cannot continue with "
                        f"another: set {k}={_show(saved[k])} to resume, or drop ppo.resume to start a new run")
    if changed and not force:
        k = changed[0]
        raise RlhfError(f"ppo.resume: {k} was {_show(saved[k])} when checkpoint {ckpt} was written and is "
                        f"{_show(norm[k])} now{resume.also(changed, saved, norm)}; set {k}={_show(saved[k])} to "
                        "resume the run as it was, or ppo.resume=force to continue it with the new values")
    for k in changed:
        log.warning("ppo.resume=force: %s was %s at %s; continuing with %s", k, _show(saved[k]), ckpt.name,
                    _show(norm[k]))
    return changed


def _show(v) -> str:
    return "null" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else str(v)


# ---------------------------------------------------------------------------------------- checksums
def write_checksums(directory: Path) -> None:
    """MANIFEST in `directory`: the sha256 of every file under it (hidden files, such as the output marker that
    publishing rewrites, aside)."""
    files = {}
    for f in sorted(directory.rglob("*")):
        rel = f.relative_to(directory)
        if f.is_file() and rel.as_posix() != MANIFEST and not any(part.startswith(".") for part in rel.parts):
            files[rel.as_posix()] = resume.file_sha256(f)
    (directory / MANIFEST).write_text(json.dumps({"sha256": files}, indent=1) + "\n", encoding="utf-8")


def verify_checksums(path: Path) -> None:
    """Every file MANIFEST lists, present and unchanged; a checkpoint without MANIFEST loads with a warning."""
    file = path / MANIFEST
    if not file.exists():
        log.warning("checkpoint %s has no %s (written by an older rlhf): its files are not verified", path, MANIFEST)
        return
    fix = "delete it to resume from the previous one"
    try:
        files = json.loads(file.read_text(encoding="utf-8"))["sha256"]
        items = [(str(k), str(v)) for k, v in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RlhfError(f"checkpoint {path} is damaged ({MANIFEST} is unreadable); {fix}") from e
    for rel, digest in items:
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not f.is_file():
            raise RlhfError(f"checkpoint {path} is damaged ({rel} is missing); {fix}")
        if resume.file_sha256(f) != digest:
            raise RlhfError(f"checkpoint {path} is damaged ({rel} checksum mismatch); {fix}")


def _read_tensors(file: Path, load_file, ckpt: Path | None = None) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 - missing, truncated or foreign: one line naming the file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise RlhfError(f"checkpoint file {file} is missing or unreadable ({first}); delete {ckpt or file.parent} "
                        "to resume from an earlier checkpoint, or drop ppo.resume=true") from e


def prune(directory: Path, keep: int | None) -> list[Path]:
    """`ppo.save_total_limit`: remove all but the newest `keep` checkpoints under `directory`, oldest first, and
    return them (None: keep all). Each checkpoint-N there is complete (`save` renames it into place once written),
    so the newest kept is one a resume can use; a removal cut off by a kill leaves only a hidden .removing folder,
    cleared on the next call. best/ is elsewhere and never touched."""
    import shutil

    for left in directory.glob(".checkpoint-*.removing"):
        shutil.rmtree(left, ignore_errors=True)
    if keep is None:
        return []
    numbered = [(int(p.name[len("checkpoint-"):]), p) for p in directory.glob("checkpoint-*")
                if p.is_dir() and p.name[len("checkpoint-"):].isdigit()]
    old = [p for _, p in sorted(numbered)[:-max(1, int(keep))]]
    for p in old:
        trash = p.with_name(f".{p.name}.removing")
        p.rename(trash)  # one step: a resume never finds a half-removed checkpoint-N
        shutil.rmtree(trash, ignore_errors=True)
    return old
