"""Model cards: the README.md of every directory rlhf publishes a model in (sft, reward, ppo, dpo, a PPO run's
best/, an export), and the paths in that directory made portable.

`write_card(out, cfg, kind)` runs on the finished directory just before the stage publishes it:

    README.md     what the model is: its base model (a name, never a path), the stages that made it with their
                  key settings, the data (file names, row counts), the stage's own held-out figures, how to load
                  it with stock transformers / peft, and the rlhf version. YAML front matter for the hubs
                  (library_name, tags, base_model where that is a hub id) carries the stage record under `rlhf`,
                  which the card of a later stage reads from its input directory to tell the whole chain.
    portable      absolute paths in the directory's JSON records (metrics.json, best.json, adapter_config.json's
                  `base_model_name_or_path`, value/) become paths relative to the file when they lie in the run
                  directory, else the directory's name: rlhf resolves a relative adapter base against the adapter
                  (`rlhf_cli.models`), and nothing names the training machine's directories. TensorBoard logs and
                  checkpoints/ (resume state) are left as written; `rlhf push` leaves them out.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rlhf_cli import __version__

CARD = "README.md"
NOT_PUBLISHED = ("checkpoints", "tensorboard")  # resume state and training logs: left as written, never pushed
RECORDS = ("metrics.json", "best.json", "score_stats.json", "adapter_config.json")  # rlhf's and peft's records
WHAT = {"sft": "a causal language model fine-tuned on demonstrations (SFT)",
        "reward": "a reward model: a sequence classifier with one score per text (Bradley-Terry on preference pairs)",
        "ppo": "a policy trained with reinforcement learning from a reward (rlhf ppo)",
        "dpo": "a policy trained with direct preference optimisation (rlhf dpo)",
        "best": "the update of a PPO run with the best held-out evaluation (rlhf ppo, ppo.keep_best)",
        "export": "a PPO policy with its LoRA adapter merged into the base: a plain causal language model"}
SETTINGS = {"sft": ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "max_length",
                    "lora.enabled"),
            "reward": ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "max_length"),
            "ppo": ("advantage", "reward", "total_episodes", "samples_per_prompt", "learning_rate", "kl_coef",
                    "response_length", "temperature", "lora.enabled", "lora.r", "lora.alpha"),
            "dpo": ("loss_type", "beta", "learning_rate", "num_train_epochs", "max_steps", "lora.enabled")}
ROWS = ("train_rows", "eval_rows", "train_pairs", "eval_pairs", "train_prompts", "eval_prompts")
FIGURES = ("eval_loss_start", "eval_loss_end", "eval_accuracy", "eval_margin", "metric", "value")


def name_of(spec) -> str | None:
    """A model or data source as a card names it: a local path by its directory or file name, a hub id or
    `tiny` as it is."""
    if spec in (None, ""):
        return None
    s = str(spec)
    return Path(s).name if (os.path.isabs(s) or Path(s).expanduser().exists()) else s


def _get(node, dotted: str):
    for part in dotted.split("."):
        node = node.get(part) if hasattr(node, "get") else None
    return list(node) if hasattr(node, "__iter__") and not isinstance(node, str) else node


def _input_dir(cfg, kind: str):
    """The directory the stage started from (its card tells the earlier stages), or None."""
    return {"reward": cfg.reward.init_from, "ppo": cfg.ppo.policy_dir, "dpo": cfg.dpo.policy_dir,
            "best": cfg.ppo.policy_dir, "export": cfg.ppo.output_dir}.get(kind)


def read_record(directory) -> dict | None:
    """The `rlhf` record of a card's front matter (None: no card, or not one of rlhf's)."""
    import yaml

    card = Path(directory) / CARD if directory else None
    if card is None or not card.is_file():
        return None
    text = card.read_text(encoding="utf-8")
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        return None
    try:
        meta = yaml.safe_load(text[4: text.index("\n---\n", 4)]) or {}
    except yaml.YAMLError:
        return None
    return meta.get("rlhf") if isinstance(meta, dict) else None


def stage_record(out: Path, cfg, kind: str, rows: dict | None = None) -> dict:
    """This stage's entry: its settings, data (file names, row counts) and held-out figures."""
    metrics = _read(out / "metrics.json") or {}
    stage = "ppo" if kind == "best" else kind
    settings = {k: _get(cfg[stage], k) for k in SETTINGS.get(stage, ())}
    if kind == "export":
        settings = {"merged_from": name_of(cfg.ppo.output_dir)}
    data = {"train_file": name_of(cfg.data.train_path), "eval_file": name_of(cfg.data.eval_path)}
    data.update({k: v for k, v in {**metrics, **(rows or {})}.items() if k in ROWS and v is not None})
    figures = {k: v for k, v in {**metrics, **(_read(out / "best.json") or {})}.items()
               if (k in FIGURES or k.startswith("eval/")) and isinstance(v, (int, float, str))}
    return {"stage": kind, "settings": settings, "data": data if kind != "export" else {}, "eval": figures}


