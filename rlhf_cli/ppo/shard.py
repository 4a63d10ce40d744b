"""Where PPO's models live: whole on every process (one process, or DDP replicas through accelerate), or sharded
over the processes with FSDP2 (`device.strategy=fsdp`: torch's `fully_shard`, one unit per decoder layer).

    model = place(model, device, sharded)            # build time: each model sharded as soon as it is built
    policy, value, opt = prepare(acc, policy, value, opt)   # DDP wraps whole models; sharded ones stay as they are
    with gathered(policy): policy.generate(...)      # sampling: the policy's weights all-gathered once
    with whole(policy, value, opt): save / load      # what trains, read and written as whole tensors

Sharded are the LoRA policy's base (its adapter-disabled self is the reference), the value model's trunk and the
frozen reward model, with the trainable weights (LoRA matrices, value heads, or a fully trained value model) in
the same units: each process's AdamW steps its own shards (the parameters are DTensors) and FSDP reduce-scatters
their gradients after each backward. The PPO loop sees ordinary modules and calls these four functions only.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from rlhf_cli.errors import RlhfError


def fsdp_units(module: nn.Module | None) -> list[nn.Module]:
    """The FSDP2 units inside `module` (empty: it is not sharded)."""
    if module is None or not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(obj) -> bool:
    """Whether a module or an optimizer holds sharded parameters (DTensors)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    params = obj.parameters() if isinstance(obj, nn.Module) else \
        (p for g in getattr(obj, "param_groups", ()) for p in g["params"])
    return any(isinstance(p, DTensor) for p in params)


def decoder_layers(model: nn.Module, why: str = "device.strategy=fsdp shards") -> list[nn.Module]:
    """The model's decoder layers: the modules transformers names as never to be split (`_no_split_modules`)."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RlhfError(f"{why} per decoder layer, and {type(model).__name__} names none (_no_split_modules); "
                        "turn it off for this model")
    return layers


def checkpoint_layers(model: nn.Module) -> int:
    """Activation checkpointing (`ppo.activation_checkpointing`): each decoder layer keeps only its input for the
    backward and computes its inside again there, so a micro-batch holds one hidden state per layer instead of
    every intermediate (attention, MLP, norms, LoRA). Only where gradients are taken, in the PPO epochs; sampling
    and scoring run as before. transformers' own switch acts in training mode only, and PPO keeps its models in
    eval mode (no dropout: the first ratio must be 1), so each layer's forward is wrapped on the instance. Done
    before `place`: FSDP then gathers a layer's weights for the recomputation as for its backward. Returns the
    number of layers wrapped."""
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model, "ppo.activation_checkpointing recomputes")
    for layer in layers:
        def forward(*args, _inner=layer.forward, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    return len(layers)


@functools.cache
def _mesh(device_type: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world,))


def place(model: nn.Module | None, device: torch.device, sharded: bool,
          reshard_after_forward: bool = True, gather_for_sampling: bool = True) -> nn.Module | None:
    """`model` on `device`: moved there whole, or (`sharded`) split over all processes in place, each decoder
    layer one FSDP unit (all-gathered just before its forward, freed after it with `reshard_after_forward`), untied
    input and output embeddings one each, and the rest (final norm, heads, tied embeddings) the root unit, freed
    after its forward. The root is the module the code calls: the causal LM inside a PEFT model (PEFT calls it),
    a `TokenValueModel` itself (its `score_at` registered as a forward too), the `TokenValueModel` inside a
    reward model that reads texts. Trainable weights are broadcast from process 0 first, as DDP does, so that a
    random initialisation (LoRA's A, a new score head) agrees."""
    if model is None:
        return None
    if not sharded:
        return model.to(device)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    root = getattr(model, "scorer", model)  # a TextRewardModel scores through its TokenValueModel
    if hasattr(root, "peft_config"):
        root = root.get_base_model()
    with torch.no_grad():
        for p in root.parameters():
            if p.requires_grad:
                t = p.data.to(device)
                dist.broadcast(t, 0)
                p.data.copy_(t)
    mesh = _mesh(device.type, dist.get_world_size())
    if hasattr(model, "peft_config"):  # the policy: its adapter's requires_grad switches (see the root below)
        reshard_after_forward = True
    for layer in decoder_layers(root):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        layer.rlhf_reshard_after_forward = reshard_after_forward  # what `gathered` restores
    # Untied input and output embeddings are units of their own: with a large vocabulary they are most of a
    # slice's weights, and in the root they would be gathered (and copied out of the gather buffer) together.
    for unit in _embeddings(root):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        unit.rlhf_reshard_after_forward = True
    # The root reshards after its forward too (FSDP's default keeps the root gathered until the backward): PEFT
    # switches its adapter's requires_grad off and on around the reference's forward, on the parameters registered
    # at that moment; were they the gathered copies, the sharded weights that train (a LoRA on lm_head) would stay
    # frozen. The price is one more all-gather of the root (embeddings, heads) per backward.
    fully_shard(root, mesh=mesh, reshard_after_forward=True)
    root.rlhf_reshard_after_forward = True
    root.rlhf_gather_for_sampling = gather_for_sampling  # what `gathered` does (device.fsdp.gather_for_sampling)
    if hasattr(root, "score_at"):
        register_fsdp_forward_method(root, "score_at")
    if device.type == "cpu":
        contiguous_head_input(root)
    return model


def contiguous_head_input(model: nn.Module) -> None:
    """The output layer's input made contiguous first. Sharded, the speed paths are off and sampling runs
    transformers' `generate()`, whose head reads the last position as a slice (`logits_to_keep`): on the CPU torch
    runs a linear layer on such a 3-D view as a batched matmul over the weight expanded per row, and copies the
    whole weight first (Qwen3-8B's 151,936-row head in bf16: 1.16 GiB at every sampled token). A contiguous input
    takes the plain matrix product: the same result, no copy."""
    hf = next((m for m in model.modules() if hasattr(m, "get_output_embeddings")), None)
    head = hf.get_output_embeddings() if hf is not None else None
    if head is not None:
        head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]) if args else None)


