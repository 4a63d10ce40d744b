"""Evaluation during PPO (`ppo.eval_every`, `ppo.keep_best`): the held-out `eval/*` metrics appear at the right
updates in the metrics and in TensorBoard, measured as `rlhf eval` measures them without disturbing the training;
best/ holds the adapter and value model of the update with the best metric; and `rlhf eval`, `chat` and `export`
take best/."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

import pytest
import test_trainer
import torch
from test_trainer import PROMPTS, build, ppo_cfg

from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo import evaluation
from rlhf_cli.ppo.evaluation import Evaluator, keep_best_metric, metric_names
from rlhf_cli.ppo.experience import Sampling
from rlhf_cli.ppo.rewards import GroundTruth
from rlhf_cli.ppo.trainer import PPOTrainer

HELD_OUT = [p.replace("cook rice", "boil pasta") for p in PROMPTS[:6]]


def trainer(base, tok, work, monkeypatch, evaluator, writer=None, **over):
    """The library test trainer (tests/test_trainer.py's `build`) with what the stage adds: an evaluator and a
    TensorBoard writer; 4 updates of 8 episodes, a checkpoint after each, all kept (the tests read them)."""
    monkeypatch.setattr(test_trainer, "PPOTrainer", functools.partial(PPOTrainer, evaluator=evaluator,
                                                                      writer=writer))
    return build(base, tok, ppo_cfg(total_episodes=32, save_every=1, save_total_limit="null", learning_rate=1e-2,
                                    **over), work=work)


def held_out(tok, gt=None) -> Evaluator:
    s = Sampling(max_new_tokens=6, temperature=0.7, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                 stop_ids=(tok.eos_token_id,), forward_batch_size=4, vocab_size=len(tok))
    return Evaluator(HELD_OUT, s, seed=3, ground_truth=gt)


def scalars(tb_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ------------------------------------------------------------------------------------------- the metric
def test_keep_best_reads_a_metric_and_its_direction():
    names = metric_names(reward_model=True, ground_truth=True)
    assert keep_best_metric(None, 0, names) is None
    assert keep_best_metric("eval/ground_truth_rate", 5, names) == ("eval/ground_truth_rate", 1.0)
    assert keep_best_metric("-eval/kl", 5, names) == ("eval/kl", -1.0)
    with pytest.raises(RlhfError, match=r"^ppo.keep_best=eval/kl .* ppo.eval_every=0 never evaluates; set "):
        keep_best_metric("eval/kl", 0, names)
    no_rm = metric_names(reward_model=False, ground_truth=True)
    assert "eval/rm_score" not in no_rm and "eval/rm_gt_disagreement" not in no_rm
    with pytest.raises(RlhfError, match=r"no eval/rm_score; use one of eval/ground_truth_rate, eval/kl"):
        keep_best_metric("eval/rm_score", 5, no_rm)
    assert metric_names(False, False) == ("eval/kl", "eval/length_mean", "eval/eos_rate", "eval/empty_rate",
                                          "eval/truncation_rate")
    assert evaluation.is_better(0.5, None, 1.0) and not evaluation.is_better(float("nan"), None, 1.0)
    assert not evaluation.is_better(0.5, {"value": 0.5}, 1.0)  # a tie keeps the earlier update
    assert evaluation.is_better(0.4, {"value": 0.5}, -1.0)


def test_the_evaluator_measures_as_rlhf_eval_and_leaves_the_training_rng_alone(base, tok, tmp_path, monkeypatch):
    """Before any update the policy is the reference: KL 0. The evaluation is `rlhf eval`'s summary of
    `sample_and_score`, repeats itself (its own seed), and the training's random stream goes on as if it had not
    run."""
    gt = GroundTruth("long", lambda text: len(text) > 3, frozenset())
    ev = held_out(tok, gt)
    t = trainer(base, tok, tmp_path, monkeypatch, ev, eval_every=2)
    rng = torch.get_rng_state()
    m = ev(t)
    assert torch.equal(torch.get_rng_state(), rng)
    assert set(m) == set(metric_names(reward_model=True, ground_truth=True))
    assert abs(m["eval/kl"]) < 1e-4
    s = evaluation.sample_and_score(t.unwrapped, None, t.reward, tok, HELD_OUT, ev.sampling, t.device, 3,
                                    t.autocast)
    s["ground_truth"] = gt(s["texts"])
    row = evaluation.summarise(s)
    assert m["eval/rm_score"] == pytest.approx(row["rm_score_mean"])
    assert m["eval/ground_truth_rate"] == pytest.approx(row["ground_truth_rate"])
    assert m["eval/length_mean"] == pytest.approx(sum(s["length"]) / len(HELD_OUT))
    assert ev(t) == m


def test_eval_metrics_at_the_right_updates_in_metrics_and_tensorboard(base, tok, tmp_path, monkeypatch):
    """eval_every=3 over 4 updates: evaluations after updates 3 and 4 (the last), TensorBoard steps in
    episodes; the training itself is the run without evaluation, number for number."""
    from torch.utils.tensorboard import SummaryWriter

    seen = {}
    writer = SummaryWriter(str(tmp_path / "tb"))
    t = trainer(base, tok, tmp_path / "a", monkeypatch, held_out(tok), writer=writer, eval_every=3)
    t.hooks.on_update = lambda update, m: seen.__setitem__(update, m)
    t.train()
    writer.close()
    assert [u for u, m in seen.items() if "eval/kl" in m] == [3, 4]
    assert all("time/eval_s" in seen[u] for u in (3, 4)) and "time/eval_s" not in seen[2]
    for tag in metric_names(reward_model=True, ground_truth=False):
        assert [step for step, _ in scalars(tmp_path / "tb", tag)] == [24, 32], tag
    assert [v for _, v in scalars(tmp_path / "tb", "eval/kl")] == pytest.approx([seen[3]["eval/kl"],
                                                                                  seen[4]["eval/kl"]])
    assert seen[4]["eval/kl"] != 0.0  # the policy moved away from the reference
    assert not (tmp_path / "a" / "best").exists()  # ppo.keep_best is off

    plain = trainer(base, tok, tmp_path / "b", monkeypatch, None, eval_every=0)
    got = {}
    plain.hooks.on_update = lambda update, m: got.__setitem__(update, m)
    plain.train()
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith(("eval/", "time/", "eps"))}
    assert [drop(m) for m in got.values()] == [drop(m) for m in seen.values()]


class Scripted:
    """An evaluator whose metric per update the test sets: best/ must follow it."""

    def __init__(self, values: dict[int, float]):
        self.values = values

    def __call__(self, trainer) -> dict[str, float]:
        return {"eval/score": self.values[trainer.progress.update], "eval/kl": 0.0}


@pytest.mark.parametrize("keep, values, best", [
    ("eval/score", {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.9}, 2),   # the highest; the tie at 4 keeps the earlier
    ("-eval/score", {1: 0.7, 2: 0.9, 3: 0.1, 4: 0.3}, 3),  # a leading minus: the lowest
])
def test_best_holds_the_adapter_and_value_model_of_the_best_update(base, tok, tmp_path, monkeypatch, keep,
                                                                   values, best):
    work = tmp_path / ".ppo.partial"
    t = trainer(base, tok, work, monkeypatch, Scripted(values), eval_every=1, keep_best=keep)
    t.train()
    kept = json.loads((work / "best" / "best.json").read_text())
    assert (kept["update"], kept["metric"], kept["value"]) == (best, "eval/score", values[best])
    assert kept["higher_is_better"] == (not keep.startswith("-")) and kept["episodes"] == 8 * best
    ckpt = work / "checkpoints" / f"checkpoint-{best}"
    for rel in ("adapter_model.safetensors", "value/model.safetensors"):
        got, want = weights(work / "best" / rel), weights(ckpt / rel)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), rel
    last = weights(work / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors")
    assert any(not torch.equal(last[k], v) for k, v in weights(work / "best" / "adapter_model.safetensors").items())
    # marked as a PPO output (export writes its merged/ inside it), and loads as a policy does
    assert json.loads((work / "best" / ".rlhf-output").read_text())["kind"] == "ppo"
    assert (work / "best" / "tokenizer_config.json").exists() and not list(work.glob(".best.tmp-*"))
    from rlhf_cli.models import load_policy

    load_policy(work / "best", torch.float32)


def test_a_resumed_run_keeps_the_best_so_far(base, tok, tmp_path, monkeypatch):
    """Resuming from checkpoint 2 with best/ at update 2 (0.9): update 4 (0.5) does not replace it."""
    work = tmp_path / ".ppo.partial"
    values = {1: 0.2, 2: 0.9, 3: 0.3, 4: 0.5}
    t = trainer(base, tok, work, monkeypatch, Scripted(values), eval_every=1, keep_best="eval/score")
    t.train()
    before = (work / "best" / "adapter_model.safetensors").read_bytes()
    again = trainer(base, tok, work, monkeypatch, Scripted(values), eval_every=1, keep_best="eval/score")
    again.resume(work / "checkpoints" / "checkpoint-2")
    assert again.best["update"] == 2
    again.train()
    assert json.loads((work / "best" / "best.json").read_text())["update"] == 2
    assert (work / "best" / "adapter_model.safetensors").read_bytes() == before


def test_keep_best_needs_an_evaluation_that_gives_its_metric(base, tok, tmp_path, monkeypatch):
    with pytest.raises(RlhfError, match="ppo.keep_best=eval/score keeps .* ppo.eval_every=0"):
        trainer(base, tok, tmp_path, monkeypatch, Scripted({}), eval_every=0, keep_best="eval/score")
    with pytest.raises(RlhfError, match="ppo.keep_best=eval/score but the trainer was given no evaluator"):
        trainer(base, tok, tmp_path, monkeypatch, None, eval_every=1, keep_best="eval/score")
    t = trainer(base, tok, tmp_path, monkeypatch, Scripted({1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}), eval_every=1,
                keep_best="eval/gt")
    with pytest.raises(RlhfError, match=r"^ppo.keep_best=eval/gt: the evaluation gave no eval/gt \(it gave "
                                        r"eval/score, eval/kl\)"):
        t.train()


# passes on the first held-out prompt alone: 1/5 over 5 responses, not (1/3 + 0/2) / 2 over the two shards
FIRST = GroundTruth("first", lambda text, prompt: prompt == HELD_OUT[0], frozenset({"prompt"}))


def _shard_worker(rank: int, world: int, port: int, base: str, out_dir: str) -> None:
    """One process of a 2-process run: the evaluator over its shard, gathered over gloo."""
    import contextlib
    import types

    import torch.distributed as dist

    from rlhf_cli.models import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tok = load_tokenizer(base)
    t = types.SimpleNamespace(rank=rank, world=world, device=torch.device("cpu"), ref=None, reward=None, tok=tok,
                              unwrapped=load_causal_lm(base, torch.float32).eval(), autocast=contextlib.nullcontext)
    ev = held_out(tok, FIRST)
    ev.prompts = HELD_OUT[:5]  # shards of 3 and 2 prompts
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(ev(t)))
    dist.barrier()  # neither process leaves while the other still has gloo traffic in flight
    dist.destroy_process_group()


@pytest.mark.dist
def test_each_process_evaluates_a_shard_and_all_get_the_exact_means(base, tok, tmp_path):
    """Two processes, shards of 3 and 2 prompts: both get the same metrics, the means over the 5 responses (not
    the mean of the two shards' means), as one process computes them from the same shards."""
    import socket

    import torch.multiprocessing as mp

    from rlhf_cli.models import load_causal_lm

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_shard_worker, args=(2, port, str(base), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]
    assert got[0]["eval/ground_truth_rate"] == pytest.approx(1 / 5)
    ev = held_out(tok, FIRST)
    policy = load_causal_lm(base, torch.float32).eval()
    parts = [evaluation.sample_and_score(policy, None, None, tok, HELD_OUT[:5][r::2], ev.sampling, "cpu", ev.seed,
                                         contextlib.nullcontext) for r in range(2)]
    whole = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    whole["ground_truth"] = ev.ground_truth(whole["texts"], HELD_OUT[:5][0::2] + HELD_OUT[:5][1::2])
    row = evaluation.summarise(whole)
    assert got[0]["eval/length_mean"] == pytest.approx(row["response_length_mean"])
    assert got[0]["eval/kl"] == pytest.approx(row["kl_to_ref_mean"], abs=1e-9)
    assert got[0]["eval/ground_truth_rate"] == pytest.approx(row["ground_truth_rate"])


# ------------------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_rlhf_ppo_keeps_best_and_eval_chat_export_take_it(run_cli, tmp_path):
    """`rlhf ppo` with eval_every and keep_best on the tiny recipe (its base as the SFT policy, the politeness
    rule as the reward), then `rlhf eval +eval.policies.best=<ppo>/best`, `rlhf chat chat.model_dir=<best>`,
    `rlhf export ppo.output_dir=<best>`."""
    from rlhf_cli.tiny import build_tiny_base

    base = build_tiny_base(tmp_path / "runs/tiny/base")
    common = ["device.threads=1", f"ppo.policy_dir={base}", "ppo.response_length=12", "eval.num_prompts=8"]
    rc, out, err = run_cli("ppo", *common, "ppo.reward=[rlhf_cli.demo:polite_reward]", "ppo.total_episodes=96",
                           "ppo.num_mini_batches=1", "ppo.num_ppo_epochs=1", "ppo.eval_every=2",
                           "ppo.keep_best=-eval/kl")
    assert rc == 0, err[-3000:]
    ppo = tmp_path / "runs/tiny/ppo"
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("eval ")] == ["eval 2/3 held-out",
                                                                                     "eval 3/3 held-out"]
    kept = json.loads((ppo / "best" / "best.json").read_text())
    # the base is recorded relative to the run directory: the run can move
    from rlhf_cli.identity import identity

    assert json.loads((ppo / "best" / "adapter_base.json").read_text()) == {"relative": "../../base",
                                                                            "identity": identity(base)}
    assert kept["update"] in (2, 3) and kept["metric"] == "eval/kl"
    metrics = json.loads((ppo / "metrics.json").read_text())
    assert metrics["best"]["update"] == kept["update"] and "eval/ground_truth_rate" in metrics
    rc, out, err = run_cli("eval", *common, f"eval.policies.sft={base}", "+eval.policies.best=runs/tiny/ppo/best",
                           "eval.reward_dir=null")
    assert rc == 0, err[-3000:]
    report = json.loads((tmp_path / "runs/tiny/eval/report.json").read_text())
    assert sorted(report["policies"]) == ["best", "ppo", "sft"]
    rc, out, err = run_cli("chat", *common, "chat.model_dir=runs/tiny/ppo/best", "prompt=hello",
                           "chat.max_new_tokens=8")
    assert rc == 0 and out.strip(), err[-3000:]
    rc, out, err = run_cli("export", *common, "ppo.output_dir=runs/tiny/ppo/best")
    assert rc == 0, err[-3000:]
    assert (ppo / "best" / "merged" / "config.json").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
