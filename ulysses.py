"""
Ulysses sequence parallelism: the whole contract in one file.

Each of the P ranks of a sequence-parallel (SP) group holds S/P consecutive tokens of every sequence, with
all H attention heads. Attention needs the whole sequence, but each head is independent of the others. So one
all-to-all trades the split: afterwards every rank holds the WHOLE sequence for its share of the heads, runs
any ordinary attention kernel on it, and a second all-to-all trades back.

    rank r holds          all-to-all          rank r holds              all-to-all        rank r holds
    tokens r, all heads  ------------->  all tokens, heads r  --attn-->  ------------->  tokens r, all heads
    [B, S/P, H, D]       seq_to_heads       [B, S, H_r, D]              heads_to_seq      [B, S/P, H, D]

H_r is the number of heads rank r holds: H/P when P divides H, else H // P or one more (`head_layout`).

Each rank sends (P-1)/P of its local tensor, so the bytes each rank sends stay constant when P grows with S
(Megatron-style SP all-gathers the full activation instead). The backward of an all-to-all is the opposite
all-to-all, so training costs the same traffic again.

Four rules make training on P ranks equal to training on one device; this file holds what each one needs:
  1. shift the labels by one BEFORE sharding (the label of a shard's last token lives on the next rank): the
     caller does it, and `shard_for_sp` takes the labels shifted;
  2. pad every sequence at its end to a multiple of P, give rank r tokens [r*S/P, (r+1)*S/P), and keep the
     GLOBAL position ids of those tokens (RoPE and document boundaries need them): `shard_for_sp`;
  3. attention over the full sequence: `ulysses_attention` (everything else in a transformer is per token);
  4. divide each rank's SUM of token losses by the valid tokens of the WHOLE global batch
     (`global_valid_tokens`), and SUM the gradients over all ranks, data- and sequence-parallel alike (the
     caller's gradient reduction: an all-reduce, or ZeRO-3's reduce-scatter, with SUM, never an average).

The file reads down the call path. First comes the all-to-all of one tensor: the idea, whole. Then comes
`ulysses_attention`, and what it calls in that order: the head layout, seq_to_heads and heads_to_seq, and the
exchange that moves q, k and v in one call. Then `attention_layer`, the whole layer a model calls (gpt.py does):
its projections write the message and read what comes back, so nothing is copied around the all-to-alls. Then
the attention kernels, and the batch and the loss (rules 1, 2
and 4). The plumbing comes last: what torch.compile sees of the exchange, the byte counts, and the wait that lets
a script exit cleanly. It depends on torch alone (2.5 or later; shard_for_sp on ring.py for a ring's layouts): copy
it into your own project. `python bench.py
attention` measures it.
"""

import operator
import sys
import time
import warnings
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.distributed_c10d import _resolve_process_group  # a group's name -> the group

try:  # optional, CUDA only: flash-attn's kernels take the [B, S, H, D] layout as it is (2.7 or later)
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    FLASH_ATTN_VERSION = tuple(int(n) for n in flash_attn.__version__.split(".")[:2])  # e.g. (2, 8)
except ImportError:
    flash_attn_func = flash_attn_varlen_func = FLASH_ATTN_VERSION = None


# ----------------------------------------------------------------------------------------------------------------
# the all-to-all of one tensor: H/P heads a rank
#
# For seq_to_heads on P = 2 (t0, t1: the two halves of the sequence; h0, h1: the heads of ranks 0 and 1):
#
#     rank 0 holds  x[t0, h0 h1]   sends x[t0, h1] to rank 1   receives x[t1, h0]   joins x[t0 t1, h0]
#     rank 1 holds  x[t1, h0 h1]   sends x[t1, h0] to rank 0   receives x[t0, h1]   joins x[t0 t1, h1]
#
# heads_to_seq is the same exchange with the roles of the two dimensions swapped. Why the result is exact: rank i's
# piece lands at place i, and rank i holds the i-th stretch of the sequence, so the joined tokens are in order.
#
# This version is here to be read (and `python bench.py attention` runs it as DeepSpeed's three all-to-alls).
# ulysses_attention runs the same exchange generalized, in the next section.


def all_to_all(x, group, scatter_dim, gather_dim):
    """The textbook all-to-all of one tensor, differentiable: x cut into P equal pieces along scatter_dim, piece
    j sent to rank j, the pieces received joined along gather_dim. all_to_all(x, group, 2, 1) takes [B, S/P, H,
    D] to [B, S, H/P, D]; all_to_all(y, group, 1, 2) takes it back. One copy before the collective and one after
    it, one of the two free when B = 1. group=None or a group of one rank: x itself."""
    if size_and_rank(group)[0] == 1:
        return x
    return _OneTensorAllToAll.apply(x, group, scatter_dim, gather_dim)


