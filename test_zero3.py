"""
Tests of zero3.py against the whole model in one process: on 4 ranks each holds exactly its slice of every
parameter, gradient and AdamW state, gathered units are freed, and what the ranks hold (checkpoint.held), put
together, is the whole model and loads onto 2 ranks exactly; a user's own model whose unit is sometimes skipped and
returns a dict trains as it does in one process; a float64 model keeps float64 sums, in ZeRO3 and FSDP2 alike.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero3
from conftest import assert_all_close, run_ranks, zero_batch
from gpt import GPT, GPTConfig
from harness import checkpoint


ZERO_CFG = GPTConfig(vocab_size=255, n_layer=2, n_head=3, n_kv_head=3, n_embd=30)  # on 4 ranks a unit needs padding


def _zero3_rank(rank, world_size):
    torch.manual_seed(0)
    reference = GPT(ZERO_CFG)
    idx, position_ids, labels = zero_batch()
    reference(idx, position_ids, labels)[0].backward()  # the whole batch in one process
    torch.manual_seed(0)
    model = GPT(ZERO_CFG)
    zero = zero3.ZeRO3(model, model.units(), group=dist.group.WORLD)
    assert list(model.parameters()) == []  # the model keeps no full parameter of its own
    gathered, prefetched = [], []  # after every gather: how many units hold their full parameters; the prefetches
    for i, unit in enumerate(zero.units):
        def counting_gather(async_op=False, gather=unit.gather, i=i):
            gather(async_op)
            gathered.append(sum(u.full.untyped_storage().size() > 0 for u in zero.units))
            prefetched.extend([i] * async_op)
        unit.gather = counting_gather
    rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)  # data parallel: my rows of the batch
    loss = model(idx[rows], position_ids[rows], labels[rows])[0]
    assert prefetched == [1, 2, 3]  # forward: each next unit while this one computes (units: embedding, 2 blocks, head)
    loss.backward()
    assert prefetched == [1, 2, 3, 2, 1, 0]  # and backward, the one before
    assert max(gathered) == 2  # the unit computing and the one prefetched, never more
    for unit, reference_unit in zip(zero.units, reference.units()):
        params = list(reference_unit.parameters())
        padding = -sum(p.numel() for p in params) % world_size
        flat = torch.cat([p.detach().flatten() for p in params] + [torch.zeros(padding)]).view(world_size, -1)
        flat_grad = torch.cat([p.grad.flatten() for p in params] + [torch.zeros(padding)]).view(world_size, -1)
        assert torch.equal(unit.shard.detach(), flat[rank])  # exactly my slice, nothing more
        torch.testing.assert_close(unit.shard.grad, flat_grad[rank], rtol=1e-5, atol=1e-6)  # summed, not averaged
        assert unit.full.untyped_storage().size() == 0 and unit.full.grad is None  # gathered copy freed
    optimizer = torch.optim.AdamW(zero.parameters())
    optimizer.step()
    assert all(state["exp_avg"].shape == shard.shape for shard, state in optimizer.state.items())
    assert set(optimizer.state) == set(zero.parameters())
    with torch.no_grad():
        logits = model(idx, position_ids)
    return _cloned(checkpoint.held(model, optimizer, zero)), checkpoint.optimizer_scalars(optimizer), logits


def _cloned(pieces):
    return {name: (shape, start, {key: t.clone() for key, t in values.items()})
            for name, (shape, start, values) in pieces.items()}


def _zero3_load_rank(rank, world_size, stored, scalars):
    torch.manual_seed(123)  # other weights, all overwritten by the load
    model = GPT(ZERO_CFG)
    zero = zero3.ZeRO3(model, model.units(), group=dist.group.WORLD)
    optimizer = torch.optim.AdamW(zero.parameters())
    checkpoint.prepare_optimizer(optimizer, ["exp_avg", "exp_avg_sq"], scalars)
    checkpoint.load_pieces(checkpoint.held(model, optimizer, zero), stored)
    with torch.no_grad():
        logits = model(*zero_batch()[:2])
    return _cloned(checkpoint.held(model, optimizer, zero)), checkpoint.optimizer_scalars(optimizer), logits


def test_zero3_shards_and_checkpoint_pieces():
    """What 4 ranks hold of the model and of AdamW's state (checkpoint.held) is the whole model in one process, and
    loads onto 2 ranks exactly."""
    four = run_ranks(4, _zero3_rank)
    stored = [pieces for pieces, _, _ in four]
    plain = GPT(ZERO_CFG)
    plain.load_state_dict(checkpoint.whole(stored))  # held on 4 ranks, whole in one process
    expected = plain(*zero_batch()[:2])
    for _, scalars, rank_logits in four:
        torch.testing.assert_close(rank_logits, expected, rtol=0, atol=1e-5)
        assert scalars == {"step": 1.0}
    moments = checkpoint.whole(stored, "exp_avg")
    assert {name: t.shape for name, t in moments.items()} == {name: p.shape for name, p in plain.named_parameters()}
    two = run_ranks(2, _zero3_load_rank, stored, {"step": 1.0})
    for _, scalars, rank_logits in two:
        torch.testing.assert_close(rank_logits, expected, rtol=0, atol=1e-5)
        assert scalars == {"step": 1.0}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert_all_close(checkpoint.whole([pieces for pieces, _, _ in two], key), checkpoint.whole(stored, key),
                         rtol=0, atol=0)


def test_zero3_refuses_a_frozen_parameter():
    """A frozen parameter's shard would be a new leaf that requires grad, and AdamW would train it: one line instead."""
    model = GPT(ZERO_CFG)
    model.embed.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"these are frozen \(requires_grad=False\): \['embed.weight'\]"):
        zero3.ZeRO3(model, model.units())


