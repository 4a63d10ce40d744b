"""Speed levers for rlhf's PPO stage, measured without editing rlhf_cli: the rlhf side of the benchmark
(bench/rlhf_side.py, same contract, same hook-based timing) with some trainer functions replaced at run time.

    .venv/bin/python bench/levers.py --lever fused_adam sorted_micro -- \
        --workload-dir bench/work/mid --variant lora --updates 4 --response-length 64 --threads 1 --out r.json

Each lever is a change that could be made in rlhf_cli (the report names the function); here it is applied by
patching the imported module before the stage runs, and the result JSON records which levers were on
("levers"). With no --lever the run is the plain rlhf side.

    fused_adam     torch.optim.AdamW(..., fused=True) for the trainer's optimizer: one fused kernel per
                   parameter instead of ~10 element-wise passes (rlhf_cli/ppo/trainer.py, PPOTrainer.__init__).
    sorted_micro   micro-batches of rows with similar prompt lengths: the epoch's random permutation is stably
                   sorted by leading padding, so `leading_padding` drops more columns per micro-batch
                   (PPOTrainer.update). With one mini-batch every row still enters the same optimizer step and,
                   with fixed-length responses, the same token-mean; only the grouping changes.
    no_merge       sample with the LoRA adapter unmerged (rollout.lora_merged becomes a no-op), to price the
                   merge against its saving per decoding step.
    contiguous_prefill_head
                   the prefill of the sampling loop asks for the last position's logits with an index tensor
                   (`logits_to_keep=torch.tensor([P - 1])`) instead of `logits_to_keep=1` (rollout.sample_loop).
                   With 1, transformers slices the hidden states to a non-contiguous (B, 1, d) view; for a frozen
                   bf16 LM head (requires_grad False) torch.matmul then does not fold the batch into one matrix
                   product but runs a bmm over the weight expanded B times, copying B x rows x d bf16 values
                   (8 x 151,936 x 1,024: 2.5 GB, ~22 s per prefill on this CPU). fp32 and trainable heads fold.
    frozen_value_embedding
                   the value model's input embedding is not trained (models.build_ppo_models): no dense
                   (rows x hidden) gradient per micro-batch, no AdamW state for it. This changes what trains
                   (TRL trains it), so it is reported as a memory lever, not as the benchmark's contract.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LEVERS = ("fused_adam", "sorted_micro", "no_merge", "contiguous_prefill_head", "frozen_value_embedding")


def apply_fused_adam() -> None:
    import torch

    real = torch.optim.AdamW

    class FusedAdamW(real):
        def __init__(self, params, *args, **kw):
            kw.setdefault("fused", True)
            super().__init__(params, *args, **kw)

    torch.optim.AdamW = FusedAdamW


def apply_sorted_micro() -> None:
    import types

    import torch

    from rlhf_cli.ppo import trainer as T

    current = {}
    real_update = T.PPOTrainer.update

    def randperm(n, *args, **kw):
        perm = torch.randperm(n, *args, **kw)
        am = current.get("attention_mask")
        if am is None or am.shape[0] != n:
            return perm
        lead = (am.cumsum(-1) == 0).sum(-1)  # leading pad columns of each row
        order = torch.sort(lead[perm], stable=True).indices
        return perm[order]

    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.randperm = randperm

    def update(self, exp):
        current["attention_mask"] = exp.attention_mask
        try:
            return real_update(self, exp)
        finally:
            current.clear()

    T.torch = proxy
    T.PPOTrainer.update = update


def apply_no_merge() -> None:
    from rlhf_cli.ppo import rollout

    @contextlib.contextmanager
    def unmerged(model):
        yield model

    rollout.lora_merged = unmerged


class _IndexedPrefill:
    """The model as sample_loop sees it, except that `logits_to_keep=1` becomes the index of the last position."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kw):
        import torch

        ids = kw.get("input_ids")
        if isinstance(kw.get("logits_to_keep"), int) and kw["logits_to_keep"] == 1 and ids is not None:
            kw["logits_to_keep"] = torch.tensor([ids.shape[1] - 1], device=ids.device)
        return self._model(*args, **kw)


def apply_contiguous_prefill_head() -> None:
    from rlhf_cli.ppo import rollout

    real = rollout.sample_loop

    def sample_loop(model, *args, **kw):
        return real(_IndexedPrefill(model), *args, **kw)

    rollout.sample_loop = sample_loop


def apply_frozen_value_embedding() -> None:
    from rlhf_cli.stages import ppo as stage

    real = stage.build_ppo_models

    def build(*args, **kw):
        models = real(*args, **kw)
        if models.value is not None:
            emb = models.value.model.get_input_embeddings()
            emb.weight.requires_grad_(False)
        return models

    stage.build_ppo_models = build


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: levers.py [--lever NAME ...] -- RLHF_SIDE_ARGS")
    cut = argv.index("--")
    own, rest = argv[:cut], argv[cut + 1:]
    levers = [x for x in own if x != "--lever"]
    unknown = [x for x in levers if x not in LEVERS]
    if unknown:
        raise SystemExit(f"unknown lever(s) {unknown}; choose from {list(LEVERS)}")
    import json
    import os

    threads = rest[rest.index("--threads") + 1] if "--threads" in rest else "1"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = threads
    for name in levers:
        globals()[f"apply_{name}"]()
    import rlhf_side

    rc = rlhf_side.main(rest)
    out = Path(rest[rest.index("--out") + 1])
    res = json.loads(out.read_text())
    res["levers"] = levers
    out.write_text(json.dumps(res, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
