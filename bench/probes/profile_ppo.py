"""Operator profile of one PPO update of the rlhf side (torch profiler, CPU): where the time of the PPO epochs (or
of sampling and scoring) goes, by operator (bench/results/NOTES.md cites its tables).

    .venv/bin/python bench/probes/profile_ppo.py --update 1 -- --workload-dir bench/work/real --variant lora \
        --updates 1 --response-length 32 --threads 1 --precision fp32 --episodes-per-update 8 --micro-batch 2 \
        --out r.json
    .venv/bin/python bench/probes/profile_ppo.py --update 2 -- --workload-dir bench/work/mid --variant lora \
        --updates 2 --response-length 64 --threads 1 --out r.json

Everything after `--` goes to bench/rlhf_side.py. The PPO epochs (`PPOTrainer.update`) of update --update are
profiled, or with --phase experience its sampling and scoring (`make_experience`); the table (sorted by self CPU
time) is printed when that phase ends. BY_SHAPE=1 in the environment
splits each operator's row by input shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for rlhf_side and memtrace


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--update", type=int, default=1, help="which update's PPO epochs to profile")
    ap.add_argument("--rows", type=int, default=30, help="rows of the table")
    ap.add_argument("--phase", choices=["update", "experience"], default="update",
                    help="the PPO epochs, or sampling and scoring")
    a = ap.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    threads = rest[rest.index("--threads") + 1] if "--threads" in rest else "1"
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    from torch.profiler import ProfilerActivity, profile

    from rlhf_cli.ppo import trainer

    owner, name = (trainer.PPOTrainer, "update") if a.phase == "update" else (trainer, "make_experience")
    real, calls = getattr(owner, name), [0]

    def profiled(*args, **kw):
        calls[0] += 1
        if calls[0] != a.update:
            return real(*args, **kw)
        by_shape = bool(os.environ.get("BY_SHAPE"))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=by_shape) as prof:
            out = real(*args, **kw)
        print(prof.key_averages(group_by_input_shape=by_shape).table(sort_by="self_cpu_time_total", row_limit=a.rows),
              flush=True)
        return out

    setattr(owner, name, profiled)
    import rlhf_side

    return rlhf_side.main(rest)


if __name__ == "__main__":
    sys.exit(main())
