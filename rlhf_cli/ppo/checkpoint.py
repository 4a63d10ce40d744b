"""PPO checkpoints: symmetric, atomic `save` / `load` of what trains, the counters and the RNG state. Nothing is
pickled: tensors go to safetensors files, everything else to JSON, so loading a checkpoint never runs code.

    checkpoint-N/
        adapter_model.safetensors + adapter_config.json   the policy's LoRA adapter (or model.safetensors: full)
        value/                                            the value model (its LoRA adapter + head, or all of it;
                                                          absent in critic-free runs)
        tokenizer files
        trainer_state.json                                counters, scheduler, KL controller, metrics, RNG (python)
        trainer_state.safetensors                         optimizer tensors, torch RNG states
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from rlhf_cli.errors import RlhfError

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"


def save_model(model, path: Path) -> None:
    """The adapter (embeddings are never trained, so a LoRA on a tied output layer saves only its A and B), or
    the full model."""
    if hasattr(model, "peft_config"):
        model.save_pretrained(str(path), save_embedding_layers=False)
    else:
        model.save_pretrained(str(path))


def load_model_weights(model, path: Path) -> None:
    """Inverse of `save_model` into an already built model (adapter or full weights)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, _read_tensors(path / "adapter_model.safetensors", load_file))
    else:
        model.load_state_dict(_read_tensors(path / "model.safetensors", load_file), strict=False)


# ------------------------------------------------------------------------------------------------ RNG
def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part, tensor part) of this process's RNG state."""
    version, internal, gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    return {"python": [version, list(internal), gauss]}, tensors


def set_rng_state(js: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = js["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


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


# ------------------------------------------------------------------------------------------- save / load
def save(path: Path, policy, value_model, tok, state: dict, optimizer_state: dict,
         rng: list[tuple[dict, dict[str, torch.Tensor]]]) -> None:
    """Write checkpoint `path` atomically: the trainable weights, tokenizer, optimizer state, JSON-able `state`
    (counters, scheduler, KL controller, metrics) and the RNG state of every process (`rng`, one per rank)."""
    from safetensors.torch import save_file

    from rlhf_cli.io import atomic_dir

    opt_js, opt_t = split_optimizer_state(optimizer_state)
    tensors = {f"optimizer/{k}": v for k, v in opt_t.items()}
    for rank, (_js, rt) in enumerate(rng):
        tensors.update({f"rng/{rank}/{k}": v.cpu().contiguous() for k, v in rt.items()})
    with atomic_dir(path, every_rank=False) as tmp:  # the main process alone writes checkpoints
        save_model(policy, tmp)
        tok.save_pretrained(str(tmp))
        if value_model is not None:  # critic-free runs (grpo, rloo, reinforce_pp) have none
            save_model(value_model, tmp / "value")
        save_file(tensors, str(tmp / STATE_TENSORS))
        doc = {**state, "optimizer": opt_js, "rng": [js for js, _ in rng]}
        (tmp / STATE_JSON).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def load(path: Path, policy, value_model, rank: int) -> dict:
    """Read checkpoint `path` into `policy` and `value_model` (weights) and return its state: the JSON fields
    plus "optimizer" (a state dict for `optimizer.load_state_dict`) and "rng" (this rank's, for
    `set_rng_state`). A missing or unreadable file is an error naming it."""
    from safetensors.torch import load_file

    jfile = path / STATE_JSON
    try:
        doc = json.loads(jfile.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RlhfError(f"checkpoint file {jfile} is missing or unreadable ({type(e).__name__}); delete "
                        f"{path} to resume from an earlier checkpoint, or drop ppo.resume=true") from e
    tensors = _read_tensors(path / STATE_TENSORS, load_file)
    load_model_weights(policy, path)
    if value_model is not None:
        load_model_weights(value_model, path / "value")
    opt = {k[len("optimizer/"):]: v for k, v in tensors.items() if k.startswith("optimizer/")}
    ranks = doc["rng"]
    r = rank if rank < len(ranks) else 0
    rng_t = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"rng/{r}/")}
    doc["optimizer"] = join_optimizer_state(doc["optimizer"], opt)
    doc["rng"] = (ranks[r], rng_t)
    return doc


def _read_tensors(file: Path, load_file) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 - missing, truncated or foreign: one line naming the file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise RlhfError(f"checkpoint file {file} is missing or unreadable ({first}); delete {file.parent} to "
                        "resume from an earlier checkpoint, or drop ppo.resume=true") from e


def work_dir(out: Path, resume: bool) -> Path:
    """The hidden sibling `.<name>.partial` a run is built in (and published from when it succeeds).
    resume=True continues it from its latest checkpoint; a finished run is not resumed, and nothing changes."""
    import shutil

    from rlhf_cli.io import check_output_dir

    work = out.parent / f".{out.name}.partial"
    if resume:
        if latest(work / "checkpoints") is not None:
            return work
        if (out / "metrics.json").exists():
            done = json.loads((out / "metrics.json").read_text(encoding="utf-8")).get("total_episodes")
            raise RlhfError(f"ppo.resume=true: {out} is a finished run ({done} episodes) and nothing was "
                            "interrupted; drop ppo.resume=true to train a new run (it replaces this one only when "
                            "it succeeds)")
        raise RlhfError(f"ppo.resume=true but there is no interrupted run to resume at {work}; drop resume=true")
    check_output_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def latest(directory: Path) -> Path | None:
    """The checkpoint with the highest update number under `directory` (checkpoint-N), or None."""
    ckpts = [c for c in directory.glob("checkpoint-*") if c.name.split("-", 1)[1].isdigit()]
    return max(ckpts, key=lambda c: int(c.name.split("-", 1)[1])) if ckpts else None