class _OneTensorAllToAll(torch.autograd.Function):
    """The gradient of each piece a rank received belongs to the rank that sent it: the backward of an
    all-to-all is the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.reverse = (group, gather_dim, scatter_dim)
        return _one_tensor_exchange(x, group, scatter_dim, gather_dim, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _one_tensor_exchange(grad, *ctx.reverse, "backward"), None, None, None


def _one_tensor_exchange(x, group, scatter_dim, gather_dim, direction):
    """Cut x into P equal pieces along scatter_dim, send piece j to rank j, and join the P pieces received
    along gather_dim, rank i's at place i. The shape comments follow seq_to_heads (scatter 2, gather 1), with
    H/P the heads of each rank."""
    P = dist.get_world_size(group)
    send = x.unflatten(scatter_dim, (P, -1)).movedim(scatter_dim, 0)  # (B, S/P, H, D) -> (P, B, S/P, H/P, D)
    # one copy: row j, my tokens of rank j's heads, goes to rank j; row i of what comes back is rank i's tokens
    received = _all_to_all(send.contiguous(), group, direction)  # (P, B, S/P, H/P, D), my heads
    joined = received.movedim(0, gather_dim)  # (P, B, S/P, H/P, D) -> (B, P, S/P, H/P, D)
    return joined.flatten(gather_dim, gather_dim + 1)  # -> (B, S, H/P, D), a copy unless B = 1


def _all_to_all(send, group, direction):
    """Row j of send [P, ...] goes to rank j; row i of what returns came from rank i. One call, no copy."""
    received = torch.empty_like(send)
    with _gloo_lets_go(received, send):
        dist.all_to_all_single(received, send, group=group)
    _count(direction, send.nbytes // len(send) * (len(send) - 1))  # row `rank` stays here
    return received


# ----------------------------------------------------------------------------------------------------------------
# rule 3: attention over the full sequence


def ulysses_attention(q, k, v, group=None, attn_fn=None, check=True, sinks=None, **attn_kwargs):
    """Attention over the full sequence when each rank holds S/P tokens.

    q [B, S/P, Hq, D], k and v [B, S/P, Hkv, D] -> [B, S/P, Hq, D]. attn_fn(q, k, v, **attn_kwargs) sees the
    full sequence in the same layout, [B, S, heads, D], for this rank's heads (head_layout, below): hq query
    heads and hkv key/value heads, query head i using kv head i // (hq / hkv), as grouped-query kernels take
    them. It defaults to causal attention; sliding_window_attention takes window=..., document_attention the
    position ids of the FULL sequence: ulysses_attention(q, k, v, group, document_attention,
    position_ids=gather_sequence(position_ids, group)). ring.ring_attention over a ring group makes it Ulysses x
    Ring. group=None or a group of one rank runs attn_fn directly. q, k and v travel in one all-to-all (the
    exchange of the previous section, generalized below) and the output in one more; backward the same.
    check: first make sure every rank passes the same shapes and dtype (`check_inputs`; off while compiling).
    sinks [Hq]: attention sinks, a learned logit per query head (gpt-oss); attn_fn gets those of this rank's query
    heads as sinks=..., so it must take them (ring.ring_attention does, with group=None alone), and their gradient
    holds this rank's heads only, to be summed over the ranks as every gradient is (rule 4).
    """
    check_sinks(sinks, attn_fn, q.shape[2], "ulysses_attention")
    attn_fn = attn_fn or causal_attention
    P, rank = size_and_rank(group)
    if P == 1:
        return attn_fn(q, k, v, **attn_kwargs) if sinks is None else attn_fn(q, k, v, sinks=sinks, **attn_kwargs)
    if check and not torch.compiler.is_compiling():
        check_inputs(q, k, v, group)
    # operator.index: plain ints even when torch.compile makes sizes symbolic (dynamic=True), so that the head
    # layout is fixed in the graph (one graph per head count) and only the sequence length stays symbolic
    n_head, n_kv_head = operator.index(q.shape[2]), operator.index(k.shape[2])
    query_heads, kv_heads = head_layout(n_head, n_kv_head, P)
    if sinks is not None:  # my kernel gets the sinks of the query heads I hold
        attn_kwargs["sinks"] = sinks[query_heads[rank].start:query_heads[rank].stop]  # (Hq,) -> (hq,)
    q, k, v = seq_to_heads((q, k, v), group, (query_heads, kv_heads, kv_heads))  # (B, S, hq, D), (B, S, hkv, D) x2
    uses = kernel_kv_heads(n_head, n_kv_head, P, rank)  # the kv heads my kernel gets, of those I hold
    if uses != list(range(len(kv_heads[rank]))):  # not mine as they are: one per query head, by indexing
        k, v = (t.transpose(1, 2)[:, uses].transpose(1, 2) for t in (k, v))  # (B, S, hkv, D) -> (B, S, hq, D)
    return heads_to_seq(attn_fn(q, k, v, **attn_kwargs), group, query_heads)  # (B, S/P, Hq, D)


def head_layout(n_head, n_kv_head, P):
    """The heads each rank of an SP group of P holds between the two all-to-alls: (query_heads, kv_heads), two
    lists of P ranges. Any P <= n_head works, with any n_kv_head that divides n_head.

    Query heads go out in contiguous runs, as even as possible: the first n_head % P ranks get one more. Each
    rank gets exactly the key/value heads its query heads use (query head h uses kv head h // (n_head /
    n_kv_head)), so a kv head whose query heads land on several ranks is sent to each of them, and no rank gets
    one it does not use. For 6 query heads, 2 kv heads and P = 4:

        query heads    0 1 | 2 3 | 4 | 5        6 % 4 = 2: ranks 0 and 1 hold two heads, ranks 2 and 3 one
        kv head used   0 0 | 0 1 | 1 | 1        query head h uses kv head h // 3
        rank             0 |   1 | 2 | 3
        kv heads held    0 | 0 1 | 1 | 1        kv head 0 goes to ranks 0 and 1, kv head 1 to ranks 1, 2, 3

    With P dividing n_head and n_kv_head this is the plain even split; with P dividing n_head and a multiple of
    n_kv_head every rank gets one kv head (replication); and in every case the all-to-all sends exactly these
    heads.
    """
    if n_head % n_kv_head:
        divisors = ", ".join(str(d) for d in range(1, n_head + 1) if n_head % d == 0)
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}; choose n_kv_head in "
                         f"{{{divisors}}}")
    if P > n_head:
        valid = ", ".join(map(str, range(1, n_head + 1))) if n_head <= 8 else f"1, 2, ..., {n_head}"
        raise ValueError(f"sp={P} is larger than n_head={n_head}: a rank would hold no head; choose sp in {{{valid}}}")
    per_kv = n_head // n_kv_head  # query heads per kv head
    base, extra = divmod(n_head, P)
    starts = [r * base + min(r, extra) for r in range(P + 1)]
    query_heads = [range(a, b) for a, b in zip(starts, starts[1:])]
    kv_heads = [range(q.start // per_kv, (q.stop - 1) // per_kv + 1) for q in query_heads]
    return query_heads, kv_heads


def kernel_kv_heads(n_head, n_kv_head, P, rank):
    """The kv heads rank `rank`'s kernel gets, in order, as indices into the kv heads the rank holds. Kernels with
    grouped-query attention take query head i to use kv head i // (hq / hkv): where the rank's heads pair that
    way, the kernel gets every kv head the rank holds, as it is, [0, 1, ..., hkv - 1]. Where they do not (8
    heads, 2 kv heads, sp 3: the middle rank holds query heads 3, 4, 5, which use kv heads 0, 1, 1), it gets one
    kv head per query head ([0, 1, 1]), k and v expanded after the all-to-all, never on the wire."""
    query_heads, kv_heads = head_layout(n_head, n_kv_head, P)
    hq, hkv = len(query_heads[rank]), len(kv_heads[rank])
    uses = [h // (n_head // n_kv_head) - kv_heads[rank].start for h in query_heads[rank]]  # each query head's kv head
    grouped = hq % hkv == 0 and uses == [i // (hq // hkv) for i in range(hq)]  # as the kernel would pair them
    return list(range(hkv)) if grouped else uses


# ----------------------------------------------------------------------------------------------------------------
# the all-to-all generalized: any head count, and q, k and v in ONE call
#
# One all_to_all_single can move several tensors, each cut along its own ranges (uneven heads, kv heads sent to
# several ranks), with one copy on the way in and one on the way out. seq_to_heads of q, k, v on rank 0 of P = 2:
#
#     send buffer      [ q[t0,h1] | k[t0,h1] | v[t0,h1] ]      one copy in, already in send order
#     receive buffer   [ q[t1,h0] | k[t1,h0] | v[t1,h0] ]      the send buffer is freed once it has gone
#     q [B, S, h0, D] = [ q[t0,h0] ; q[t1,h0] ]                one copy out, into head-major memory
#
# What stays on this rank, q[t0,h0] and the like, never enters the buffers: it goes straight from the input
# into the output. A tensor of all tokens (q, k, v here, the output's gradient in backward) is stored
# head-major, [B, H_r, S, D] in memory, and handed on with [B, S, H_r, D] shape: SDPA reads that memory as it is.


def seq_to_heads(x, group, heads=None):
    """[B, S/P, H, D] (my tokens, all heads) -> [B, S, H_r, D] (all tokens, my heads), where heads[r] is the
    range of heads rank r receives (default: H/P each, in rank order; head_layout gives uneven splits). x may
    be a tuple of tensors with one heads list each: they all travel in ONE all-to-all. Differentiable (its
    backward is heads_to_seq) and traceable by torch.compile."""
    return _exchange(x, group, heads, to_heads=True)


def heads_to_seq(x, group, heads=None):
    """[B, S, H_r, D] (all tokens, my heads) -> [B, S/P, H, D] (my tokens, all heads): the inverse of
    seq_to_heads, with the same heads. Differentiable; its backward is seq_to_heads."""
    return _exchange(x, group, heads, to_heads=False)


def _exchange(x, group, heads, to_heads):
    """seq_to_heads or heads_to_seq of a tensor or a tuple of tensors (then in one collective call)."""
    P, rank = size_and_rank(group)
    if P == 1:
        return x
    single = torch.is_tensor(x)
    tensors = [x] if single else list(x)
    if len({(t.dtype, t.device) for t in tensors}) > 1:  # they share one buffer
        raise ValueError(f"tensors that travel in one all-to-all must share dtype and device; got "
                         f"{[(t.dtype, str(t.device)) for t in tensors]}")
    if heads is None:  # one tensor, H/P heads a rank
        if not single:
            raise ValueError("several tensors in one all-to-all need heads: one list of P ranges each (head_layout)")
        H = tensors[0].shape[2] * (1 if to_heads else P)
        if H % P:
            raise ValueError(f"{H} heads do not split evenly over {P} ranks: pass heads=head_layout(...)[0]")
        heads = head_layout(H, 1, P)[0]
    heads = [heads] if single else list(heads)
    bounds = [b for ranges in heads for r in ranges for b in (r.start, r.stop)]  # flat, as an operator takes them
    out = _exchange_op(tensors, bounds, to_heads, group.group_name, rank, "forward")
    return out[0] if single else tuple(out)


@torch.library.custom_op("ulysses::exchange", mutates_args=())
def _exchange_op(tensors: list[torch.Tensor], head_bounds: list[int], to_heads: bool, group_name: str, rank: int,
                 direction: str) -> list[torch.Tensor]:
    """seq_to_heads (to_heads) or heads_to_seq of several tensors, all in ONE collective call; returns the joined
    tensors. Each tensor is cut into P blocks, one per rank, and block j goes to rank j. On the way to heads a
    tensor is cut by heads (rank j's range of that tensor's heads) and what arrives from rank i is placed by
    tokens (rank i's stretch of the sequence); on the way back, the other way round. A place that several ranks
    fill (on its way back, a kv head that had gone to several ranks) receives their sum.

    It is an operator of its own (torch.library.custom_op), so that torch.compile traces a model through it
    without a break: the compiler sees one call, with the shapes and the backward given at the end of the file.
    The group travels by name, never as an object: nothing the autograd graph keeps holds on to it. The shape
    comments follow seq_to_heads, with H_j the heads of rank j."""
    group = _resolve_process_group(group_name)
    P = dist.get_world_size(group)
    heads = _head_ranges(head_bounds, len(tensors))  # heads[k][j]: the heads of tensor k that rank j holds
    S_local = tensors[0].shape[1] // (1 if to_heads else P)
    tokens = [range(j * S_local, (j + 1) * S_local) for j in range(P)]  # rank j's stretch of the sequence
    cut_dim, place_dim = (2, 1) if to_heads else (1, 2)  # heads then tokens, or tokens then heads

    def block(x, k, j, dim):  # the part of tensor k (x: an input or an output) that belongs to rank j along dim
        ranges = heads[k] if dim == 2 else tokens
        return x.narrow(dim, ranges[j].start, len(ranges[j]))

    def elements(k, i):  # of tensor k in the block rank i sends me: to heads, my heads; back, rank i's
        B, _, _, D = tensors[k].shape
        return B * S_local * len(heads[k][rank if to_heads else i]) * D

    # 1. one copy into the send buffer: for each other rank, one block of each tensor; my own blocks stay put
    others = [j for j in range(P) if j != rank]
    outgoing = [block(x, k, j, cut_dim) for j in others for k, x in enumerate(tensors)]  # (B, S/P, H_j, D) each
    send_buffer = tensors[0].new_empty(sum(b.numel() for b in outgoing))  # flat
    for slot, b in zip(send_buffer.split([b.numel() for b in outgoing]), outgoing):
        slot.view(b.shape).copy_(b)
    # 2. one collective: rank i's blocks arrive in the same order, tensor by tensor
    incoming = [elements(k, i) for i in others for k in range(len(tensors))]
    receive_buffer = send_buffer.new_empty(sum(incoming))  # flat
    with _gloo_lets_go(receive_buffer, send_buffer):
        dist.all_to_all_single(receive_buffer, send_buffer, _by_rank(incoming, rank, P),
                               _by_rank([b.numel() for b in outgoing], rank, P), group=group)
    _count(direction, send_buffer.nbytes)
    # The send buffer is done with (gloo has sent it when the call returns; on CUDA the memory is reused only by
    # later work on the same stream), so its memory goes now, before the outputs are made: the two never
    # coexist. Resized rather than just dropped, because on CUDA the backend may still hold a reference.
    send_buffer.untyped_storage().resize_(0)
    # 3. one copy out of the receive buffer, and out of my own blocks, into the joined tensors
    joined = [_joined(x, heads[k], to_heads, P, rank) for k, x in enumerate(tensors)]  # (B, S, H_rank, D)
    summed = [not to_heads and any(a.stop > b.start for a, b in zip(h, h[1:])) for h in heads]  # shared kv heads
    for out, zeroed in zip(joined, summed):
        if zeroed:
            out.zero_()
    arrived = iter(receive_buffer.split(incoming))  # flat blocks, rank by rank, tensor by tensor, as they were sent
    for i in range(P):
        for k, (x, out) in enumerate(zip(tensors, joined)):
            place = block(out, k, i, place_dim)  # (B, S/P, H_rank, D): rank i's tokens of my heads
            b = block(x, k, rank, cut_dim) if i == rank else next(arrived).view(place.shape)  # flat -> place's
            (place.add_ if summed[k] else place.copy_)(b)
    return joined


def _by_rank(sizes, me, P):
    """Split sizes for all_to_all_single: sizes lists n blocks for each rank but me, in rank order; each rank gets
    the sum of its n, and I get 0 (my own blocks never enter the buffers)."""
    n = len(sizes) // (P - 1)
    sums = [sum(sizes[m * n:(m + 1) * n]) for m in range(P - 1)]
    return sums[:me] + [0] + sums[me:]


def _head_ranges(bounds, n_tensors):
    """[start0, stop0, start1, stop1, ...] -> per tensor, one range per rank (an operator takes flat int lists)."""
    pairs = [range(a, b) for a, b in zip(bounds[::2], bounds[1::2])]
    P = len(pairs) // n_tensors
    return [pairs[k * P:(k + 1) * P] for k in range(n_tensors)]


def _joined(t, heads, to_heads, P, me):
    """An empty tensor for what t's exchange joins on this rank: [B, S, len(heads[me]), D] (all tokens, stored
    head-major) or [B, S/P, all heads, D]. Built the same way for the exchange and for torch.compile's tracing,
    so the two agree on shape and memory layout."""
    B, S_in, H, D = t.shape  # S_in: S/P tokens on the way to heads, all S on the way back
    if to_heads:  # head-major memory, [B, heads, S, D], read as [B, S, heads, D]
        return torch.empty_permuted((B, S_in * P, len(heads[me]), D), (0, 2, 1, 3), dtype=t.dtype, device=t.device)
    return t.new_empty(B, S_in // P, heads[-1].stop, D)


# ----------------------------------------------------------------------------------------------------------------
# the attention layer: projections that write the message and read what comes back
#
# ulysses_attention takes q, k and v as a model made them, so it copies them into a send buffer, and what it
# receives into the layout its caller wants. A model's attention layer can do without both copies, by writing
# each step's result where the next step reads it. For P = 2 on rank 0, one sequence (t0, t1: the two halves of
# the sequence; h0, h1: the heads of ranks 0 and 1; q k v: a rank's q, k and v heads side by side, n of them):
#
#     send[j] = x @ (W's rows of rank j's heads)^T         [P, S/P, n, D]   the qkv projection writes it, row by
#                                                                           row; RoPE turns q and k there
#     send    [ qkv(t0, h0) | qkv(t0, h1) ]   all-to-all   received [ qkv(t0, h0) | qkv(t1, h0) ]   [S, n, D]
#     q, k, v = received[:, :hq], received[:, hq:hq+hkv], received[:, hq+hkv:]   views, the tokens in order
#     y = attn_fn(q, k, v)                                  [S, hq, D]      token-major, as kernels return it
#     y, its rows by rank   all-to-all   received [ y(t0, h0) | y(t0, h1) ]    y is the send buffer as it is
#     out = sum over ranks i of received[i] @ (W_out's columns of rank i's heads)^T    [S/P, E]
#
# Backward is the same picture reversed: the output projection's backward writes the send buffer row by row; the
# kernel's gradients of q, k and v travel as the kernel returns them, in one call each (one call would need them
# joined in one buffer, a copy of every byte); the qkv projection's backward reads them where they land. Nothing
# is copied outside the collectives, either way, with a kernel that returns token-major tensors (as SDPA does).
# This needs every rank to hold as many heads as every other, each of its query heads paired with its kv heads as a
# kernel pairs them: P divides n_head, and P divides n_kv_head or is a multiple of it. In the second case each rank
# gets one kv head, which several ranks share: every rank computes that head's projection of its tokens once for
# each rank that receives it (the kv projection made P / n_kv_head times over, small beside attention at long
# lengths; copying it would break the picture), and the weight's gradient there is the sum of what those ranks
# send back. It also needs one sequence a rank (B = 1, the long-sequence case). Anything else, and a layer being
# compiled, runs as plain matmuls around ulysses_attention.


def rope_cos_sin(position_ids, head_dim, base):
    """position_ids [B, S] (global positions) -> cos, sin [B, S, 1, head_dim] for rotate-half RoPE."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq  # (B, S, D/2)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # (B, S, 1, D)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x [B, S, H, D]: rotate each pair (x_i, x_{i+D/2}) by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def attention_layer(x, qkv_weight, out_weight, n_head, n_kv_head, group=None, attn_fn=None, cos=None, sin=None,
                    check=True, sinks=None, **attn_kwargs):
    """A transformer's attention layer when each rank holds S/P tokens: x [B, S/P, E] -> [B, S/P, E]. It computes
    the heads of x @ qkv_weight^T (its rows: q's, then k's, then v's, as one nn.Linear holds them), RoPE on q and k
    by cos and sin [B, S/P, 1, D] (rope_cos_sin's, at my tokens' global positions; None: no RoPE), attn_fn over the
    full sequence with sinks and attn_kwargs (as ulysses_attention runs it), and the result @ out_weight^T
    ([E, n_head D]). Under autocast the matmuls run in its dtype, as nn.Linear's would. group=None or a group of
    one rank: no communication. check: first make sure every rank holds a batch of the same [B, S/P] (`check_shards`,
    one all-gather; q, k and v follow from that and the layer's own arguments); a model that checks once a forward,
    as gpt.py does, passes check=False to its layers."""
    check_sinks(sinks, attn_fn, n_head, "attention_layer")
    attn_fn = attn_fn or causal_attention
    (P, rank), (B, S_local) = size_and_rank(group), x.shape[:2]
    D = qkv_weight.shape[0] // (n_head + 2 * n_kv_head)
    if torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float64:  # the casts F.linear would make
        x, qkv_weight, out_weight = (t.to(torch.get_autocast_dtype(x.device.type)) for t in (x, qkv_weight, out_weight))
    if P > 1 and check and not torch.compiler.is_compiling():
        check_shards(x, group)  # every rank takes the same path below (or every rank raises)
    if P == 1 or B > 1 or n_head % P or (n_kv_head % P and P % n_kv_head) or torch.compiler.is_compiling():
        q, k, v = F.linear(x, qkv_weight).view(B, S_local, -1, D).split([n_head, n_kv_head, n_kv_head], 2)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, S/P, heads, D)
        y = ulysses_attention(q, k, v, group, attn_fn, check=False, sinks=sinks, **attn_kwargs)  # (B, S/P, n_head, D)
        return F.linear(y.flatten(2), out_weight)  # (B, S/P, E)
    layout = head_layout(n_head, n_kv_head, P)  # (query heads, kv heads): P ranges each, of equal lengths here
    if sinks is not None:  # my kernel gets the sinks of my query heads
        attn_kwargs["sinks"] = sinks[layout[0][rank].start:layout[0][rank].stop]  # (n_head,) -> (hq,)
    q, k, v = _ProjectAndSend.apply(x.flatten(0, 1), qkv_weight, cos, sin, layout, group)  # (1, S, h, D) x 3
    y = attn_fn(q, k, v, **attn_kwargs)  # (1, S, hq, D)
    return _SendAndProject.apply(y, out_weight, group).unsqueeze(0)  # (S/P, E) -> (1, S/P, E)


