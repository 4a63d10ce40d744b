"""What `rlhf ppo` shows on the console and in its log: the run's settings before it starts, a progress bar over
episodes, one line per update and one per held-out evaluation."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from rlhf_cli import resume
from rlhf_cli.ppo.config import REWARD_MODEL, PPOConfig
from rlhf_cli.ppo.trainer import PPOTrainer

log = logging.getLogger("rlhf")


def describe_run(c: PPOConfig, sizes, world: int, value_source: str, storage, compute, recompute: bool) -> None:
    """The run's batch arithmetic, precision and reward, in the log before the first update."""
    dt = lambda d: str(d).replace("torch.", "")  # noqa: E731
    log.info("ppo: %d updates × %d episodes (%d process(es) × %d micro × %d accumulation × %d mini-batches), "
             "%d PPO epochs, response_length %d, lr %g, kl_coef %g; value model from %s; weights %s, compute %s%s",
             sizes.num_updates, sizes.batch_size, world, sizes.micro_batch_size, sizes.gradient_accumulation_steps,
             sizes.num_mini_batches, c.num_ppo_epochs, c.response_length, c.learning_rate, c.kl_coef, value_source,
             dt(storage), dt(compute) if compute else "float32", ", log-probs recomputed" if recompute else "")
    if c.advantage != "gae" or c.samples_per_prompt > 1 or c.reward != (REWARD_MODEL,):
        log.info("ppo: advantage %s, %d response(s) per prompt; reward %s", c.advantage, c.samples_per_prompt,
                 " + ".join(f"{w:g}·{spec}" for spec, w in zip(c.reward, c.weights())))


def update_line(update: int, num_updates: int, m: dict[str, float]) -> str:
    """One update's headline figures as one line of text (the CLI prints it; the trainer prints nothing)."""
    gt = f" gt {m['objective/ground_truth_rate']:.2f}" if "objective/ground_truth_rate" in m else ""
    vf = f" vf {m['loss/value_avg']:.3f}" if "loss/value_avg" in m else ""
    zero = f" zero-std {m['reward/frac_zero_std']:.2f}" if "reward/frac_zero_std" in m else ""
    return (f"update {update}/{num_updates} ep {m['episodes']} score {m['objective/scores']:+.2f}"
            f" kl {m['objective/kl']:.2f}{gt} len {m['response/length_mean']:.1f} pg {m['loss/policy_avg']:+.3f}"
            f"{vf}{zero} clip {m['policy/clipfrac_avg']:.2f} eps {m['eps']:.1f}")


def final_line(updates: int, episodes: int, seconds: float, m: dict[str, float], out) -> str:
    """PPO's last line: what it trained, its wall time, and the last update's score, KL and ground truth (and the
    held-out evaluation's, where there was one)."""
    parts = [f"score {m['objective/scores']:+.2f}"] if "objective/scores" in m else []
    parts += [f"kl {m['objective/kl']:.2f}"] if "objective/kl" in m else []
    parts += [f"ground truth {m['objective/ground_truth_rate']:.2f}"] if "objective/ground_truth_rate" in m else []
    parts += [f"held-out ground truth {m['eval/ground_truth_rate']:.2f}"] if "eval/ground_truth_rate" in m else []
    last = f"; last update: {', '.join(parts)}" if parts else ""
    return (f"ppo: {updates} update{'' if updates == 1 else 's'}, {episodes} episodes in {duration(seconds)}{last}; "
            f"wrote {out}")


def duration(seconds: float) -> str:
    """`42.0 s`, `3 min 05 s`, `2 h 07 min`: a wall time as a person reads it."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@contextlib.contextmanager
def progress_bar(**tqdm_kwargs) -> Iterator:
    """A tqdm bar (closed however the block ends) with logging written through tqdm inside the block, so a log line
    gets a line of its own instead of being written onto the bar's (rlhf eval's, PPO's `console`)."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(**tqdm_kwargs)
    try:
        with logging_redirect_tqdm():
            yield bar
    finally:
        bar.close()


class console:
    """A progress bar over episodes and a line every `ppo.logging_steps` updates (main process), chained in
    front of the trainer's own on_update hook; on Ctrl-C, says whether a checkpoint can continue the run. Within
    the block, logging writes through tqdm: a warning during the run (a gamed reward) gets a line of its own
    instead of being written onto the bar's."""

    def __init__(self, trainer: PPOTrainer, main: bool) -> None:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.redirect = logging_redirect_tqdm()

        self.trainer, self.main, n = trainer, main, trainer.sizes.num_updates
        self.bar = tqdm(total=n * trainer.sizes.batch_size, initial=trainer.progress.episodes, unit="ep",
                        desc="ppo", disable=not main, dynamic_ncols=True)
        user = trainer.hooks.on_update

        def on_update(update: int, m: dict) -> None:
            self.bar.update(trainer.sizes.batch_size)
            if main and (update % max(trainer.c.logging_steps, 1) == 0 or update == n):
                self.bar.write(update_line(update, n, m))
            user(update, m)

        trainer.hooks.on_update = on_update

    def __enter__(self):
        self.redirect.__enter__()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.bar.close()
        self.redirect.__exit__(None, None, None)
        if kind is KeyboardInterrupt:
            saved = resume.latest(self.trainer.work / "checkpoints")
            log.error("ppo: interrupted; %s", f"`ppo.resume=true` continues from {saved}" if saved else
                      "no checkpoint was written yet (ppo.save_every), nothing to resume")


def eval_line(update: int, num_updates: int, m: dict[str, float]) -> str:
    """An evaluation's figures as one line, below the update's (what is not measured is left out)."""
    parts = [f"{label} {m[tag]:{fmt}}" for tag, label, fmt in (
        ("eval/ground_truth_rate", "gt", ".2f"), ("eval/rm_score", "rm", "+.2f"), ("eval/kl", "kl", ".2f"),
        ("eval/length_mean", "len", ".1f"), ("eval/eos_rate", "eos", ".2f"), ("eval/empty_rate", "empty", ".2f"))
        if tag in m]
    return f"eval {update}/{num_updates} held-out: " + " ".join(parts)


def show_evaluations(trainer: PPOTrainer) -> None:
    """A line per evaluation, after the update's line (`console` writes that one and then calls this hook)."""
    from tqdm.auto import tqdm

    user = trainer.hooks.on_update

    def on_update(update: int, m: dict) -> None:
        user(update, m)
        if "time/eval_s" in m:
            best = trainer.best is not None and trainer.best["update"] == update
            tqdm.write(eval_line(update, trainer.sizes.num_updates, m) + (" (best so far: best/)" if best else ""))

    trainer.hooks.on_update = on_update
