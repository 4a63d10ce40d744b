"""Model cards (rlhf_cli.cards): every published model directory says what it is, in a README.md with the base
model's name, the stages and their settings, the data and row counts, held-out figures, a stock transformers /
peft loading snippet that works, and the version; and no file of it names the training machine's directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from clitools import EVAL_ROWS

from rlhf_cli import __version__, cards


def front_matter(card: Path) -> dict:
    text = card.read_text(encoding="utf-8")
    assert text.startswith("---\n")
    return yaml.safe_load(text[4: text.index("\n---\n", 4)])


def files_naming(directory: Path, needle: str) -> list[str]:
    """Files of a published directory (its training logs and resume checkpoints aside) holding `needle`."""
    return [str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file()
            and not set(f.relative_to(directory).parts) & set(cards.NOT_PUBLISHED)
            and needle.encode() in f.read_bytes()]


def snippet(card: Path) -> str:
    return re.search(r"```python\n(.*?)```", card.read_text(encoding="utf-8"), re.S).group(1)


# ------------------------------------------------------------------------------------------- by hand
def test_portable_paths_inside_the_run_become_relative_and_others_a_name(tmp_path):
    run = tmp_path / "runs/x"
    (run / "sft").mkdir(parents=True)
    out = run / "ppo"
    (out / "value").mkdir(parents=True)
    (out / "checkpoints").mkdir()
    (out / "metrics.json").write_text(json.dumps({"policy_dir": str(run / "sft"), "reward": ["model", "a:b"],
                                                  "elsewhere": str(tmp_path / "models/qwen"), "n": 3, "slash": "/"}))
    (out / "value" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(run / "sft")}))
    kept = json.dumps({"policy_dir": str(run / "sft")})
    (out / "checkpoints" / "metrics.json").write_text(kept)  # resume state: left as written
    cards.make_portable(out, run)
    assert json.loads((out / "metrics.json").read_text()) == {"policy_dir": "../sft", "reward": ["model", "a:b"],
                                                              "elsewhere": "qwen", "n": 3, "slash": "/"}
    assert json.loads((out / "value" / "adapter_config.json").read_text()) == {"base_model_name_or_path": "../../sft"}
    assert (out / "checkpoints" / "metrics.json").read_text() == kept
    assert cards.name_of(str(tmp_path / "data/math.jsonl")) == "math.jsonl"
    assert cards.name_of("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B" and cards.name_of(None) is None
    # built in a hidden sibling, published under its own name
    assert [cards.final_name(Path(n)) for n in (".ppo.partial", ".sft.tmp-123", "merged")] == ["ppo", "sft", "merged"]


# ------------------------------------------------------------------------------------------- the CLI
DIRS = {"sft": "sft", "reward": "reward", "ppo": "ppo", "best": "ppo/best", "export": "ppo/merged",
        "dpo": "dpo", "exported": "export"}
CHAINS = {"sft": ["sft"], "reward": ["sft", "reward"], "ppo": ["sft", "ppo"], "best": ["sft", "best"],
          "export": ["sft", "ppo", "export"], "dpo": ["sft", "dpo"], "exported": ["sft", "ppo", "export"]}


def check_card(run: Path, name: str) -> None:
    """The card of DIRS[name]: base model, version, the chain of stages, SFT's data and figures, no absolute
    path of the run anywhere in the directory."""
    d = run / DIRS[name]
    meta = front_matter(d / "README.md")
    rec = meta["rlhf"]
    assert rec["base_model"] == "tiny" and rec["version"] == __version__ and "base_model" not in meta  # no hub id
    assert [s["stage"] for s in rec["stages"]] == CHAINS[name], name
    sft = rec["stages"][0]
    assert sft["data"] == {"train_file": "math_train.jsonl", "eval_file": "math_test.jsonl", "train_rows": 4214,
                           "eval_rows": 64}, name  # the right sums and the near misses (sft_on_rejected), of the
    # 32 held-out rows the run keeps (EVAL_ROWS)
    assert sft["settings"]["max_steps"] == 10 and "eval_loss_end" in sft["eval"], name
    text = (d / "README.md").read_text()
    assert text.split("\n---\n", 1)[1].lstrip().startswith(f"# {Path(DIRS[name]).name}: ")
    assert f"rlhf {__version__}" in text and "`tiny`" in text and "math_train.jsonl" in text, name
    assert files_naming(d, str(run.parent.parent)) == [], name  # no absolute path of the run
    assert meta["library_name"] == ("peft" if name in ("ppo", "best", "dpo") else "transformers"), name


@pytest.mark.slow
def test_every_published_model_has_a_card_that_loads_and_no_absolute_path(run_cli, tmp_path, monkeypatch):
    """sft, reward, ppo (eval_every + keep_best: best/; merge: merged/), dpo and export on tiny-math, short; each
    directory's card, and its snippet run as written."""
    from transformers import AutoModelForSequenceClassification

    common = ["recipe=tiny-math", "device.threads=1", EVAL_ROWS]
    for args in (["sft", "sft.max_steps=10", "sft.eval_steps=10"], ["reward", "reward.max_steps=4"],
                 ["ppo", "ppo.total_episodes=64", "ppo.eval_every=1", "ppo.keep_best=eval/pass_at_1",
                  "ppo.merge=true", "eval.num_prompts=8"],
                 ["dpo", "dpo.max_steps=2"], ["export", "export.output_dir=runs/tiny-math/export"]):
        rc, _, err = run_cli(*args, *common)
        assert rc == 0, (args, err[-3000:])
    run = tmp_path / "runs/tiny-math"
    for name in DIRS:
        check_card(run, name)
    ppo = run / "ppo"
    st = front_matter(ppo / "README.md")["rlhf"]["stages"][-1]
    assert st["settings"]["advantage"] == "grpo" and st["settings"]["samples_per_prompt"] == 8
    assert st["settings"]["reward"] == ["rlhf_cli.demo.arithmetic:exact_match_reward"]
    assert st["data"]["train_prompts"] == 2107 and st["data"]["eval_prompts"] == 8
    assert "eval/pass_at_1" in st["eval"] and "eval/truncation_rate" in st["eval"]
    assert front_matter(ppo / "best" / "README.md")["rlhf"]["stages"][-1]["eval"]["metric"] == "eval/pass_at_1"
    assert json.loads((ppo / "adapter_config.json").read_text())["base_model_name_or_path"] == "../sft"
    # the card's snippet, run as written with `here` pointing at the directory: stock transformers / peft load it
    for d in (ppo, ppo / "best", run / "dpo", run / "sft", run / "export"):
        code = snippet(d / "README.md").replace(f'"path/to/{d.name}"', repr(str(d)))
        scope: dict = {}
        exec(code, scope)  # noqa: S102 - the card's own code
        assert scope["model"] is not None and scope["tokenizer"].pad_token_id is not None
    assert "AutoModelForSequenceClassification" in snippet(run / "reward" / "README.md")
    AutoModelForSequenceClassification.from_pretrained(run / "reward")
    # rlhf itself follows the relative base from another working directory
    import torch

    from rlhf_cli.models import load_policy

    monkeypatch.chdir(tmp_path.parent)
    load_policy(ppo / "best", torch.float32)