class _ProjectAndSend(torch.autograd.Function):
    """x [S/P, E] -> q, k, v [1, S, h, D]: the qkv projection into the send buffer, RoPE there, the all-to-all,
    and the receive buffer's views. Backward: dq, dk and dv sent as they are, and the projection's backward read
    from where they land."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, layout, group):
        P = dist.get_world_size(group)
        ctx.save_for_backward(x, weight, cos, sin)
        D = weight.shape[0] // (layout[0][-1].stop + 2 * layout[1][-1].stop)  # the head size
        ctx.layout, ctx.D, ctx.group_name = layout, D, group.group_name  # the name: the graph holds no group
        head_counts = [len(layout[0][0]), len(layout[1][0]), len(layout[1][0])]  # a rank's q, k and v heads
        starts = [sum(head_counts[:t]) for t in range(4)]  # where q, k and v start in a rank's n heads, and n
        send = x.new_empty(P, x.shape[0], starts[3], D)  # (P, S/P, n, D)
        for j, t, _, rows in _rows_by_rank(weight, layout, D):
            torch.mm(x, rows.T, out=send[j, :, starts[t]:starts[t + 1]].flatten(1))  # (S/P, E) @ (E, h D), in place
        if cos is not None:  # q and k: the first hq + hkv heads of each row
            _rotate_([send[:, :, :starts[2]]], cos, sin)
        received = _all_to_all(send, group, "forward")  # (P, S/P, n, D): rank i's tokens of my heads, by rank
        return received.flatten(0, 1)[None].split(head_counts, dim=2)  # (1, S, n, D) -> (1, S, h, D) x 3, views

    @staticmethod
    @once_differentiable  # it writes into buffers autograd does not see
    def backward(ctx, *grads):
        x, weight, cos, sin = ctx.saved_tensors
        group = _resolve_process_group(ctx.group_name)
        P = dist.get_world_size(group)
        # the gradients of what I sent: row j of each is rank j's heads of my tokens, (P, S/P, h, D)
        sent_back = [_all_to_all(g.contiguous().unflatten(1, (P, -1))[0], group, "backward") for g in grads]
        if cos is not None:  # RoPE's backward on q's and k's: the inverse turn
            _rotate_(sent_back[:2], cos, sin, turn=-1)
        blocks = list(_rows_by_rank(weight, ctx.layout, ctx.D))
        # dx = the sum of (S/P, h D) @ (h D, E) over the blocks, (S/P, E)
        dx = _sum_of_products([(sent_back[t][j].flatten(1), rows) for j, t, _, rows in blocks], torch.empty_like(x))
        # each block's rows of the weight's gradient, (h D, S/P) @ (S/P, E), in place; the rows of a kv head that
        # several ranks received get the sum of what each sent back
        dweight = torch.empty_like(weight)  # ((n_head + 2 n_kv_head) D, E)
        sums = {}  # (q, k or v, its first head) -> (the gradient's rows, the products that add up to them)
        for j, t, heads, d_rows in _rows_by_rank(dweight, ctx.layout, ctx.D):
            sums.setdefault((t, heads.start), (d_rows, []))[1].append((sent_back[t][j].flatten(1).T, x))
        for d_rows, products in sums.values():
            _sum_of_products(products, d_rows)
        return dx, dweight, None, None, None, None


def _rows_by_rank(weight, layout, D):
    """(j, t, heads, rows) for each rank j and each of q, k, v (t = 0, 1, 2): rank j's heads of it (a range) and
    the rows of the qkv weight [(n_head + 2 n_kv_head) D, E] that make them, [h D, E], a view. layout: head_layout's
    (query heads, kv heads); ranks that share a kv head get the same rows."""
    query_heads, kv_heads = layout
    parts = weight.split([query_heads[-1].stop * D, kv_heads[-1].stop * D, kv_heads[-1].stop * D])  # q's, k's, v's
    for j in range(len(query_heads)):
        for t, (part, heads) in enumerate(zip(parts, (query_heads[j], kv_heads[j], kv_heads[j]))):
            yield j, t, heads, part[heads.start * D:heads.stop * D]


class _SendAndProject(torch.autograd.Function):
    """y [1, S, hq, D] -> [S/P, E]: y sent to the ranks whose tokens it holds, and the output projection of the
    blocks as they come. Backward: the projection's backward written into the send buffer, and the all-to-all."""

    @staticmethod
    def forward(ctx, y, weight, group):
        P = dist.get_world_size(group)
        # (1, S, hq, D) -> (P, S/P, hq D): row i for rank i, y as it is (a copy only if the kernel's output is not
        # token-major, as SDPA's is)
        send = y.contiguous().view(P, -1, y.shape[2] * y.shape[3])
        received = _all_to_all(send, group, "forward")  # row i: my tokens of rank i's heads
        ctx.save_for_backward(received, weight)
        ctx.group_name, ctx.y_shape = group.group_name, y.shape
        columns = weight.chunk(P, dim=1)  # rank i's heads' columns, (E, hq D) each
        out = y.new_empty(received.shape[1], weight.shape[0])  # (S/P, E)
        return _sum_of_products([(received[i], columns[i].T) for i in range(P)], out)  # (S/P, hq D) @ (hq D, E)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        received, weight = ctx.saved_tensors
        P = len(received)
        send, dweight = torch.empty_like(received), torch.empty_like(weight)  # (P, S/P, hq D), (E, n_head D)
        for i, (columns, d_columns) in enumerate(zip(weight.chunk(P, dim=1), dweight.chunk(P, dim=1))):
            torch.mm(grad, columns, out=send[i])  # (S/P, E) @ (E, hq D): row i, for rank i's heads
            torch.mm(grad.T, received[i], out=d_columns)  # (E, S/P) @ (S/P, hq D), in place
        dy = _all_to_all(send, _resolve_process_group(ctx.group_name), "backward")  # row i: rank i's tokens
        return dy.view(ctx.y_shape), dweight, None  # (P, S/P, hq D) -> (1, S, hq, D)


