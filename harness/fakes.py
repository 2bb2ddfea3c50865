"""
The world a traced step runs in (harness/memory.py's trace): one CPU process standing for one rank of N GPUs.

    FakeTensors          torch's fake tensors (shapes, no storage), the token data real, so that positions and
                         token indices hold values (and keep their origin, which tells equal ones apart)
    peers                what an all-gather of token data brings, which a fake process group cannot move; document
                         starts that arrive with fake activations (the context way's left contexts) taken as none
    works_hold_tensors   point-to-point works that hold their tensors, as gloo's do
    as_on_cuda           what only a GPU decides: SDPA's grouped heads, cuDNN's block kernel, the fused RMSNorm,
                         AdamW's foreach kernels
"""

import itertools
from contextlib import ExitStack, contextmanager
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.optim.adam as torch_adam
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

import deltanet
import gpt
import ring
import ulysses
from tiled import at_least_float32

aten = torch.ops.aten
origins = WeakIdKeyDictionary()  # token data -> the quantity of `peers` it was cut from or gathered into


class FakeTensors(FakeTensorMode):
    """torch's FakeTensorMode with the token data real: an op none of whose inputs is fake runs for real, and so does
    a factory of integers (arange, randint; never a mask, which may be S x S), never for the meta device (the host).
    Positions, token indices and what the ring and the context chain compute from them hold values; what a real op
    makes of one quantity of token data keeps its origin (`origins`). A number read from a fake tensor (a loss) is 1."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, dtype = kwargs or {}, (kwargs or {}).get("dtype")
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        integers = (func.overloadpacket in (aten.arange, aten.randint) if dtype is None else
                    dtype in (torch.int32, torch.int64))
        if (tensors or integers) and not any(isinstance(t, FakeTensor) for t in tensors) and \
                torch.device(kwargs.get("device") or "cpu").type != "meta":
            out, found = func(*args, **kwargs), [origins[t] for t in tensors if t in origins]
            if found and all(origin is found[0] for origin in found):  # made of one quantity: its origin too
                origins.update((t, found[0]) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DataDependentOutputException:
            return 1


@contextmanager
def peers(mesh):
    """Packed documents gather their SP group's positions (and a ring its token layout), which a fake process group
    cannot move. The traced rank draws the SP group's sequences, so it cuts every SP rank's shards as that rank would
    (its rank in each group stood in); an all-gather of integers equal to one of its own quantities returns that
    quantity of each peer, and what it makes (joined in token order) is a quantity of every rank too. Two quantities
    can be equal on this rank and not on its peers (positions and token indices of a shard inside its row's first
    document, or two micro-batches' positions), so among equal ones the all-gather takes the one its input was made
    from (`origins`)."""
    (U, u), (R, r) = (ulysses.size_and_rank(mesh.get_group(name)) for name in ("ulysses", "ring"))
    groups = {mesh.get_group("ulysses"): lambda j, a, b: (a, j), mesh.get_group("ring"): lambda j, a, b: (j, b)}
    known, get_rank, all_gather = [], dist.get_rank, dist.all_gather  # known: [{(ring rank, ulysses rank): tensor}]
    ranks = list(itertools.product(range(R), range(U)))

    def cut_for_every_rank(shard):
        def shards(*args):
            every = {}
            with _disable_current_modes():  # apart from the count: the real run holds none of them
                for a, b in ranks:
                    stand_in = {mesh.get_group("ring"): a, mesh.get_group("ulysses"): b}
                    with patch.object(dist, "get_rank", lambda group=None: stand_in.get(group, get_rank(group))):
                        every[a, b] = shard(*args)
                cuts = [{key: cut[i].clone() for key, cut in every.items()} for i in (2, 3)]  # positions, index
                known.extend(cuts)
            mine = shard(*args)
            origins[mine[2]], origins[mine[3]] = cuts
            return mine
        return shards

    def gathered(outputs, x, group=None, async_op=False):
        equal = [] if isinstance(x, FakeTensor) or x.is_floating_point() or group not in groups else [
            q for q in known if q[r, u].shape == x.shape and torch.equal(q[r, u], x)]
        if not equal:  # not token data: shapes, alike on every rank
            return all_gather(outputs, x, group=group, async_op=async_op)
        mine = next((q for q in equal if q is origins.get(x)), equal[0])  # where x came from, if known
        with _disable_current_modes():
            known.append({(a, b): torch.cat([mine[groups[group](j, a, b)] for j in range(len(outputs))], -1)
                          for a, b in ranks})
        for j, out in enumerate(outputs):
            out.copy_(mine[groups[group](j, r, u)])
            origins[out] = known[-1]
    conv = deltanet.causal_conv1d  # the context way's left contexts bring their document starts with activations

    def conv_without_starts(x, weight, starts=None):  # fake starts: one document a row, pieces of the same bytes
        with _disable_current_modes():
            real = starts if starts is None or not isinstance(starts, FakeTensor) else torch.zeros(starts.shape).bool()
        return conv(x, weight, real)
    with patch.object(ulysses, "shard_for_sp", cut_for_every_rank(ulysses.shard_for_sp)), \
            patch.object(ring, "shard_for_ring", cut_for_every_rank(ring.shard_for_ring)), \
            patch.object(dist, "all_gather", gathered), patch.object(deltanet, "causal_conv1d", conv_without_starts):
        yield


def works_hold_tensors():
    """batch_isend_irecv's works holding the tensors they send and receive while they live, as gloo's do."""
    batch_isend_irecv, held = dist.batch_isend_irecv, type("HeldWorks", (list,), {})

    def holding(ops):
        works = held(batch_isend_irecv(ops))
        works.tensors = [op.tensor for op in ops]
        return works
    return patch.object(dist, "batch_isend_irecv", holding)


@contextmanager
def as_on_cuda():
    """The step's device decisions as a GPU takes them, on CPU fake tensors: SDPA's grouped heads as on "cuda"; the
    ring's block kernel as on an H100 (cuDNN's for causal blocks); AdamW's foreach kernels for the parameters on the
    device ("cpu" here); RMSNorm as CUDA's one fused kernel (`FusedRMSNorm`)."""
    on_cuda, block_kernel = ulysses.sdpa_takes_groups, ring.block_kernel
    foreach = lambda params, differentiable, use_fused=False: (False, not differentiable and all(
        p is None or p.device.type == "cpu" for p in params))
    with ExitStack() as stack:
        stack.enter_context(patch.object(ulysses, "sdpa_takes_groups", lambda _, *rest: on_cuda("cuda", *rest)))
        stack.enter_context(patch.object(ring, "block_kernel", lambda _, *rest: block_kernel("cuda", *rest,
                                                                                            gpu=((9, 0), 91900))))
        stack.enter_context(patch.object(torch_adam, "_default_to_fused_or_foreach", foreach))
        stack.enter_context(patch.object(gpt, "rms_norm", lambda x, weight, eps=None: FusedRMSNorm.apply(
            at_least_float32(x), at_least_float32(weight)).to(x.dtype)))  # float32 statistics, x's dtype out
        yield


class FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm, its memory alone: it keeps its input and the statistic [..., 1] for backward, and makes
    its output, and in backward the two gradients (an H100 showed it)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight, x.new_empty(x.shape[:-1] + (1,)))  # the statistic, 1 / rms: (..., 1)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:2])  # of x and of weight
