"""`rlhf dpo`: the settings trl gets, the memory plan, and the real command on the tiny recipe (a few steps each,
one thread): a LoRA run published as an adapter on the SFT model that `rlhf eval` reports beside SFT, a full
fine-tune published as a plain model, and a run killed after a checkpoint that resumes to the uninterrupted
run's adapter."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from clitools import EVAL_ROWS, rlhf
from test_resume_sft_reward import error_line, ok, start, wait_for_checkpoint

from rlhf_cli import memory as M
from rlhf_cli.choices import DPO_LOSSES
from rlhf_cli.config import compose
from rlhf_cli.errors import RlhfError

STEPS = 8
SHORT = ["recipe=tiny-dpo", "device.threads=1", "sft.max_steps=4", "sft.eval_steps=100", f"dpo.max_steps={STEPS}",
         "dpo.eval_steps=100", "dpo.logging_steps=2", "dpo.per_device_train_batch_size=4", "eval.num_prompts=8",
         "eval.batch_size=8", "data.max_rows=64", EVAL_ROWS]
LORA = ["dpo.lora.enabled=true", "dpo.learning_rate=1e-3"]  # the recipe trains every weight


# ------------------------------------------------------------------------------------------------ settings
def test_loss_settings_map_rpo_alpha_to_trls_sft_term():
    from rlhf_cli.stages.dpo import loss_settings

    d = compose("dpo").dpo
    assert loss_settings(d) == {"loss_type": ["sigmoid"], "loss_weights": [1.0], "beta": 0.1,
                                "label_smoothing": 0.0}
    rpo = compose("dpo", ["dpo.loss_type=ipo", "dpo.rpo_alpha=0.5", "dpo.beta=0.3"]).dpo
    got = loss_settings(rpo)
    assert got["loss_type"] == ["ipo", "sft"] and got["loss_weights"] == [1.0, 0.5] and got["beta"] == 0.3


def test_every_loss_type_offered_is_one_trl_knows():
    from trl import DPOConfig

    help_text = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert all(f"'{name}'" in help_text for name in DPO_LOSSES)
    assert "sft" not in DPO_LOSSES and "aot_unpaired" not in DPO_LOSSES  # rpo_alpha; unpaired data


@pytest.mark.parametrize("overrides, needle", [
    (["dpo.lora.target_modules=[q_proj,lm_head]"], "dpo.lora.target_modules names lm_head"),
    (["dpo.loss_type=exo_pair"], "dpo.loss_type=exo_pair needs dpo.label_smoothing > 0"),
    (["dpo.policy_dir=/nonexistent/sft"], "SFT model (dpo.policy_dir) not found at /nonexistent/sft: run `rlhf sft"),
])
def test_settings_refused_before_anything_loads(overrides, needle):
    from rlhf_cli.stages.dpo import check_settings

    with pytest.raises(RlhfError) as e:
        check_settings(compose("dpo", overrides))
    assert needle in str(e.value)


def test_memory_plan_lora_against_full_fine_tuning():
    qwen = M.KNOWN_ARCHS["Qwen/Qwen3-0.6B"]
    lora_cfg = compose("doctor", ["recipe=qwen3-0.6b"])
    full_cfg = compose("doctor", ["recipe=qwen3-0.6b", "dpo.lora.enabled=false"])
    lora, full = M.plan_stage(lora_cfg, "dpo", qwen), M.plan_stage(full_cfg, "dpo", qwen)
    items = {i.name: i for i in lora.items}
    assert items["reference"].bytes == 0  # the base with the adapter disabled: no second copy
    assert items["policy base"].bytes == M.causal_lm_params(qwen) * 2  # frozen, bf16 (model.dtype)
    full_items = {i.name: i for i in full.items}
    assert full_items["reference weights"].bytes == M.causal_lm_params(qwen) * 2
    assert full_items["policy weights"].bytes == M.causal_lm_params(qwen) * 4  # trainable: fp32
    assert full.peak > lora.peak + 6 * M.GiB  # fp32 weights, gradients and AdamW states
    assert any("dpo.max_length=512" in n for n in lora.notes)


# ------------------------------------------------------------------------------------------ the real command
@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """sft -> dpo (LoRA) -> eval on the tiny-dpo recipe, a few steps each."""
    cwd = tmp_path_factory.mktemp("dpo")
    ok(rlhf(cwd, "sft", *SHORT))
    dpo = ok(rlhf(cwd, "dpo", *SHORT, *LORA))
    ev = ok(rlhf(cwd, "eval", *SHORT))
    return cwd, dpo, ev


@pytest.mark.slow
def test_lora_dpo_publishes_an_adapter_that_eval_reports_against_sft(chain):
    from safetensors.torch import load_file

    cwd, dpo, ev = chain
    out = cwd / "runs" / "tiny-dpo" / "dpo"
    assert "dpo: held-out preference accuracy" in dpo.stdout
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    from rlhf_cli.identity import identity

    assert json.loads((out / "adapter_base.json").read_text()) == {"relative": "../sft",  # a moved run loads
                                                                   "identity": identity(out.parent / "sft")}
    assert (out / "tokenizer.json").is_file() and (out / "tensorboard").is_dir()
    assert not (out.parent / ".dpo.partial").exists()  # checkpoints go once the output is published
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == STEPS and m["lora"] is True and m["loss_type"] == "sigmoid"
    assert 0 <= m["eval_accuracy"] <= 1
    lora_b = {k: v for k, v in load_file(str(out / "adapter_model.safetensors")).items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values())  # B starts at zero: every one moved
    assert not any("lm_head" in k for k in lora_b)
    report = json.loads((cwd / "runs" / "tiny-dpo" / "eval" / "report.json").read_text())
    assert sorted(report["policies"]) == ["dpo", "sft"] and report["reward_dir"] is None  # ppo=null: left out
    assert report["policies"]["dpo"]["ground_truth_rate"] is not None
    assert report["policies"]["dpo"]["kl_to_ref_mean"] != 0  # the k1 estimate: a mean of log-ratios, either sign
    assert " dpo: no RM, ground truth" in ev.stdout


@pytest.mark.slow
def test_eval_draws_the_dpo_training_curves(chain):
    """As PPO's training_curves.png: the DPO policy's own TensorBoard events, a PNG beside the report."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf_cli.stages.eval import DPO_CURVES

    cwd = chain[0]
    ev = cwd / "runs" / "tiny-dpo" / "eval"
    report = json.loads((ev / "report.json").read_text())
    assert report["dpo_plots"] == {"dpo": "dpo_training_curves.png"} and "plot" not in report  # no PPO run here
    png = (ev / "dpo_training_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "![dpo training curves](dpo_training_curves.png)" in (ev / "report.md").read_text()
    acc = EventAccumulator(str(cwd / "runs" / "tiny-dpo" / "dpo" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    drawn = [t for t, _ in DPO_CURVES if t in tags]  # trl's names, as the panels expect them
    assert {"train/loss", "train/rewards/accuracies", "train/rewards/margins"} <= set(drawn)
    assert len(acc.Scalars("train/loss")) == STEPS // 2  # dpo.logging_steps=2


def make_chain_dpo(cwd, *args: str) -> str:
    """`make chain-dpo ARGS=...` in `cwd` with the project's .venv, its rlhf commands echoed, not run: what it would
    run, after the real check of a finished SFT output."""
    import subprocess
    import sys

    from rlhf_cli.config import PACKAGE_DIR

    makefile = PACKAGE_DIR.parent / "Makefile"
    if not makefile.is_file():
        pytest.skip("no Makefile: rlhf is installed, not a checkout")
    venv = Path(sys.prefix)  # this interpreter's environment, never (re)installed by the test
    proc = subprocess.run(["make", "-s", "-f", str(makefile), "-o", str(venv / ".installed"), f"VENV={venv}",
                           "RLHF=echo RUN rlhf", "chain-dpo", "ARGS=" + " ".join(args)],
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_make_chain_dpo_keeps_an_sft_output_finished_with_the_same_settings(chain, tmp_path, monkeypatch):
    from rlhf_cli.resume import finished_as_configured, run_shape, settings_digest

    cwd = chain[0]
    sft = cwd / "runs" / "tiny-dpo" / "sft"
    monkeypatch.chdir(cwd)
    cfg = compose("sft", SHORT)
    # the digest the command wrote is the one of the config composed here: same settings, same digest
    assert json.loads((sft / "metrics.json").read_text())["settings_sha256"] == settings_digest(run_shape(cfg, "sft"))
    assert finished_as_configured(cfg, "sft") == Path("runs/tiny-dpo/sft")
    kept = make_chain_dpo(cwd, *SHORT)
    assert "sft: runs/tiny-dpo/sft is finished with these settings; kept" in kept
    assert "RUN rlhf sft" not in kept and "RUN rlhf dpo recipe=tiny-dpo" in kept and "RUN rlhf eval" in kept
    # another setting that shapes SFT (the seed), or no SFT output at all: SFT trains
    assert finished_as_configured(compose("sft", [*SHORT, "seed=7"]), "sft") is None
    assert "RUN rlhf sft recipe=tiny-dpo" in make_chain_dpo(cwd, *SHORT, "seed=7")
    assert "RUN rlhf sft recipe=tiny-dpo" in make_chain_dpo(tmp_path, *SHORT)
    # a bad override: the check stays quiet and `rlhf sft` runs, to report it in its own words
    assert "RUN rlhf sft recipe=tiny-dpo" in make_chain_dpo(cwd, *SHORT, "sft.no_such_key=1")


@pytest.mark.slow
def test_full_fine_tuning_publishes_a_plain_model(chain, tmp_path):
    from safetensors.torch import load_file

    cwd = chain[0]
    out = tmp_path / "dpo_full"
    ok(rlhf(cwd, "dpo", *SHORT, "dpo.max_steps=2", f"dpo.output_dir={out}"))  # the recipe: every weight, RPO
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    m = json.loads((out / "metrics.json").read_text())
    assert m["lora"] is False and m["rpo_alpha"] == 1.0
    sft = load_file(str(cwd / "runs" / "tiny-dpo" / "sft" / "model.safetensors"))
    trained = load_file(str(out / "model.safetensors"))
    assert any(not (trained[k] == sft[k]).all() for k in sft)


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_uninterrupted_adapter(chain, tmp_path):
    import torch
    from safetensors.torch import load_file

    cwd = chain[0]
    whole = cwd / "runs" / "tiny-dpo" / "dpo"
    out = tmp_path / "dpo"
    args = ["dpo", *SHORT, *LORA, f"dpo.output_dir={out}", "dpo.save_steps=2"]
    proc = start(cwd, *args)
    ckpt = wait_for_checkpoint(proc, tmp_path / ".dpo.partial", STEPS // 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert int(ckpt.name.split("-")[1]) < STEPS and not out.exists()
    again = rlhf(cwd, *args)  # a plain rerun would delete the interrupted work: refused
    assert "holds an interrupted run" in error_line(again) and "dpo.resume=true" in error_line(again)
    resumed = ok(rlhf(cwd, *args, "dpo.resume=true"))
    assert "dpo: resuming from" in resumed.stdout + resumed.stderr
    assert 0 < json.loads((out / "metrics.json").read_text())["resumed_from"] < STEPS
    a, b = (load_file(str(d / "adapter_model.safetensors")) for d in (whole, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.dist
def test_two_cpu_processes_with_a_recipe(chain, tmp_path):
    """device=cpu-ddp starts `rlhf dpo` again in 2 processes, the recipe passed as its group (recipes=tiny-dpo)."""
    out = tmp_path / "dpo_ddp"
    ok(rlhf(chain[0], "dpo", *SHORT, *LORA, "device=cpu-ddp", "device.num_processes=2", "dpo.max_steps=2",
            f"dpo.output_dir={out}"))
    assert ((out / "adapter_model.safetensors").is_file()
            and json.loads((out / "metrics.json").read_text())["steps"] == 2)


def test_the_recipe_group_passes_the_override_check():
    from rlhf_cli import schema

    schema.check_override_keys(["recipes=tiny-dpo", "dpo.beta=0.2"], "dpo")  # what a launched process gets


def test_bad_beta_is_refused_by_the_schema():
    with pytest.raises(RlhfError, match=r"dpo.beta=0 is out of range; use a number > 0"):
        compose("dpo", ["dpo.beta=0"])  # the CLI's rows for dpo are in test_bad_inputs.py