def _sum_of_products(products, out):
    """out = the sum of a @ b over products, [(a, b), ...], written into out. In bf16 or fp16 each product comes
    out of its matmul rounded, as a matmul rounds; they are added in float32 and the sum rounded once (adding into
    out itself would round the running sum once a product too, and the error would grow with P)."""
    if out.dtype in (torch.float32, torch.float64) or len(products) == 1:
        torch.mm(*products[0], out=out)
        for a, b in products[1:]:
            out.addmm_(a, b)
        return out
    # rows at a time, in few matmuls: an eighth of out's, but at least 256 and at most 2^24 elements, so that the
    # float32 sum takes at most 64 MiB, and a quarter of out's bytes when out has 2,048 rows or more
    n = max(256, min(-(-len(out) // 8), 2**24 // out.shape[1]))
    for rows in range(0, len(out), n):
        total = torch.zeros(out[rows:rows + n].shape, dtype=torch.float32, device=out.device)  # (n, E)
        for a, b in products[:-1]:
            total.add_(a[rows:rows + n] @ b)
        last = products[-1][0][rows:rows + n] @ products[-1][1]
        torch.add(total, last, out=out[rows:rows + n])  # rounded once, into out's dtype
    return out


def _rotate_(buffers, cos, sin, turn=1):
    """apply_rope in place, on buffers autograd does not see, each [..., S/P, heads, D]; cos and sin are
    rope_cos_sin's tables [1, S/P, 1, D]. turn=-1: the inverse turn, RoPE's backward. The tables' first halves (the
    halves repeat) are cast to the buffers' dtype first: a float32 table would make each in-place op on a bf16
    buffer round through a copy of its own."""
    c, s = (t[0].chunk(2, dim=-1)[0].to(buffers[0].dtype) for t in (cos, sin))  # (S/P, 1, D/2) each
    for x in buffers:
        x1, x2 = x.chunk(2, dim=-1)
        x1_sin = x1 * s
        x1.mul_(c).addcmul_(x2, s, value=-turn)  # x1 cos - x2 sin
        x2.mul_(c).add_(x1_sin, alpha=turn)  # x2 cos + x1 sin


# ----------------------------------------------------------------------------------------------------------------
# attention kernels: any function of full-sequence q, k, v [B, S, heads, D] can run between the all-to-alls
#
# Two libraries compute them: flash-attn where it runs (`use_flash_attn`), PyTorch's SDPA everywhere else. Each
# choice is a function of what decides it (device type, dtype, head size, a mask, the library's version), so that a
# test on a machine without a GPU can ask what a GPU would run, and run it through a stand-in with the kernel's
# contract (test_kernels.py).


def causal_attention(q, k, v):
    """Default kernel. q [B, S, Hq, D], k and v [B, S, Hkv, D] with Hq a multiple of Hkv -> [B, S, Hq, D]."""
    if use_flash_attn(q.device.type, q.dtype, q.shape[-1]):
        return flash_attn_func(q, k, v, causal=True)
    return _sdpa(q, k, v, is_causal=True)


def use_flash_attn(device_type, dtype, head_dim, flash_attn_version=FLASH_ATTN_VERSION):
    """Whether flash-attn runs: installed (2.7 or later), on CUDA, for fp16 or bf16 and head sizes up to 256. Its
    public calls, used here, pad a head size to a multiple of 8 and hand the output back unpadded, as a view."""
    return (flash_attn_version is not None and flash_attn_version >= (2, 7) and device_type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256)


def _sdpa(q, k, v, attn_mask=None, is_causal=False):
    """PyTorch's SDPA on [B, S, heads, D] tensors, grouped-query attention as it is where SDPA runs that in a fused
    kernel (`sdpa_takes_groups`); elsewhere k and v go in expanded to one head per query head."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D), SDPA's layout
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not sdpa_takes_groups(q.device.type, q.dtype, attn_mask is not None, q.shape[-1]):
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # (B, Hkv, S, D) -> (B, Hq, S, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)  # (B, H, S, D) -> (B, S, H, D)


def sdpa_takes_groups(device_type, dtype, masked, head_dim):
    """Whether SDPA runs grouped-query attention (fewer kv heads than query heads) in a fused kernel. On CPU it
    does. On CUDA only its flash kernel does, for fp16 and bf16 without a mask and heads of at most 256; float32, a
    mask or larger heads send it to the math kernel, which holds every score, [B, Hq, S, S] (an H100 with torch
    2.11: 82 MiB for 32 MiB of float32 scores), so there k and v are expanded first, and the memory-efficient
    kernel takes them."""
    return device_type == "cpu" or (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not masked
                                    and head_dim <= 256)


def sliding_window_attention(q, k, v, window):
    """Sliding-window causal attention: token i sees tokens i-window+1 .. i. Same layout as causal_attention.
    It is not dense causal attention, yet ulysses_attention runs it unchanged: the wrapper only moves heads. Without
    flash-attn SDPA takes the window as an [S, S] mask, which it keeps for backward in q's dtype (4 bytes a
    query-key pair in float32, 2 in bf16), and computes every pair (the ring's tiles, ring.ring_attention(q, k, v,
    window=...), hold a query tile's scores at most)."""
    if use_flash_attn(q.device.type, q.dtype, q.shape[-1]):
        return flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0))
    S = q.shape[1]
    visible = torch.ones(S, S, dtype=torch.bool, device=q.device).tril_().triu_(1 - window)  # (S, S): key j <= i
    return _sdpa(q, k, v, attn_mask=visible)  # and j > i - window


