"""The product end to end: the real `rlhf` CLI runs sft -> reward -> ppo -> eval -> chat on the tiny recipe
(embedded model, shipped demo data, one thread), then PPO's bad inputs and resume against that chain."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import EVAL_ROWS, rlhf

RLHF = Path(sys.executable).with_name("rlhf")
pytestmark = pytest.mark.slow

# Short but real: enough steps for the SFT loss to fall and the reward model to separate the demo pairs.
QUICK = ["device.threads=1", "sft.max_steps=120", "sft.eval_steps=60", "reward.max_steps=80",
         "reward.eval_steps=40", "ppo.total_episodes=96", "ppo.num_mini_batches=1", "ppo.save_every=1",
         "eval.num_prompts=32", "data.max_eval_rows=64"]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def fails(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A one-line error on stderr (no traceback) that mentions every needle."""
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err, err[-2000:]
    line = [ln for ln in err.splitlines() if ": error:" in ln]
    assert line, err[-2000:]
    for n in needles:
        assert n in line[-1], line[-1]
    return line[-1]


def scalars(tb_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("chain")
    for stage in ("sft", "reward", "ppo", "eval"):
        ok(rlhf(cwd, stage, *QUICK))
    return cwd


def test_sft_loss_falls(chain):
    m = json.loads((chain / "runs/tiny/sft/metrics.json").read_text())
    assert m["eval_loss_end"] < m["eval_loss_start"] - 1.0, m
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(chain / "runs/tiny/sft")
    tok = AutoTokenizer.from_pretrained(chain / "runs/tiny/sft")
    assert tok.pad_token_id != tok.eos_token_id


def test_reward_model_separates_held_out_pairs(chain):
    m = json.loads((chain / "runs/tiny/reward/metrics.json").read_text())
    assert m["eval_accuracy"] >= 0.95, m
    stats = json.loads((chain / "runs/tiny/reward/score_stats.json").read_text())
    assert stats["std"] > 0 and stats["n"] > 0


def test_ppo_first_update_kl_is_zero_and_outputs_load(chain):
    out = chain / "runs/tiny/ppo"
    kl = scalars(out / "tensorboard", "objective/kl")
    assert len(kl) == 3 and abs(kl[0]) < 1e-3, kl  # LoRA's B starts at 0: policy == reference
    m = json.loads((out / "metrics.json").read_text())
    assert m["total_episodes"] == 96 and m["updates"] == 3
    # ppo.save_total_limit=2 (the default): the newest two of the three saved
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"checkpoint-{i}" for i in (2, 3)]
    from peft import AutoPeftModelForCausalLM

    with contextlib.chdir(out):  # the base is recorded relative to the adapter (../sft): no machine path
        AutoPeftModelForCausalLM.from_pretrained(".")
    assert (out / "value" / "config.json").exists()
    assert not (out.parent / ".ppo.partial").exists()