def _embeddings(root: nn.Module) -> list[nn.Module]:
    """The input embedding and the output layer of the model inside `root`, unless they share one weight (tied:
    a weight lives in one FSDP unit, the root's)."""
    hf = next((m for m in root.modules() if hasattr(m, "get_input_embeddings")), None)
    if hf is None:
        return []
    emb = hf.get_input_embeddings()
    out = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    out_weight = getattr(getattr(out, "base_layer", out), "weight", None)
    if emb is None or out_weight is emb.weight:
        return []
    return [emb] + ([out] if out is not None else [])


@dataclass(frozen=True)
class Placement:
    """`place` with the run's settings: `Placement.of(run, device)(model)`; whole models stay where they were
    built unless sharded (`device.strategy=fsdp`)."""

    device: torch.device
    sharded: bool = False
    reshard_after_forward: bool = True  # device.fsdp.reshard_after_forward
    gather_for_sampling: bool = True    # device.fsdp.gather_for_sampling

    @classmethod
    def of(cls, run, device) -> Placement:
        from rlhf_cli.launch import strategy

        d = run.device
        return cls(torch.device(device), strategy(d) == "fsdp",
                   bool(d.get("fsdp", {}).get("reshard_after_forward", True)),
                   bool(d.get("fsdp", {}).get("gather_for_sampling", True)))

    @property
    def load_device(self) -> torch.device:
        """Where a model is built: on the CPU when it is sharded next (FSDP moves each shard to the device), so
        that an accelerator never holds a whole model."""
        return torch.device("cpu") if self.sharded else self.device

    def __call__(self, model: nn.Module | None) -> nn.Module | None:
        if not self.sharded:
            return model
        return place(model, self.device, True, self.reshard_after_forward, self.gather_for_sampling)


def prepare(accelerator, policy: nn.Module, value: nn.Module | None, optimizer):
    """(policy, value, optimizer) ready to train: sharded models as they are (FSDP syncs their gradients), whole
    ones through accelerate (DDP replicas when several processes run; value None: critic-free)."""
    if is_sharded(policy):
        return policy, value, optimizer
    if value is None:
        policy, optimizer = accelerator.prepare(policy, optimizer)
        return policy, None, optimizer
    return accelerator.prepare(policy, value, optimizer)