def document_attention(q, k, v, position_ids, window=None):
    """Causal (or sliding-window) attention inside each document of a packed sequence, never across documents.
    position_ids [B, S] are the positions of the FULL sequence; a document starts wherever they are 0. On CUDA
    with flash-attn one variable-length kernel call covers all documents; otherwise SDPA runs per document,
    so memory grows with the longest document, never as S^2 (with a window, each document's [n, n] mask is kept
    for backward)."""
    B, S, Hq, D = q.shape
    cu_seqlens = document_bounds(position_ids == 0)  # (documents + 1,)
    if use_flash_attn(q.device.type, q.dtype, D):
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # (B*S, heads, D): the batch as one long token stream
        cu_seqlens = cu_seqlens.to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True,
                                     window_size=(window - 1, 0) if window else (-1, -1))
        return out.view(B, S, Hq, D)
    # every row starts a document, so none crosses rows: each is attended where it lies, as a view
    bounds = cu_seqlens.tolist()
    documents = [(s // S, s % S, e - s) for s, e in zip(bounds[:-1], bounds[1:])]  # (row, first token, length)
    kernel = partial(sliding_window_attention, window=window) if window else causal_attention
    out = [kernel(*(t[b:b + 1, i:i + n] for t in (q, k, v))) for b, i, n in documents]  # (1, n, Hq, D) each
    return torch.cat(out, dim=1).view(B, S, Hq, D)  # (1, B*S, Hq, D) -> (B, S, Hq, D)


def document_bounds(starts):
    """starts [B, S], True where a document starts -> where each document of the batch, seen as one stream of
    B*S tokens, begins (every row begins one too), followed by B*S: flash-attn's cu_seqlens."""
    B, S = starts.shape
    starts = starts.flatten().clone()  # (B*S,)
    starts[::S] = True
    return torch.cat([starts.nonzero().flatten(), torch.tensor([B * S], device=starts.device)])  # (documents + 1,)


def gather_sequence(x, group):
    """[B, S/P] -> [B, S]: all-gather a small per-token tensor (position ids: B*S integers, never a mask) over
    the SP group, so that a kernel that runs on the full sequence knows its document boundaries."""
    P = size_and_rank(group)[0]
    if P == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(P)]  # (B, S/P) each
    x = x.contiguous()
    with _gloo_lets_go(x, *parts):
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=1)  # (B, S)


