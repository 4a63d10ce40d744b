"""Python's garbage collections during one rlhf_side run: count and seconds per generation, and every full
(generation 2) collection with its time relative to the first PPO update: why rlhf forces no gc.collect() as
TRL does (bench/results/NOTES.md: no full collection inside the loop).

    .venv/bin/python bench/probes/gc_probe.py --workload-dir bench/work/mid --variant lora --updates 4 \
        --response-length 64 --threads 1 --out r.json

Arguments go to bench/rlhf_side.py.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for rlhf_side and memtrace
    from rlhf_cli.ppo import trainer

    count, seconds, full, start, loop = [0, 0, 0], [0.0, 0.0, 0.0], [], [0.0], [None]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
            return
        g, dt = info["generation"], time.perf_counter() - start[0]
        count[g] += 1
        seconds[g] += dt
        if g == 2:
            full.append((start[0], dt))

    real_train = trainer.PPOTrainer.train

    def train(self):
        loop[0] = time.perf_counter()
        try:
            return real_train(self)
        finally:
            loop.append(time.perf_counter())

    trainer.PPOTrainer.train = train
    gc.callbacks.append(on_gc)
    import rlhf_side

    rc = rlhf_side.main(sys.argv[1:] if argv is None else argv)
    gc.callbacks.remove(on_gc)
    t0, t1 = loop[0], loop[-1]
    inside = [(t, d) for t, d in full if t0 is not None and t0 <= t <= t1]
    print(f"collections per generation {count}, seconds {[round(s, 3) for s in seconds]} (whole process); "
          f"full collections inside the training loop: {len(inside)}, {sum(d for _, d in inside):.3f} s "
          f"of a {t1 - t0:.1f} s loop")
    return rc


if __name__ == "__main__":
    sys.exit(main())
