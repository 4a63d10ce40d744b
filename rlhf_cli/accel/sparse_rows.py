"""Training an input embedding through the rows the tokens reach: AdamW over a (151,936 x 1,024) matrix without a
dense gradient per backward and without moments for rows no token has touched.

Why it is exact. With weight_decay 0, AdamW moves a row only through its moments: a row whose gradient has been zero
at every step so far has zero moments, and its update is lr · 0 / (0 + eps) = 0, bit for bit. So AdamW over the
whole matrix and AdamW over the rows that have had a gradient at least once (`seen`) give the same weights, step by
step; the rows of `seen` that this step's tokens do not reach get a zero gradient, as in the dense update, so their
momentum carries on exactly as it would there. The step count (and so the bias correction) is the global one.

How. The embedding's weight leaves autograd (requires_grad False) and stays the one full matrix that the model reads
and saves. In a forward with gradients, the module gathers the rows of the batch's distinct tokens into a small leaf
tensor and looks the tokens up in it, so the backward gives one (distinct tokens x hidden) gradient, which a hook on
that leaf adds (`add_grad`) into the gradient of `param`, the rows `seen` of the matrix (grown when new tokens
arrive, with zero moments for the new rows). AdamW steps `param` with the rest of the value model's group (`attach`),
and a hook after each step copies the rows into the matrix (`write_back`). The rows `seen` are kept in the optimizer
state of `param` ("rows"), so a checkpoint's optimizer state carries them and `after_load` rebuilds `param` on resume.

Used for the value model when it trains in full, in one process (with DDP each process would see other rows),
with weight_decay 0 (`rlhf_cli.accel.FastPaths.value_embedding`; `ppo.sparse_value_embedding`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from rlhf_cli.errors import RlhfError


class RowSparseEmbedding:
    """The rows of `emb.weight` that have had a gradient, as one trainable parameter (see the module's doc)."""

    def __init__(self, emb: nn.Embedding) -> None:
        self.emb, self.weight = emb, emb.weight
        self.weight.requires_grad_(False)
        self.seen = torch.empty(0, dtype=torch.long, device=self.weight.device)
        self.param = nn.Parameter(self.weight.detach()[self.seen].clone())
        self.optimizer: torch.optim.Optimizer | None = None
        emb.forward = types.MethodType(_make_forward(self), emb)

    @staticmethod
    def applies(model: nn.Module) -> str | None:
        """Why the model's input embedding cannot be trained this way (None: it can)."""
        emb = model.get_input_embeddings()
        if type(emb) is not nn.Embedding:
            return f"its input embedding is a {type(emb).__name__}"
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            return "its input embedding uses max_norm, scale_grad_by_freq or sparse gradients"
        if not emb.weight.requires_grad or not emb.weight.is_floating_point():
            return "its input embedding does not train"
        if sum(p is emb.weight for _, p in model.named_parameters(remove_duplicate=False)) > 1:
            return "its input embedding is tied to another weight"
        return None

    def attach(self, optimizer: torch.optim.Optimizer, group: int = -1) -> None:
        """Train `param` in the optimizer's param group `group` (the value model's): it joins the group, the
        stepped rows are written back after every step, and `param` is rebuilt after a state load."""
        self.optimizer = optimizer
        optimizer.param_groups[group]["params"].append(self.param)
        optimizer.register_step_post_hook(lambda *_: self.write_back())
        optimizer.register_load_state_dict_post_hook(lambda *_: self.after_load())

    def _replace(self, new: nn.Parameter, state: dict) -> None:
        for group in self.optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p is self.param:
                    group["params"][i] = new
        self.optimizer.state.pop(self.param, None)
        if state:
            self.optimizer.state[new] = state
        self.param = new

    def _grow(self, seen: torch.Tensor) -> None:
        """`seen` ⊇ self.seen (sorted): a new `param` with those rows; old rows keep their moments, new ones 0."""
        state = dict(self.optimizer.state.get(self.param, {}))
        old = torch.searchsorted(seen, self.seen)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                moved = state[key].new_zeros((seen.numel(), state[key].shape[1]))
                moved[old] = state[key]
                state[key] = moved
        if state:
            state["rows"] = seen
        grad = self.param.grad
        self._replace(nn.Parameter(self.weight.detach()[seen].clone()), state)
        if grad is not None:  # the gradient summed so far in this step moves with its rows
            self.param.grad = grad.new_zeros(self.param.shape)
            self.param.grad[old] = grad
        self.seen = seen

    @torch.no_grad()
    def add_grad(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add one backward's gradient of the rows `ids` (sorted, distinct) into `param.grad`, growing `param` by the
        rows it has not seen (runs as the backward reaches the lookup, so the sum is there before clipping)."""
        seen = torch.unique(torch.cat([self.seen, ids]))
        if seen.numel() != self.seen.numel():
            self._grow(seen)
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        self.param.grad.index_add_(0, torch.searchsorted(self.seen, ids), grad.to(self.param.dtype))
        if self.emb.padding_idx is not None:  # the padding row gets no gradient, as in nn.Embedding
            self.param.grad.masked_fill_((self.seen == self.emb.padding_idx)[:, None], 0.0)

    @torch.no_grad()
    def write_back(self) -> None:
        """After the optimizer step: the stepped rows into the full matrix, and `seen` into the state."""
        if self.seen.numel():
            self.weight.index_copy_(0, self.seen, self.param.detach().to(self.weight.dtype))
            state = self.optimizer.state.get(self.param)
            if state:
                state["rows"] = self.seen

    def after_load(self) -> None:
        """After `optimizer.load_state_dict` (and the weights) from a checkpoint: `param` = the saved rows."""
        state = dict(self.optimizer.state.get(self.param, {}))
        rows = state.get("rows")
        if state and (rows is None or state["exp_avg"].shape != (rows.numel(), self.weight.shape[1])):
            raise RlhfError("the checkpoint's optimizer state was written with a dense value-model embedding; "
                            "resume with ppo.sparse_value_embedding=false")
        if rows is None:
            return
        self.seen = rows.to(device=self.weight.device, dtype=torch.long)
        state["rows"] = self.seen
        self._replace(nn.Parameter(self.weight.detach()[self.seen].clone()), state)


def _make_forward(rows: RowSparseEmbedding):
    def forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.embedding(ids, module.weight, module.padding_idx)
        u, inv = torch.unique(ids, return_inverse=True)
        leaf = module.weight.detach()[u].requires_grad_()
        leaf.register_hook(lambda g: rows.add_grad(u, g))
        return F.embedding(inv, leaf)  # the padding row's gradient is dropped in add_grad

    return forward