# ----------------------------------------------------------------------------------------------------------------
# rules 1, 2 and 4: the batch and the loss


def shard_for_sp(input_ids, labels, position_ids, group=None, ring_group=None, layout=None):
    """Full sequences [B, S] -> this rank's [B, S_pad/P] input ids, labels, position ids and token index (the
    position of each of its tokens in the padded sequence: where the data came from, which a ring's layout is).

    labels must already be shifted (labels[:, i] is the token after input_ids[:, i], or -100). Pads at the end
    to a multiple of P (input 0, label -100, positions counting on), so nothing is dropped and causal attention
    keeps every real token from seeing the padding. Position ids are cut like the tokens, never renumbered: rank
    r's first is position_ids[:, r*S_pad/P], which is r*S_pad/P when the row is one document. group=None: one rank.

    With a ring (Ulysses x Ring, ring.py), group is this rank's Ulysses group of U ranks and ring_group its ring
    of R, P = U x R: S is padded to a multiple of 2P and cut into 2R chunks, ring rank r takes chunks r and
    2R-1-r (the zigzag order, which balances causal work), and its U Ulysses ranks split those two in order.
    layout: a function that deals the tokens to the ring instead, (position_ids [B, S_pad], R) -> the positions
    each ring rank holds, [B, R, S_pad/R] (ring.document_layout: every rank a share of every packed document,
    which balances each document's causal work); its U Ulysses ranks split ring rank r's in order. The token index
    returned is where each token sits in the padded sequence: a ring's layout is exactly this.
    """
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if input_ids.dim() != 2 or t.shape != input_ids.shape:
            raise ValueError(f"shard_for_sp: input_ids {tuple(input_ids.shape)}, {name} {tuple(t.shape)}: want "
                             f"[B, S] each, labels already shifted (labels[:, i] is the token after input_ids[:, i])")
    (U, u), (R, r) = size_and_rank(group), size_and_rank(ring_group)
    P = U * R
    pad = -input_ids.shape[1] % (P if R == 1 else 2 * P)
    input_ids, labels = F.pad(input_ids, (0, pad), value=0), F.pad(labels, (0, pad), value=-100)  # (B, S_pad)
    counting_on = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)  # (B, pad)
    position_ids = torch.cat([position_ids, counting_on], dim=1)  # (B, S_pad)
    B, S_pad = input_ids.shape
    if R > 1 and layout is not None:  # my share as the layout deals it
        index = layout(position_ids, R)[:, r].to(input_ids.device)  # (B, S_pad/R)
    else:  # ring rank r's chunks r and 2R-1-r of 2R, zigzag (ring.py's too: written here so that this file needs
        # torch alone); without a ring, every token
        chunks = torch.arange(S_pad, device=input_ids.device).chunk(2 * R)  # (S_pad/2R,) each
        index = torch.cat([chunks[r], chunks[2 * R - 1 - r]] if R > 1 else chunks).expand(B, -1)  # (B, S_pad/R)
    shards = [t.gather(1, index) for t in (input_ids, labels, position_ids)] + [index]  # (B, S_pad/R) each
    return tuple(t.chunk(U, dim=1)[u] for t in shards)  # (B, S_pad/P) each


