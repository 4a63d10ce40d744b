"""One save-and-resume vocabulary for every training stage (sft, reward, dpo through transformers' checkpoints,
ppo through rlhf_cli.ppo.checkpoint): where an unfinished run lives (`partial_dir`), its latest complete
checkpoint, the record of what shapes a run (stored with the checkpoints, compared on resume), the one line that
names a difference, `<stage>.resume` / `<stage>.fresh` on the partial directory, and the hint printed when a run
is stopped. The tensor state of a checkpoint (weights, optimizer, RNG, checksums) is each system's own:
rlhf_cli.stages._checkpoints and rlhf_cli.ppo.checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlhf_cli import stage_table
from rlhf_cli.errors import RlhfError

log = logging.getLogger("rlhf")

RUN_FILE = "run.json"  # in a trainer stage's partial directory: the run's owner, its shape, the eval before it
# keys of `<stage>.*` that do not change what a run computes: where it writes, how often it logs, evaluates or
# saves, and the resume switches themselves
NOT_SHAPING = ("resume", "fresh", "output_dir", "save_steps", "save_total_limit", "logging_steps", "eval_steps",
               "per_device_eval_batch_size")
NOT_SHAPING_ELSEWHERE = ("model.cache_dir", "model.offline", "model.hub", "model.adapter_base_check")
UNSET = "(unset)"


MANIFEST = "checksums.json"  # a checkpoint's sha256 of its files, written once all of them are


def partial_dir(output_dir) -> Path:
    """`.<name>.partial` beside a stage's output: the checkpoints, TensorBoard events and run record of a run that
    has not finished. io.atomic_dir's `.tmp-<pid>` (the output being assembled) goes with its process; this one
    stays for `<stage>.resume=true`, and goes once the output is published."""
    out = Path(output_dir)
    return out.parent / f".{out.name}.partial"


def _step(path: Path) -> int | None:
    tail = path.name.split("-", 1)[1] if "-" in path.name else ""
    return int(tail) if tail.isdigit() else None


def latest_checkpoint(directory: Path) -> Path | None:
    """The highest transformers `checkpoint-N` under `directory` that was written to the end, or None. The trainer
    writes trainer_state.json last, so a checkpoint cut off by a kill (no readable state, or another step's) is
    passed over; rlhf writes its MANIFEST after that, so one whose state is there but unreadable was complete and
    is damaged since: it is taken, and named when it is checked."""
    found = []
    for path in directory.glob("checkpoint-*") if directory.is_dir() else ():
        step, state_file = _step(path), path / "trainer_state.json"
        if step is None:
            continue
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            if state_file.is_file() and (path / MANIFEST).is_file():
                found.append((step, path))
            continue
        if isinstance(state, dict) and state.get("global_step") == step:
            found.append((step, path))
    return max(found)[1] if found else None


def latest(directory: Path) -> Path | None:
    """The PPO checkpoint with the highest update number under `directory` (checkpoint-N: written whole, then
    renamed into place), or None."""
    ckpts = [c for c in directory.glob("checkpoint-*") if _step(c) is not None and c.is_dir()] \
        if directory.is_dir() else []
    return max(ckpts, key=_step) if ckpts else None


# ------------------------------------------------------------------------------------------ the run's shape
def flat(node, prefix: str, into: dict) -> dict:
    """A nested config container as {"a.b.c": value}."""
    if isinstance(node, dict):
        for key, value in node.items():
            flat(value, f"{prefix}.{key}" if prefix else str(key), into)
    else:
        into[prefix] = node
    return into


def run_config(cfg, stage: str) -> dict:
    """The keys that shape a `stage` run, flat ({"sft.learning_rate": 0.001, "data.train_path": ...}): stored
    with its checkpoints, compared on resume. Left out: where things are written, how often they are logged,
    evaluated or saved, and where the model is found."""
    out: dict = {}
    for group in (stage, "data", "model"):
        flat(OmegaConf.to_container(cfg[group], resolve=True), group, out)
    device = OmegaConf.to_container(cfg.device, resolve=True)
    for key in ("mixed_precision", "num_processes", "num_machines"):
        out[f"device.{key}"] = device.get(key)
    out["seed"] = cfg.seed
    skip = {f"{stage}.{k}" for k in NOT_SHAPING} | set(NOT_SHAPING_ELSEWHERE)
    return {**{k: v for k, v in out.items() if k not in skip}, **data_identity(cfg.data)}


def run_shape(cfg, stage: str) -> dict:
    """What a sft / reward / dpo run's checkpoints record and a resume compares: `run_config` and the identities
    of the model directories it starts from (the tiny base left out: it is built from the seed and the data)."""
    return {**run_config(cfg, stage), **model_identities(cfg, stage, tiny_base=False)}


def settings_digest(shape: dict) -> str:
    """sha256 of a `run_shape`: kept in a finished output's metrics.json (`settings_sha256`), so a later command
    can tell that the output was made with the settings it has now (`finished_as_configured`)."""
    import hashlib

    text = json.dumps(shape, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def finished_as_configured(cfg, stage: str) -> Path | None:
    """`<stage>.output_dir` when it holds a finished `stage` output made with the settings of `cfg`, else None
    (none there, another kind, an older output without the digest, or other settings)."""
    from rlhf_cli.io import output_kind, read_json

    out = Path(str(cfg[stage].output_dir))
    if output_kind(out) != stage:
        return None
    try:
        metrics = read_json(out / "metrics.json")
    except (OSError, ValueError):
        return None
    digest = metrics.get("settings_sha256") if isinstance(metrics, dict) else None
    return out if digest is not None and digest == settings_digest(run_shape(cfg, stage)) else None


def data_identity(data_cfg) -> dict:
    """{"data.train_path sha256": ..., "data.eval_path sha256": ...} of the local data files: a file rewritten in
    place is a changed run, not only a renamed one (a hub dataset is named by its path alone)."""
    out = {}
    for key in ("train_path", "eval_path"):
        path = data_cfg.get(key)
        if path and Path(str(path)).expanduser().is_file():
            out[f"data.{key} sha256"] = file_sha256(Path(str(path)).expanduser())
    return out


def ppo_record(cfg) -> dict:
    """What shapes a PPO run besides its trainer's own record (`PPOTrainer.run_config`): the seed, the data keys
    and the data files' content, the model keys other than where the model is found, and the resume-independent
    `ppo.*` keys that are no PPOConfig field (the value model's start)."""
    rec = run_config(cfg, "ppo")
    paths = ("ppo.policy_dir", "ppo.reward_dir", "ppo.value_init", "model.name_or_path", "model.tiny.dir")
    not_shaping = ("ppo.reward_timeout_s", "ppo.reward_retries", "ppo.reward_max_abs", "ppo.merge",
                   "ppo.rollout_forward_batch_size", "ppo.activation_checkpointing", "ppo.save_every",
                   "ppo.save_total_limit", "ppo.sample_every", "ppo.eval_every", "ppo.keep_best", "ppo.first_update_kl_tolerance")
    return {k: v for k, v in rec.items() if k not in paths + not_shaping}


def model_identities(cfg, stage: str, tiny_base: bool = True) -> dict:
    """{"<key> identity": ...} of the model directories a `stage` run starts from (`rlhf_cli.identity`): its
    policy / reference / reward / init directories, and the base model where it is a local directory.
    `tiny_base=False` leaves out the tiny base, which a stage may build only after its record is written (it is
    made from the seed and the data, which the record holds)."""
    from rlhf_cli.identity import identity
    from rlhf_cli.tiny import is_tiny_spec

    tiny = is_tiny_spec(str(cfg.model.name_or_path))
    keys = [f"{stage}.{k}" for k in ("policy_dir", "reward_dir", "value_init", "init_from") if k in cfg[stage]]
    if tiny_base or not tiny:
        keys.append("model.tiny.dir" if tiny else "model.name_or_path")
    out = {}
    for key in keys:
        value = identity(OmegaConf.select(cfg, key))
        if value is not None:
            out[f"{key} identity"] = value
    return out


def file_sha256(file: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(file, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def show(value) -> str:
    """A value as a difference line shows it: text as it is, anything else as JSON (null, lists)."""
    return value if isinstance(value, str) else json.dumps(value)


def changed_keys(saved: dict, here: dict, last: tuple[str, ...] = ()) -> list[str]:
    """The keys whose value differs between two run records (a key only one of them has counts as changed), those
    the user set for this run first (`user_keys`: on the command line, or through the recipe named there), keys
    in `last` (what follows from others, such as whether the value model is a LoRA) last."""
    changed = [k for k in sorted(set(saved) | set(here)) if saved.get(k, UNSET) != here.get(k, UNSET)]
    mine = user_keys()
    return sorted(changed, key=lambda k: (k not in mine, k in last))


def also(changed: list[str], saved: dict, here: dict, n: int = 3) -> str:
    """" (also changed: a 1 -> 2, b x -> y, ...)" for the keys after the first, with both values."""
    if len(changed) < 2:
        return ""
    rest = [f"{k} {show(saved.get(k, UNSET))} -> {show(here.get(k, UNSET))}" for k in changed[1:]]
    return f" (also changed: {', '.join(rest[:n])}{', ...' if len(rest) > n else ''})"


def user_keys() -> set[str]:
    """The config keys this command's overrides set: `key=value` on the command line, and every key the recipe
    chosen there (`recipe=NAME`) sets. Empty outside the CLI (a config composed in a test)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    except Exception:  # noqa: BLE001 - no Hydra run: nothing is the user's in particular
        return set()
    keys = set()
    for o in task:
        key, _, value = o.lstrip("+~").partition("=")
        if key == "recipes":
            keys |= _recipe_keys(value)
        keys.add(key)
    return keys


def _recipe_keys(option: str) -> set[str]:
    """The flat keys a recipe file sets (`recipes=` option: a shipped name, or user/NAME), or none if unreadable."""
    import yaml

    from rlhf_cli.config import find_recipes

    name = option.split("/", 1)[1] if option.startswith("user/") else option
    recipe = find_recipes().get(name)
    try:
        doc = yaml.safe_load(recipe.path.read_text(encoding="utf-8")) if recipe is not None else None
    except (OSError, ValueError, yaml.YAMLError):
        return set()
    return set(flat(doc, "", {})) if isinstance(doc, dict) else set()


# ------------------------------------------------------------------------------------- the partial directory
def check_switches(stage: str, resume, fresh) -> None:
    if resume and fresh:
        raise RlhfError(f"{stage}.resume=true continues the interrupted run and {stage}.fresh=true deletes it; "
                        "give one of them")


def refuse_interrupted(stage: str, work: Path, found: Path | None, fresh: bool) -> None:
    """A fresh run into `work`: an interrupted run there (one with checkpoint `found`) is refused unless
    `<stage>.fresh=true`, which deletes it, with a warning: interrupted work is never deleted silently."""
    if found is not None and not fresh:
        raise RlhfError(f"{work} holds an interrupted run ({found.name}); continue it with {stage}.resume=true, "
                        f"or start over with {stage}.fresh=true")


def start_over(stage: str, work: Path, found: Path | None) -> None:
    """Empty `work` for a new run (what `refuse_interrupted` let through)."""
    if found is not None:
        log.warning("%s.fresh=true: deleting the interrupted run in %s (up to %s) and starting over", stage, work,
                    found.name)
    shutil.rmtree(work, ignore_errors=True)  # a run killed before its first checkpoint, or fresh=true
    work.mkdir(parents=True)


def finished_refusal(stage: str, out: Path, detail: str = "") -> RlhfError:
    return RlhfError(f"{stage}.resume=true: {out} is a finished run{detail} and nothing was interrupted; drop "
                     f"{stage}.resume=true to train a new run (it replaces this one only when it succeeds)")


def claim(out: Path, stage: str, resume: bool, fresh: bool = False, inputs=()) -> Path:
    """The partial directory a PPO run is built in (and published from when it succeeds), claimed for this run:
    the run lock of `out` (run_lock.claim_output) covers it until `publish`, so a second run into `out` is refused
    at once, naming this one. `inputs`: the directories the run reads (never its output).

    resume=True continues the partial run from its latest checkpoint; a finished run is not resumed. Without it
    an interrupted run is refused unless fresh=True (`refuse_interrupted`). A refusal changes nothing."""
    from rlhf_cli.io import check_output_dir
    from rlhf_cli.run_lock import claim_output, release_output

    check_switches(stage, resume, fresh)
    work = partial_dir(out)
    check_output_dir(out, stage, inputs)
    claim_output(out, stage)
    try:
        ckpt = latest(work / "checkpoints")
        if resume:
            if ckpt is not None:
                return work
            if (out / "metrics.json").exists():
                done = json.loads((out / "metrics.json").read_text(encoding="utf-8")).get("total_episodes")
                raise finished_refusal(stage, out, f" ({done} episodes)")
            raise RlhfError(f"{stage}.resume=true but there is no interrupted run to resume at {work}; drop "
                            "resume=true")
        refuse_interrupted(stage, work, ckpt, fresh)
        start_over(stage, work, ckpt)
    except BaseException:
        release_output(out)
        raise
    return work


# ------------------------------------------------------------------------------------------------- hints
def resume_hint(cfg) -> str:
    """What continues an interrupted `cfg.command`, for the line printed when it is stopped:
    "sft.resume=true continues from checkpoint-40", "no checkpoint yet ...", or that finished outputs are
    intact (stages without checkpoints)."""
    from omegaconf import OmegaConf

    command = str(cfg.command)
    spec = stage_table.stage(command)
    kind = spec.resume if spec is not None else None
    if kind is None:
        return "completed outputs are intact"
    work = partial_dir(cfg[command].output_dir)
    ckpt = latest_checkpoint(work) if kind == "trainer" else latest(work / "checkpoints")
    if ckpt is None:
        return f"no checkpoint yet ({spec.save_key}={OmegaConf.select(cfg, spec.save_key)}); completed outputs are " \
               "intact"
    return f"{command}.resume=true continues from {ckpt.name}"


def main(argv: list[str]) -> int:
    """`python -m rlhf_cli.resume finished STAGE [key=value ...]` (make chain-dpo): exit status 0, with a line
    saying so, when STAGE's output is finished with these settings, else 1 (and nothing printed: the stage runs,
    and reports a bad override itself)."""
    from rlhf_cli.config import compose

    if len(argv) < 2 or argv[0] != "finished":
        print("usage: python -m rlhf_cli.resume finished STAGE [key=value ...]", file=sys.stderr)
        return 2
    stage = argv[1]
    try:
        out = finished_as_configured(compose(stage, argv[2:]), stage)
    except Exception:  # noqa: BLE001 - any doubt: the stage runs and says what is wrong
        return 1
    if out is None:
        return 1
    print(f"{stage}: {out} is finished with these settings; kept (rlhf {stage} trains it again)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