class _Tanh(nn.Module):
    def __init__(self, as_dict=False):
        super().__init__()
        self.linear, self.as_dict = nn.Linear(6, 6), as_dict

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        return {"hidden": y} if self.as_dict else y  # a dict, as Hugging Face models return


class _Skipping(nn.Module):
    """A user's model of three units, the middle one returning a dict and skipped where use_b is False (LayerDrop)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.use_b = _Tanh(), _Tanh(as_dict=True), nn.Linear(6, 1), True

    def forward(self, x):
        x = self.a(x)
        return self.c(self.b(x)["hidden"] if self.use_b else x)


def _skipping_rank(rank, world_size, dtype):
    torch.manual_seed(0)
    reference = _Skipping().to(dtype)
    model = copy.deepcopy(reference)
    zero = zero3.ZeRO3(model, [model.a, model.b, model.c], group=dist.group.WORLD)
    optimizers = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(zero.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(2 * world_size, 6, generator=torch.Generator().manual_seed(step), dtype=dtype)
        for micro in range(2):  # b skipped in step 0's second micro-step, after a's forward prefetched it
            reference.use_b = model.use_b = (step, micro) != (0, 1)
            reference(x + micro).square().sum().backward()  # every rank's rows, in one process
            model(x[2 * rank:2 * rank + 2] + micro).square().sum().backward()  # mine
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return [(unit.shard.detach(), unit.my_shard_of(whole.parameters()))
            for unit, whole in zip(zero.units, [reference.a, reference.b, reference.c])]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.float64, 1e-14)], ids=["float32", "float64"])
def test_zero3_trains_a_unit_that_is_skipped_and_returns_a_dict(dtype, atol):
    """3 steps of SGD, 2 micro-steps each, on 2 ranks against one process: the unit skipped once keeps no stale
    prefetched copy past the update (it is gathered anew), and the unit whose output is a dict gathers for its
    backward. Each rank's shards equal its slice of the one-process model; a float64 model's are float64."""
    for rank in run_ranks(2, _skipping_rank, dtype):
        for mine, whole in rank:
            assert mine.dtype == dtype
            torch.testing.assert_close(mine, whole.to(dtype), rtol=0, atol=atol)


def _fsdp2_float64_rank(rank, world_size):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    model = copy.deepcopy(reference)
    zero3.fsdp2_shard(model, [model[0], model[2]], dist.group.WORLD)
    x = torch.randn(2 * world_size, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference(x).sum().backward()  # every rank's rows, in one process
    model(x[2 * rank:2 * rank + 2]).sum().backward()  # mine
    return [(p.grad.full_tensor(), whole.grad) for p, whole in zip(model.parameters(), reference.parameters())]


def test_fsdp2_sums_a_float64_models_gradients_in_float64():
    """fsdp2_shard on 2 ranks against one process, a float64 model: each gradient, summed over the ranks, is float64
    and equal to the one process's within float64's rounding (summed in float32 it was 1e-8 off)."""
    for mine, whole in run_ranks(2, _fsdp2_float64_rank)[0]:
        assert mine.dtype == torch.float64
        torch.testing.assert_close(mine, whole, rtol=0, atol=1e-14)