def global_valid_tokens(labels, group=None):
    """The number of labelled tokens (label != -100) in the whole global batch, as an int64 tensor: labels is
    this rank's [B, S_local] tensor or a list of them (one per gradient-accumulation micro-step), group holds
    every rank of the batch (all data- and sequence-parallel ranks; None: this process alone).

    Each rank divides the SUM of its token losses by this number, so the gradients, summed over the ranks,
    are those of the mean loss over the global batch. Never 0: a batch without labels gives loss 0, not NaN."""
    labels = [labels] if torch.is_tensor(labels) else labels
    count = sum((l != -100).sum() for l in labels)  # () int64
    if size_and_rank(group)[0] > 1:
        with _gloo_lets_go(count):
            dist.all_reduce(count, group=group)
    return count.clamp(min=1)


def check_inputs(q, k, v, group):
    """ValueError on every rank unless every rank of the group passes q, k and v that fit together, of the same
    sizes and dtype as the other ranks', naming what is wrong and where. The all-to-all's split sizes assume it; a
    mismatch would otherwise abort the processes inside gloo, or leave them waiting there. One all-gather of eight
    numbers a call: `python bench.py attention --check-cost` measures it, and ulysses_attention(..., check=False)
    turns it off."""
    names = ("batch size", "tokens", "query heads", "head size", "kv heads", "value head size", "dtype")
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    # 4-D first, so that no size is read on a rank that has none (it would raise there alone)
    fit = (q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape[:3] + k.shape[3:] and q.shape[:2] == k.shape[:2]
           and q.shape[3] == k.shape[3] and q.dtype == k.dtype == v.dtype and q.dtype in dtypes)
    sizes = [*q.shape, k.shape[2], v.shape[3]] if fit else [-1] * 6  # unfit: refused on every rank below
    dtype = dtypes.index(q.dtype) if q.dtype in dtypes else -1  # another dtype: unfit too
    mine = torch.tensor([*sizes, dtype, fit], device=q.device)  # (8,)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with _gloo_lets_go(mine, *every):
        dist.all_gather(every, mine, group=group)
    every = torch.stack(every).T.tolist()  # (P, 8) -> 8 rows of P values
    unfit = [rank for rank, fits in enumerate(every.pop()) if not fits]
    if unfit:  # every rank learns it, so none goes on into the all-to-all alone
        mine = (f" (this rank: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
                f"{v.dtype})" if not fit else "")
        raise ValueError(f"ulysses_attention: q, k and v do not fit together on SP rank "
                         f"{', '.join(map(str, unfit))}{mine}; want q [B, S/P, Hq, D], k [B, S/P, Hkv, D] and v "
                         f"[B, S/P, Hkv, Dv] of one dtype: float64, float32, bfloat16 or float16")
    for name, values in zip(names, every):
        values = [dtypes[i] for i in values] if name == "dtype" else values
        if len(set(values)) > 1:
            raise ValueError(f"ulysses_attention: the ranks of the SP group pass q, k, v of different {name}, "
                             f"{values} by rank; each must pass the same batch, S/P tokens and heads")