@contextlib.contextmanager
def gathered(model: nn.Module):
    """`model`'s sharded weights all-gathered once and kept whole inside (every process enters it together; a
    whole model: nothing happens). Sampling runs one forward per token: gathering each layer in every forward
    would cost layers × response_length all-gathers per chunk, each a round trip between processes, and would
    hold the processes in lockstep token by token although their responses stop at different lengths. Gathered,
    the forwards need no collective at all. The price is one whole copy of the policy while sampling; the value
    and reward models stay sharded and gather layer by layer in their one forward per chunk. A model too large
    to be held whole (device.fsdp.gather_for_sampling=false) is left sharded: each forward gathers layer by layer
    and `synced_sampling` keeps every process stepping until the last one's responses end."""
    units = fsdp_units(model)
    if not units or synced_sampling(model):
        yield model
        return
    for u in units:
        u.unshard()
        u.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(bool(getattr(u, "rlhf_reshard_after_forward", True)), recurse=False)


def synced_sampling(model: nn.Module) -> bool:
    """Whether sampling `model` runs sharded, a collective in every forward: then every process must take as
    many decoding steps as the slowest (transformers' `generate(synced_gpus=True)`)."""
    units = fsdp_units(model)
    return bool(units) and not all(getattr(u, "rlhf_gather_for_sampling", True) for u in units)


def full(t):
    """A sharded tensor (DTensor) gathered whole (a collective: every process calls it); else `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full_module_state(module: nn.Module) -> dict:
    """`module.state_dict()` with whole tensors: what trains for a PEFT model (its adapter and saved modules;
    the frozen base is never written), everything else. A tensor under two names (tied) stays one tensor."""
    sd = module.state_dict()
    if hasattr(module, "peft_config"):
        trains = {n for n, p in module.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in sd.items() if k in trains}
    done: dict[int, torch.Tensor] = {}
    return {k: done.setdefault(id(v), full(v)) for k, v in sd.items()}


def _full_optimizer_state(optimizer) -> dict:
    sd = optimizer.state_dict()
    return {**sd, "state": {pid: {k: full(v) for k, v in st.items()} for pid, st in sd["state"].items()}}


def _shards(p, v):
    """Whole tensor `v` cut to this process's shard of parameter `p` (no communication: every process holds `v`);
    `v` itself where `p` is not sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor) and torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.shape:
        return distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    return v


def _sharded_module_state(module: nn.Module, sd: dict) -> dict:
    params = dict(module.named_parameters(remove_duplicate=False))
    return {k: _shards(params[k], v) if k in params else v for k, v in sd.items()}


def _sharded_optimizer_state(optimizer, sd: dict) -> dict:
    """A whole optimizer state (`_full_optimizer_state`, or one written by a whole run) cut to this process's
    shards of each parameter."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {**sd, "state": {pid: {k: _shards(params[int(pid)], v) for k, v in st.items()}
                            for pid, st in sd["state"].items()}}


@contextlib.contextmanager
def whole(*objs):
    """Sharded modules and optimizers among `objs` read and written as whole tensors inside: their `state_dict()`
    returns whole tensors (gathered on entry, by every process together: one process may then save them) and
    their `load_state_dict()` takes whole tensors, each process keeping its shards. Checkpoints thus hold what
    trains whole, the same files as a whole run's, loadable by a run on any number of processes. Whole objects
    and None pass through untouched."""
    sharded = [o for o in objs if o is not None and is_sharded(o)]
    for o in sharded:
        load = type(o).load_state_dict
        if isinstance(o, nn.Module):
            o.state_dict = functools.partial(dict, _full_module_state(o))
            o.load_state_dict = lambda sd, *a, _o=o, _load=load, **k: _load(_o, _sharded_module_state(_o, sd), *a, **k)
        else:
            o.state_dict = functools.partial(dict, _full_optimizer_state(o))
            o.load_state_dict = lambda sd, _o=o, _load=load: _load(_o, _sharded_optimizer_state(_o, sd))
    try:
        yield
    finally:
        for o in sharded:
            for name in ("state_dict", "load_state_dict"):
                o.__dict__.pop(name, None)