def write_card(out, cfg, kind: str, rows: dict | None = None, after=None) -> None:
    """README.md into the finished directory `out` of stage `kind`, after its paths are made portable. `rows`:
    row counts the stage's metrics.json lacks; `after`: the directory whose card tells the earlier stages (default:
    the stage's input, e.g. ppo.policy_dir)."""
    out = Path(out)
    make_portable(out, Path(str(cfg.run_dir)))
    earlier = read_record(after if after is not None else _input_dir(cfg, kind)) or {}
    base = earlier.get("base_model") or name_of(cfg.model.name_or_path)
    record = {"base_model": base, "version": __version__,
              "stages": [*earlier.get("stages", []), stage_record(out, cfg, kind, rows)]}
    (out / CARD).write_text(render(out, kind, record), encoding="utf-8")


def render(out: Path, kind: str, record: dict) -> str:
    import yaml

    adapter = (out / "adapter_config.json").is_file()
    meta = {"library_name": "peft" if adapter else "transformers", "tags": ["rlhf", kind], "rlhf": record}
    if "/" in str(record["base_model"]):
        meta["base_model"] = record["base_model"]  # a hub id: the hubs link the card to it
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {final_name(out)}: {kind}", "", f"This is {WHAT[kind]}, made with rlhf {record['version']}.", "",
             f"- base model: `{record['base_model']}`" + (" (rlhf's embedded random-init Qwen3 with a tokenizer "
                                                          "trained on its demo data)" if record["base_model"] == "tiny"
                                                          else ""), "", "## Stages", ""]
    for i, st in enumerate(record["stages"], 1):
        lines.append(f"{i}. **{st['stage']}**: " + ", ".join(f"{k}={_show(v)}" for k, v in st["settings"].items()))
        if any(v is not None for v in st["data"].values()):
            lines.append("   - data: " + ", ".join(f"{k} {_show(v)}" for k, v in st["data"].items() if v is not None))
        if st["eval"]:
            lines.append("   - held-out: " + ", ".join(f"{k} {_show(v)}" for k, v in st["eval"].items()))
    lines += ["", "## Load it", "", "```python", *load_snippet(out, adapter), "```", ""]
    if (out / "value").is_dir():
        lines += ["`value/` holds the value model the policy trained with (PPO with GAE).", ""]
    return "\n".join(lines)


def final_name(out: Path) -> str:
    """The name `out` is published under: a stage builds it in `.<name>.partial` or `.<name>.tmp-<run>`."""
    m = re.match(r"^\.(.+?)\.(partial|tmp-.+)$", out.name)
    return m.group(1) if m else out.name


def load_snippet(out: Path, adapter: bool) -> list[str]:
    here = f'here = "path/to/{final_name(out)}"  # this directory'
    if adapter:
        base = (_read(out / "adapter_config.json") or {}).get("base_model_name_or_path") or "BASE"
        where, note = ((f'os.path.join(here, "{base}")', "  # the base, recorded relative to this directory")
                       if not _is_hub_id(base) else (f'"{base}"', ""))
        return ["import os", "", "from peft import PeftModel", "from transformers import AutoModelForCausalLM, "
                "AutoTokenizer", "", here, f"base = AutoModelForCausalLM.from_pretrained({where}){note}",
                "model = PeftModel.from_pretrained(base, here)", "tokenizer = AutoTokenizer.from_pretrained(here)"]
    arch = " ".join((_read(out / "config.json") or {}).get("architectures") or [])
    cls = "AutoModelForSequenceClassification" if "SequenceClassification" in arch else "AutoModelForCausalLM"
    return [f"from transformers import {cls}, AutoTokenizer", "", here,
            f"model = {cls}.from_pretrained(here)", "tokenizer = AutoTokenizer.from_pretrained(here)"]


def make_portable(out: Path, run_dir: Path) -> None:
    """Every absolute path in the JSON records of `out` (checkpoints/ and tensorboard/ aside): relative to the file's
    directory when it lies in `run_dir` (so the run can move as one), else the directory's name."""
    root = run_dir.expanduser().resolve()
    for f in sorted(out.rglob("*.json")):
        if f.name not in RECORDS or any(p in NOT_PUBLISHED for p in f.relative_to(out).parts):
            continue
        data = _read(f)
        fixed = _portable(data, f.parent, root)
        if fixed != data:
            f.write_text(json.dumps(fixed, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _portable(x, here: Path, root: Path):
    if isinstance(x, dict):
        return {k: _portable(v, here, root) for k, v in x.items()}
    if isinstance(x, list):
        return [_portable(v, here, root) for v in x]
    if isinstance(x, str) and os.path.isabs(x) and len(Path(x).parts) > 2:
        p = Path(x).resolve()
        return os.path.relpath(p, here.resolve()) if p.is_relative_to(root) else p.name
    return x


def _is_hub_id(s: str) -> bool:
    return not s.startswith((".", "/")) and s.count("/") == 1 and not Path(s).exists()


def _read(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _show(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)