def test_eval_report(chain):
    r = json.loads((chain / "runs/tiny/eval/report.json").read_text())
    for name in ("sft", "ppo"):
        row = r["policies"][name]
        for key in ("rm_score_mean", "kl_to_ref_mean", "response_length_mean", "eos_rate", "empty_rate",
                    "ground_truth_rate"):
            assert row[key] is not None, (name, key)
    assert abs(r["policies"]["sft"]["kl_to_ref_mean"]) < 1e-3  # the SFT policy is the reference
    assert 0.0 <= r["win_rate"]["ppo_vs_sft"] <= 1.0
    assert (chain / "runs/tiny/eval/report.md").exists()
    assert (chain / "runs/tiny/eval/training_curves.png").stat().st_size > 10_000
    rows = [json.loads(ln) for ln in (chain / "runs/tiny/eval/responses.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * r["num_prompts"]
    ppo_rows = [x for x in rows if x["policy"] == "ppo"]
    gt = sum(x["ground_truth"] for x in ppo_rows) / len(ppo_rows)
    assert abs(gt - r["policies"]["ppo"]["ground_truth_rate"]) < 1e-9


def test_readme_eval_of_sft_ppo_and_dpo(chain):
    """The README's "DPO or PPO" commands on this chain, as written plus a few steps, a few prompts and another
    output directory (the chain's own report stays for the other tests): one report with the three policies."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## DPO or PPO\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1).splitlines() if ln.strip()]
    assert [ln.split()[:2] for ln in lines] == [["rlhf", "dpo"], ["rlhf", "eval"]], lines
    out = chain / "runs/tiny/eval-three"
    short = {"dpo": ["dpo.max_steps=4", "dpo.eval_steps=100", "dpo.logging_steps=2", "data.max_rows=64", EVAL_ROWS],
             "eval": ["eval.num_prompts=8", f"eval.output_dir={out}"]}
    for ln in lines:
        args = shlex.split(ln, comments=True)[1:]
        ok(rlhf(chain, *args, "device.threads=1", *short[args[0]]))
    r = json.loads((out / "report.json").read_text())
    assert list(r["policies"]) == ["sft", "ppo", "dpo"] and r["num_prompts"] == 8
    assert all(r["policies"][n]["ground_truth_rate"] is not None for n in r["policies"])
    assert {"ppo_vs_sft", "dpo_vs_sft", "ppo_vs_dpo"} <= set(r["win_rate"])
    assert r["plot"] == "training_curves.png" and r["dpo_plots"] == {"dpo": "dpo_training_curves.png"}
    assert (out / "dpo_training_curves.png").stat().st_size > 10_000
    assert "| metric | sft | ppo | dpo |" in (out / "report.md").read_text()


def test_eval_without_a_reward_model(chain):
    # a run rewarded by functions alone has no reward model to score with: eval reports everything else
    out = chain / "runs/tiny/eval-no-rm"
    proc = ok(rlhf(chain, "eval", "device.threads=1", "eval.reward_dir=null", f"eval.output_dir={out}",
                   "eval.num_prompts=16"))
    r = json.loads((out / "report.json").read_text())
    assert r["reward_dir"] is None and r["win_rate"] == {} and sorted(r["policies"]) == ["ppo", "sft"]
    for row in r["policies"].values():
        assert row["rm_score_mean"] is None and row["ground_truth_rate"] is not None
        assert "rm_gt_disagreement" not in row
    assert abs(r["policies"]["sft"]["kl_to_ref_mean"]) < 1e-3 and "no RM" in proc.stdout
    assert "RM" not in (out / "report.md").read_text().split("## Samples")[1]


def test_value_model_starts_in_normalised_score_units(chain):
    """With normalised scores the value head copied from the RM is divided by the RM's score std, so the first
    values are in the units of the returns."""
    import torch

    from rlhf_cli.config import compose
    from rlhf_cli.models import load_tokenizer
    from rlhf_cli.ppo.build import build_ppo_models
    from rlhf_cli.ppo.core import position_ids_from

    cfg = compose("ppo", ["recipe=tiny", f"run_dir={chain / 'runs/tiny'}", "device.threads=1"])
    tok = load_tokenizer(cfg.ppo.policy_dir, cfg.model)
    m = build_ppo_models(cfg, tok, "cpu", torch.float32)
    value, reward, stats = m.value, m.reward, m.score_stats
    enc = tok(["Thanks for asking! Rinse the rice."], return_tensors="pt")
    pos = position_ids_from(enc["attention_mask"])
    with torch.no_grad():
        v = value(enc["input_ids"], enc["attention_mask"], pos)
        r = reward(enc["input_ids"], enc["attention_mask"], pos)
    torch.testing.assert_close(v, r / stats["std"], rtol=1e-5, atol=1e-6)


def test_chat_answers_once_and_from_stdin(chain):
    one = ok(rlhf(chain, "chat", "prompt=你好", "chat.max_new_tokens=16"))
    assert one.stdout.strip()
    proc = rlhf(chain, "chat", "chat.model_dir=runs/tiny/ppo", "chat.max_new_tokens=8",
                stdin="hello\nhow are you?\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len([ln for ln in proc.stdout.splitlines() if ln.strip()]) == 2


def test_export_writes_a_plain_merged_model(chain):
    ok(rlhf(chain, "export", "device.threads=1"))
    from transformers import AutoModelForCausalLM

    merged = chain / "runs/tiny/ppo/merged"
    assert not (merged / "adapter_config.json").exists()
    m = AutoModelForCausalLM.from_pretrained(merged)
    # the tiny recipe's LoRA covers the tied lm_head: the merge changes the output layer, not the embeddings
    sft = AutoModelForCausalLM.from_pretrained(chain / "runs/tiny/sft")
    assert torch_equal(m.get_input_embeddings().weight, sft.get_input_embeddings().weight)
    assert not torch_equal(m.get_output_embeddings().weight, sft.get_output_embeddings().weight)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_resume_ends_where_an_uninterrupted_run_ends(chain):
    """An interrupted run (checkpoints 1-2 written, then a crash) resumes at update 2 and ends with the same
    adapter, value model and metrics as the uninterrupted run."""
    out, partial = chain / "runs/tiny/ppo", chain / "runs/tiny/.ppo.partial"
    shutil.copytree(out, partial)
    shutil.rmtree(partial / "checkpoints" / "checkpoint-3")
    for f in ("adapter_model.safetensors", "metrics.json"):
        (partial / f).unlink()
    before = json.loads((out / "metrics.json").read_text())
    adapter = (out / "adapter_model.safetensors").read_bytes()
    value = (out / "value" / "model.safetensors").read_bytes()
    proc = ok(rlhf(chain, "ppo", *QUICK, "ppo.resume=true", "ppo.output_dir=runs/tiny/ppo"))
    assert "resumed from" in proc.stderr + proc.stdout and "update 2" in proc.stderr + proc.stdout
    after = json.loads((out / "metrics.json").read_text())
    def timing(k: str) -> bool:
        return k in ("eps", "train_seconds") or k.startswith("time/")

    assert {k: v for k, v in after.items() if not timing(k)} == {k: v for k, v in before.items() if not timing(k)}
    assert (out / "adapter_model.safetensors").read_bytes() == adapter
    assert (out / "value" / "model.safetensors").read_bytes() == value
    assert len(scalars(out / "tensorboard", "objective/kl")) >= 3


def test_resume_of_a_finished_run_changes_nothing(chain):
    out = chain / "runs/tiny/ppo"
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fails(rlhf(chain, "ppo", *QUICK, "ppo.resume=true"), "finished run", "drop ppo.resume=true")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("args, needles", [
    (["ppo.reward_dir=runs/tiny/nothing"], ["reward model", "rlhf reward"]),
    (["ppo.rollout_forward_batch_size=5"], ["rollout_forward_batch_size"]),
    (["ppo.total_episodes=8"], ["total_episodes"]),
    (["ppo.response_length=0"], ["response_length"]),
    (["model.pad_token=<|im_end|>"], ["pad", "EOS"]),
    (["ppo.learning_rate=1e6", "ppo.total_episodes=192"], ["non-finite", "lower ppo.learning_rate"]),
])
def test_ppo_bad_inputs(chain, args, needles):
    out = chain / "runs/tiny/ppo"
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fails(rlhf(chain, "ppo", "device.threads=1", "ppo.output_dir=runs/tiny/ppo", *args), *needles)
    # earlier output byte-identical
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


OTHER_TEMPLATE = ("{%- for m in messages -%}{{- '[' + m['role'] + '] ' + m['content'] + '\\n' -}}{%- endfor -%}"
                  "{%- if add_generation_prompt -%}{{- '[assistant] ' -}}{%- endif -%}")


def test_a_reward_model_with_its_own_tokenizer_teaches_the_policy(chain):
    """A reward model trained on another base (another vocabulary and chat template) rewards PPO: the policy's
    held-out ground-truth rate rises, scored by that model in `rlhf eval` too."""
    from transformers import AutoTokenizer

    from rlhf_cli.tiny import build_tiny_base

    other = build_tiny_base(chain / "other_base", vocab_size=1000, seed=1)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.chat_template = OTHER_TEMPLATE
    tok.save_pretrained(str(other))
    rm = "runs/tiny/reward_other"
    # 240 steps (QUICK's 80 leave a model that PPO at a weak KL games on some CPUs' kernels: ground truth fell
    # 0.77 -> 0.72 at kl 16 on an AVX-512 Xeon), and the tiny recipe's own kl_coef
    ok(rlhf(chain, "reward", *QUICK, "reward.max_steps=240", f"model.name_or_path={other}", "reward.init_from=base",
            f"reward.output_dir={rm}"))
    # a value model cannot start from it: it reads the policy's tokens
    fails(rlhf(chain, "ppo", "device.threads=1", f"ppo.reward_dir={rm}", "ppo.output_dir=runs/tiny/ppo_other"),
          "ppo.value_init=reward", "tokenizer of its own", "ppo.value_init=sft")
    ok(rlhf(chain, "ppo", "device.threads=1", f"ppo.reward_dir={rm}", "ppo.value_init=sft",
            "ppo.output_dir=runs/tiny/ppo_other", "ppo.total_episodes=2048", "ppo.eval_every=0"))
    ok(rlhf(chain, "eval", "device.threads=1", f"eval.reward_dir={rm}", "eval.policies.ppo=runs/tiny/ppo_other",
            "eval.output_dir=runs/tiny/eval_other", "eval.num_prompts=64"))
    rows = json.loads((chain / "runs/tiny/eval_other/report.json").read_text())["policies"]
    assert rows["ppo"]["ground_truth_rate"] >= rows["sft"]["ground_truth_rate"] + 0.05, rows
    assert rows["ppo"]["rm_score_mean"] > rows["sft"]["rm_score_mean"] + 1.0, rows