def check_sinks(sinks, attn_fn, n_head, caller):
    """ValueError unless sinks is None, or one logit per query head with an attn_fn that takes sinks= (the
    default kernel does not)."""
    if sinks is not None and (attn_fn is None or tuple(sinks.shape) != (n_head,)):
        raise ValueError(f"{caller}: sinks {tuple(sinks.shape)} need one logit per query head, [{n_head}], and an "
                         f"attn_fn that takes sinks=, e.g. ring.ring_attention")


def check_shards(x, group=None):
    """ValueError unless every rank of the group holds a batch of the same [B, S_local] shape as x ([B, S_local,
    ...]). The all-to-alls assume it, and a mismatch would otherwise abort the processes inside the collective.
    shard_for_sp always cuts equal shards; a model that takes shards made by hand calls this once per forward
    (one all-gather of two numbers)."""
    P = size_and_rank(group)[0]
    if P == 1:
        return
    shapes = [torch.zeros(2, dtype=torch.long, device=x.device) for _ in range(P)]
    mine = torch.tensor(x.shape[:2], device=x.device)
    with _gloo_lets_go(mine, *shapes):
        dist.all_gather(shapes, mine, group=group)
    shapes = [tuple(s.tolist()) for s in shapes]
    if len(set(shapes)) > 1:
        raise ValueError(f"the ranks of the SP group hold [batch, tokens] shards of different shapes, {shapes} by "
                         f"rank; each must hold S/P tokens of the same batch (shard_for_sp pads S to a multiple of P)")



# ----------------------------------------------------------------------------------------------------------------
# plumbing: what torch.compile sees of the exchange, the byte counts, the group's size, the wait for gloo


@_exchange_op.register_fake
def _exchange_shapes(tensors, head_bounds, to_heads, group_name, rank, direction):
    """What torch.compile sees of the exchange: empty outputs of the right shapes and memory layout. The rank is
    an argument, not looked up, so that each rank's compiled code (which inductor caches by its arguments)
    carries its own shapes."""
    P = dist.get_world_size(_resolve_process_group(group_name))
    return [_joined(t, heads, to_heads, P, rank) for t, heads in zip(tensors, _head_ranges(head_bounds, len(tensors)))]


def _keep_exchange(ctx, inputs, output):
    _, ctx.head_bounds, ctx.to_heads, ctx.group_name, ctx.rank, _ = inputs


def _exchange_backward(ctx, grads):
    """The same exchange the other way (heads_to_seq for seq_to_heads): the gradient of each received piece goes
    back to the rank that sent it."""
    back = _exchange_op(list(grads), ctx.head_bounds, not ctx.to_heads, ctx.group_name, ctx.rank, "backward")
    return back, None, None, None, None, None


_exchange_op.register_autograd(_exchange_backward, setup_context=_keep_exchange)

# what this process has sent to other ranks: {"forward"|"backward": {"calls": int, "bytes": int}}
all_to_all_stats = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}


def reset_all_to_all_stats():
    for counts in all_to_all_stats.values():
        counts["calls"], counts["bytes"] = 0, 0


def _count(direction, sent_bytes):
    all_to_all_stats[direction]["calls"] += 1
    all_to_all_stats[direction]["bytes"] += sent_bytes


def all_to_all_bytes(heads, rank, head_bytes):
    """(seq_to_heads, heads_to_seq): the bytes rank `rank` sends in each, for a tensor of `head_bytes` bytes per
    head of its local tokens (B * S/P * D * element size) cut by `heads`. seq_to_heads sends its tokens of every
    other rank's heads; heads_to_seq sends its own heads of every other rank's tokens. A kv head that goes to
    several ranks counts once for each."""
    return (head_bytes * sum(len(h) for j, h in enumerate(heads) if j != rank),
            head_bytes * (len(heads) - 1) * len(heads[rank]))


def size_and_rank(group):
    """(P, this process's rank in the group); (1, 0) for group=None, which means no communication."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


@contextmanager
def _gloo_lets_go(*tensors):
    """Around a blocking collective over `tensors`: once the call has returned, wait until the backend has let
    go of them. On CPU, gloo returns as soon as the data has moved. Its worker thread drops its references to
    the tensors a moment later, and dropping the last C++ reference to a tensor that Python holds too needs the
    interpreter lock. If the program is exiting by then (a last collective, destroy_process_group, exit), the
    thread cannot take the lock, and the process aborts with "terminate called without an active exception".
    So on CPU we wait until both counts of each tensor are back: the C++ references and, released a moment
    after them, the Python ones. That takes under a millisecond; after a second we warn and go on. CUDA
    backends keep their work until the GPU has finished, and tell nobody: nothing to wait for there."""
    def holders():  # counted the same way before and after the call, so the references made here cancel out
        return [count for t in tensors for count in (t._use_count(), sys.getrefcount(t))]

    if tensors[0].device.type != "cpu":
        yield
        return
    before = holders()
    yield
    deadline = time.monotonic() + 1.0
    while any(now > then for now, then in zip(holders(), before)):
        if time.monotonic() > deadline:
            warnings.warn("gloo still held a collective's tensors one second after it returned")
            return
        time.sleep(1e-5)  # the interpreter lock is free for the worker thread meanwhile
