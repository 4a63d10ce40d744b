"""Every `rlhf` command, declared once. The lists that name commands (the dispatcher's, the launcher's, the
doctor's, the output markers', the sweep's, the config checks', eval's and chat's) are read from this table, so a
new stage is its row here, its module in rlhf_cli/stages/, its config group in conf/stage/ and its tests.
Imports nothing: `--help` and the doctor stay torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str                      # `rlhf <name>`; the module rlhf_cli.stages.<name>; the config group <name>
    summary: str                   # its line in `rlhf --help`
    trains: bool = False           # trains weights: launched over processes, planned by the doctor, resumable
    needs_data: bool = False       # reads data.train_path (checked before any model is fetched)
    output: bool = False           # writes <name>.output_dir, an output directory marked as this stage's
    headline: str | None = None    # the metrics.json key a sweep (-m) compares its jobs by
    resume: str | None = None      # how an interrupted run continues: "trainer" (transformers' checkpoint-N/,
                                   # <name>.save_steps) or "ppo" (rlhf_cli.ppo.checkpoint, ppo.save_every)
    policy: int = 0                # its output is a policy eval compares and chat talks to: chat's fallback
                                   # order, highest first (0: not a policy)
    legacy_dirs: tuple[str, ...] = ()  # directory names an output of an older rlhf (no kind in its marker) had

    @property
    def output_key(self) -> str | None:
        return f"{self.name}.output_dir" if self.output else None

    @property
    def save_key(self) -> str | None:
        return {"trainer": f"{self.name}.save_steps", "ppo": f"{self.name}.save_every"}.get(self.resume or "")


STAGES: tuple[Stage, ...] = (
    Stage("sft", "supervised fine-tuning (trl SFTTrainer)        writes <run_dir>/sft", trains=True, needs_data=True, output=True,
          headline="eval_loss_end", resume="trainer", policy=1, legacy_dirs=("sft",)),
    Stage("reward", "Bradley-Terry reward model (trl RewardTrainer) reads sft,          writes <run_dir>/reward", trains=True, needs_data=True,
          output=True, headline="eval_accuracy", resume="trainer", legacy_dirs=("reward",)),
    Stage("ppo", "PPO, LoRA policy, base as reference            reads sft + reward, writes <run_dir>/ppo", trains=True, needs_data=True, output=True,
          headline="objective/scores", resume="ppo", policy=3, legacy_dirs=("ppo",)),
    Stage("dpo", "direct preference optimisation (trl DPOTrainer) reads sft,         writes <run_dir>/dpo", trains=True, needs_data=True,
          output=True, headline="eval_accuracy", resume="trainer", policy=2),
    Stage("eval", "SFT vs PPO on held-out prompts, plots          reads sft + reward + ppo, writes <run_dir>/eval", needs_data=True, output=True, legacy_dirs=("eval",)),
    Stage("chat", "answer prompts from stdin, or prompt=\"...\" once"),
    Stage("export", "write the PPO policy as a merged full model    writes <run_dir>/ppo/merged", output=True, legacy_dirs=("merged", "export")),
    Stage("push", "upload a published model and its card to a hub  reads push.dir (push.dry_run: list it)"),
    Stage("doctor", "versions, devices, hub reachability and a memory plan for a recipe"),
)
BY_NAME = {s.name: s for s in STAGES}

COMMANDS = tuple(s.name for s in STAGES)
TRAIN_STAGES = tuple(s.name for s in STAGES if s.trains)
NEEDS_DATA = tuple(s.name for s in STAGES if s.needs_data)
OUTPUT_STAGES = tuple(s.name for s in STAGES if s.output)
RESUMABLE = tuple(s.name for s in STAGES if s.resume)
POLICIES = tuple(s.name for s in sorted((s for s in STAGES if s.policy), key=lambda s: -s.policy))  # chat's order


def stage(name: str) -> Stage | None:
    return BY_NAME.get(str(name))
