"""The value model's embedding trained through the rows tokens reach (rlhf_cli/accel/sparse_rows.py) gives the weights
that AdamW over the dense matrix gives: same steps, same clipping, rows that drop out of a batch keep moving with
their momentum, untouched rows never move, and a checkpoint round trip continues the same run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rlhf_cli.accel.sparse_rows import RowSparseEmbedding
from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo import checkpoint
from rlhf_cli.ppo.trainer import adamw

V, D, PAD = 50, 8, 0


class Net(nn.Module):
    """An embedding (with a padding row, as Qwen3's) and a small head on top."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, padding_idx=PAD)
        self.head = nn.Linear(D, 1)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids))).squeeze(-1)


class _Acc:
    distributed_type = "NO"


def _batches(step: int) -> list[torch.Tensor]:
    # steps 0-1 use tokens 1-19, later steps 20-39: rows that stop receiving gradient must keep moving
    g = torch.Generator().manual_seed(step)
    lo, hi = (1, 20) if step < 2 else (20, 40)
    out = []
    for _ in range(3):  # gradient accumulation over 3 micro-batches
        ids = torch.randint(lo, hi, (2, 5), generator=g)
        ids[0, 0] = PAD  # a padding token is looked up but gets no gradient
        out.append(ids)
    return out


def _train(net: Net, sparse: bool, steps: range, opt_state: dict | None = None, fused: bool = True):
    """AdamW over the net, as the trainer runs it: the row-sparse embedding joins the optimizer through `attach`,
    its gradient is summed during the backward, written back after each step and rebuilt after a state load."""
    rows = RowSparseEmbedding(net.embed) if sparse else None
    params = [p for p in net.parameters() if p.requires_grad]
    from accelerate.utils import DistributedType

    acc = _Acc()
    acc.distributed_type = DistributedType.NO
    opt = adamw([{"params": params, "lr": 0.05}], acc, lr=0.05, weight_decay=0.0, eps=1e-5) if fused else \
        torch.optim.AdamW([{"params": params, "lr": 0.05}], lr=0.05, weight_decay=0.0, eps=1e-5)
    if rows:
        rows.attach(opt)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for step in steps:
        for ids in _batches(step):
            (net(ids).pow(2).mean() / 3).backward()
        trainable = [p for g in opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, rows


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("fused", [True, False])
def test_same_weights_as_dense_adamw(fused):
    dense, sparse = _net(), _net()
    _train(dense, False, range(4), fused=fused)
    _, rows = _train(sparse, True, range(4), fused=fused)
    w0 = _net().embed.weight
    # same result (to rounding: the gradient norm is summed in another order), in every row
    torch.testing.assert_close(sparse.embed.weight, dense.embed.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sparse.head.weight, dense.head.weight, rtol=1e-6, atol=1e-7)
    early = sorted({int(i) for s in (0, 1) for b in _batches(s) for i in b.flatten()} - {PAD})
    late = sorted({int(i) for s in (2, 3) for b in _batches(s) for i in b.flatten()} - {PAD})
    assert set(early).isdisjoint(late)
    # rows that got gradient only in steps 0-1 still moved in steps 2-3 (momentum), in both runs
    after_two = _net()
    _train(after_two, False, range(2), fused=fused)
    assert (dense.embed.weight[early] != after_two.embed.weight[early]).all(-1).all()
    # untouched rows and the padding row never move, and have no moments
    untouched = sorted(set(range(V)) - set(early) - set(late))
    assert torch.equal(sparse.embed.weight[untouched], w0[untouched])
    assert rows.seen.tolist() == sorted({PAD, *early, *late})  # the padding row is seen with a zero gradient
    assert rows.param.shape == (len(rows.seen), D)


def test_checkpoint_round_trip_continues_the_run():
    straight = _net()
    _train(straight, True, range(4))
    first = _net()
    opt, _ = _train(first, True, range(3))
    js, tensors = checkpoint.split_optimizer_state(opt.state_dict())
    resumed = copy.deepcopy(first)  # the weights as a checkpoint would restore them
    _train(resumed, True, range(3, 4), opt_state=checkpoint.join_optimizer_state(js, tensors))
    torch.testing.assert_close(resumed.embed.weight, straight.embed.weight, rtol=0, atol=0)


def test_a_dense_checkpoint_is_refused():
    net = _net()
    opt, _ = _train(net, False, range(1))
    state = copy.deepcopy(opt.state_dict())
    # a dense run's optimizer state has the embedding first: order the groups as a sparse run would
    fresh = _net()
    with pytest.raises(RlhfError, match="sparse_value_embedding=false"):
        _train(fresh, True, range(1, 2), opt_state=state)


def test_when_it_does_not_apply():
    net = _net()
    assert RowSparseEmbedding.applies(net) is None
    net.embed.weight.requires_grad_(False)
    assert "does not train" in RowSparseEmbedding.applies(net)
    tied = _net()
    tied.head = nn.Linear(D, V, bias=False)
    tied.head.weight = tied.embed.weight
    assert "tied" in RowSparseEmbedding.applies(tied)
