"""
Ulysses sequence parallelism: the whole contract in one file.

Each of the P ranks of a sequence-parallel (SP) group holds S/P tokens of every sequence, with all H heads.
Attention needs the whole sequence, but the heads are independent. So an all-to-all trades the split: then every
rank holds the WHOLE sequence for its share of the heads, runs any attention kernel, and trades back.

    rank r holds          all-to-all          rank r holds              all-to-all        rank r holds
    tokens r, all heads  ------------->  all tokens, heads r  --attn-->  ------------->  tokens r, all heads
    [B, S/P, H, D]       seq_to_heads       [B, S, H_r, D]              heads_to_seq      [B, S/P, H, D]

H_r: the query heads rank r holds, H/P when P divides H, else H // P or one more; for k and v, the kv heads they use.

One attention layer makes four all-to-alls forward: q, k and v go to heads (one call each), the output comes back
(one call). Backward makes the same four the other way. Let h = H*D and h_kv = H_kv*D, S be padded (rule 2), and P
divide both head counts. Each call keeps 1/P of its input and sends the other (P-1)/P: a local q of B * S/P * h
elements sends B * S * h * (P-1)/P^2. So per layer each rank sends, in elements (uneven heads: `all_to_all_bytes`),

    forward:  B * S * (2*h + 2*h_kv) * (P-1) / P^2     (q and the output h each, k and v h_kv each); backward: the same

When P grows in step with S, that approaches B * S/P * (2*h + 2*h_kv); an all-gather of k and v grows with S.

Four rules make training on P ranks equal to training on one device; this file holds 2, 3 and rule 4's count:
  1. shift the labels by one BEFORE sharding (a shard's last label is the next rank's first token);
  2. pad every sequence at its end to a multiple of P, give rank r tokens [r*S_pad/P, (r+1)*S_pad/P), and keep
     their GLOBAL position ids (RoPE and document boundaries need them): `shard_for_sp`;
  3. attention over the full sequence: `ulysses_attention` (everything else in a transformer is per token);
  4. divide each rank's SUM of token losses by the valid tokens of the WHOLE global batch (`global_valid_tokens`),
     and SUM the gradients over all ranks, data- and sequence-parallel alike, never average them.

It reads down the call path: layer, head layout, exchange, kernels, batch, loss, bytes. Torch alone: copy it anywhere.
"""

import operator
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group  # a group's name -> the group


# ----------------------------------------------------------------------------------------------------------------
# rule 3: attention over the full sequence


def ulysses_attention(q, k, v, group=None, attn_fn=None, check=True, sinks=None, **attn_kwargs):
    """Attention over the full sequence when each rank holds S/P tokens: q [B, S/P, Hq, D], k and v [B, S/P, Hkv, D]
    -> [B, S/P, Hq, D]. attn_fn(q, k, v, **attn_kwargs) gets the full sequence of this rank's heads (head_layout):
    q [B, S, hq, D]; k and v [B, S, hkv, D] if query head i uses kv head i // (hq / hkv), else expanded to [B, S, hq,
    D], a kv head per query head (kernel_kv_heads). Default causal_attention; ring.ring_attention over a ring group
    makes it Ulysses x Ring. group=None or of one rank: attn_fn alone. check: `check_inputs` first, unless compiling.
    sinks [Hq]: a learned logit per query head (gpt-oss); attn_fn gets this rank's as sinks=...."""
    P, rank = size_and_rank(group)
    if check and P > 1 and not torch.compiler.is_compiling():  # on every rank alike, before one could raise alone
        check_inputs(q, k, v, group, sinks)
    if sinks is not None and (attn_fn is None or tuple(sinks.shape) != (q.shape[2],)):
        raise ValueError(f"ulysses_attention: sinks {tuple(sinks.shape)} need one logit per query head, "
                         f"[{q.shape[2]}], and an attn_fn that takes sinks=, e.g. ring.ring_attention")
    attn_fn = attn_fn or causal_attention
    if P == 1:
        return attn_fn(q, k, v, **attn_kwargs) if sinks is None else attn_fn(q, k, v, sinks=sinks, **attn_kwargs)
    # head counts as plain ints (operator.index), so torch.compile fixes the head layout; only S stays symbolic
    n_head, n_kv_head = operator.index(q.shape[2]), operator.index(k.shape[2])
    query_heads, kv_heads = head_layout(n_head, n_kv_head, P)
    if sinks is not None:  # my kernel gets the sinks of the query heads I hold
        attn_kwargs["sinks"] = sinks[query_heads[rank].start:query_heads[rank].stop]  # (Hq,) -> (hq,)
    q = seq_to_heads(q, group, query_heads)  # (B, S, hq, D)
    k, v = seq_to_heads(k, group, kv_heads), seq_to_heads(v, group, kv_heads)  # (B, S, hkv, D)
    kernel_kv = kernel_kv_heads(n_head, n_kv_head, P, rank)
    if kernel_kv != list(range(len(kv_heads[rank]))):  # query heads not in equal runs per kv head: a kv head each
        k, v = k[:, :, kernel_kv], v[:, :, kernel_kv]  # (B, S, hkv, D) -> (B, S, hq, D)
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
    kv_heads = [range(run.start // per_kv, (run.stop - 1) // per_kv + 1) for run in query_heads]
    return query_heads, kv_heads


def kernel_kv_heads(n_head, n_kv_head, P, rank):
    """Indices into the kv heads rank `rank` receives: the ones its kernel gets. If its query heads already pair with
    them as a grouped-query kernel expects (head i -> i // (hq / hkv)), all of them; else one per query head, so the
    kernel sees hq kv heads (8 heads, 2 kv heads, sp 3: rank 1's query heads 3, 4, 5 use kv heads [0, 1, 1])."""
    query_heads, kv_heads = head_layout(n_head, n_kv_head, P)
    hq, hkv = len(query_heads[rank]), len(kv_heads[rank])
    uses = [h // (n_head // n_kv_head) - kv_heads[rank].start for h in query_heads[rank]]  # each query head's kv head
    grouped = hq % hkv == 0 and uses == [i // (hq // hkv) for i in range(hq)]  # equal consecutive runs, as SDPA's
    return list(range(hkv)) if grouped else uses


def check_inputs(q, k, v, group, sinks=None):
    """ValueError on every rank unless every rank passes the same q [B, S/P, Hq, D], k [B, S/P, Hkv, D], v [B, S/P,
    Hkv, Dv] of one float dtype, and sinks [Hq] or none. The exchange assumes it: else it would abort or hang."""
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    fit = (q.dim() == k.dim() == v.dim() == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2] and k.shape[2] == v.shape[2]
           and q.shape[3] == k.shape[3] and q.dtype == k.dtype == v.dtype and q.dtype in dtypes
           and (sinks is None or tuple(sinks.shape) == (q.shape[2],)))
    mine = [*q.shape, *k.shape[2:], v.shape[3], dtypes.index(q.dtype), sinks is not None] if fit else [-1] * 9
    every = _every_rank(mine, q.device, group)  # -1: unfit
    if len(set(every)) > 1 or not fit:  # every rank gathered the same list, so every rank raises
        raise ValueError(f"ulysses_attention: q, k, v differ between the ranks or do not fit together ([B, S/P, Hq, "
                         f"D, Hkv, Dk, Dv, dtype, sinks?] by rank: {every}); want q [B, S/P, Hq, D], k [B, S/P, Hkv, "
                         f"D], v [B, S/P, Hkv, Dv] of one float dtype, sinks [Hq] or none, alike on every rank")


# ----------------------------------------------------------------------------------------------------------------
# the exchange. seq_to_heads on P = 2 (t0, t1: the two halves of the sequence; h0, h1: the heads of ranks 0 and 1):
#
#     rank 0 holds  x[t0, h0 h1]   sends x[t0, h1] to rank 1   receives x[t1, h0]   joins x[t0 t1, h0]
#     rank 1 holds  x[t1, h0 h1]   sends x[t1, h0] to rank 0   receives x[t0, h1]   joins x[t0 t1, h1]
#
# heads_to_seq swaps the roles. Rank i holds the i-th stretch of the sequence, so joining the pieces in rank order
# rebuilds it. The backward of each exchange is the other one: a piece's gradient goes back to the rank that sent it.


def seq_to_heads(x, group, heads):
    """[B, S/P, H, D] (my tokens, all heads) -> [B, S, H_r, D] (all tokens, my heads). heads: P ranges, heads[j] the
    heads rank j receives (`head_layout` gives them). Differentiable: its backward is heads_to_seq."""
    P, rank = size_and_rank(group)
    bounds = [b for held in heads for b in (held.start, held.stop)]  # [start0, stop0, start1, ...]: ints for the op
    return x if P == 1 else _exchange(x, bounds, True, group.group_name, rank, "forward")


def heads_to_seq(x, group, heads):
    """[B, S, H_r, D] -> [B, S/P, H, D]: the inverse of seq_to_heads, with the same heads. A head that several ranks
    held comes back as the sum of theirs (a shared kv head's gradient)."""
    P, rank = size_and_rank(group)
    bounds = [b for held in heads for b in (held.start, held.stop)]
    return x if P == 1 else _exchange(x, bounds, False, group.group_name, rank, "forward")


@torch.library.custom_op("ulysses::exchange", mutates_args=())
def _exchange(x: torch.Tensor, head_bounds: list[int], to_heads: bool, group_name: str, rank: int,
              counted_as: str) -> torch.Tensor:
    """One all-to-all, an operator so that torch.compile traces through it unbroken. To heads, I send uneven pieces
    (rank j's heads at my tokens) and receive even ones (my heads at rank i's tokens); back, the mirror. The group
    travels by name, the heads as flat bounds; counted_as: the pass whose bytes this adds to, not the direction."""
    group = _resolve_process_group(group_name)
    heads = [range(a, b) for a, b in zip(head_bounds[::2], head_bounds[1::2])]  # heads[j]: rank j's, P of them
    if to_heads:  # x: (B, S/P, H, D), my tokens of every head
        B, S_local, _, D = x.shape
        sizes = [B * S_local * len(held) * D for held in heads]  # to rank j: its heads, at my tokens
        send = x.new_empty(sum(sizes))  # (sum(sizes),): flat, rank by rank
        for block, held in zip(send.split(sizes), heads):  # each element copied once
            block.view(B, S_local, len(held), D).copy_(x[:, :, held.start:held.stop])
        received = x.new_empty(len(heads), B, S_local, len(heads[rank]), D)  # row i: my heads, at rank i's tokens
        with _gloo_lets_go(received, send):
            dist.all_to_all_single(received, send, input_split_sizes=sizes, group=group)
        _count(counted_as, send.nbytes - received[rank].nbytes)  # my own block stays here
        return received.movedim(0, 1).flatten(1, 2)  # (P, B, S/P, H_r, D) -> (B, S, H_r, D), a copy unless B = 1
    # x: (B, S, H_r, D), all tokens of my heads
    send = x.unflatten(1, (len(heads), -1)).movedim(1, 0).contiguous()  # (P, B, S/P, H_r, D): row j, rank j's tokens
    B, S_local, D = send.shape[1], send.shape[2], send.shape[4]
    sizes = [B * S_local * len(held) * D for held in heads]  # from rank i: its heads, at my tokens
    received = x.new_empty(sum(sizes))  # (sum(sizes),): flat, rank by rank
    with _gloo_lets_go(received, send):
        dist.all_to_all_single(received, send, output_split_sizes=sizes, group=group)
    _count(counted_as, send.nbytes - send[rank].nbytes)  # my own block stays here
    pieces = [p.view(B, S_local, len(held), D) for p, held in zip(received.split(sizes), heads)]  # (B, S/P, H_i, D)
    if all(a.stop == b.start for a, b in zip(heads, heads[1:])):  # every head from one rank: one copy joins them
        return torch.cat(pieces, dim=2)  # (B, S/P, H, D)
    joined = x.new_zeros(B, S_local, heads[-1].stop, D)  # (B, S/P, H, D): a head several ranks held sums theirs
    for piece, held in zip(pieces, heads):
        joined[:, :, held.start:held.stop] += piece
    return joined


@_exchange.register_fake
def _exchange_shapes(x, head_bounds, to_heads, group_name, rank, counted_as):
    """What torch.compile sees: an empty output shaped and laid out as the exchange makes it, for `rank` (an argument:
    inductor caches code by its arguments, so each rank keeps its own shapes)."""
    heads = [range(a, b) for a, b in zip(head_bounds[::2], head_bounds[1::2])]
    if to_heads:
        B, S_local, _, D = x.shape
        return x.new_empty(len(heads), B, S_local, len(heads[rank]), D).movedim(0, 1).flatten(1, 2)  # (B, S, H_r, D)
    B, S, _, D = x.shape
    return x.new_empty(B, S // len(heads), heads[-1].stop, D)  # (B, S/P, H, D)


def _keep_exchange(ctx, inputs, output):
    _, ctx.head_bounds, ctx.to_heads, ctx.group_name, ctx.rank, _ = inputs


def _exchange_backward(ctx, grad):  # the same exchange the other way: each piece's gradient goes back to its sender
    back = _exchange(grad, ctx.head_bounds, not ctx.to_heads, ctx.group_name, ctx.rank, "backward")
    return back, None, None, None, None, None


_exchange.register_autograd(_exchange_backward, setup_context=_keep_exchange)


# ----------------------------------------------------------------------------------------------------------------
# attention kernels between the all-to-alls: any function of full-sequence q, k, v [B, S, heads, D] that hides the pads


def causal_attention(q, k, v):
    """Default kernel. q [B, S, Hq, D], k and v [B, S, Hkv, D] with Hq a multiple of Hkv -> [B, S, Hq, D]."""
    return _sdpa(q, k, v, is_causal=True)


def sliding_window_attention(q, k, v, window):
    """Causal attention over the last `window` tokens (0 or None: all, as causal_attention): token i sees tokens
    i-window+1 .. i. SDPA keeps the window's [S, S] mask for backward; ring.ring_attention(window=...) holds less."""
    if window is not None and window < 0:
        raise ValueError(f"window={window}: a sliding window looks back from each query: 1 or more tokens (0: all)")
    S = q.shape[1]
    visible = torch.ones(S, S, dtype=torch.bool, device=q.device).tril_().triu_(1 - (window or S))  # i-window < j <= i
    return _sdpa(q, k, v, attn_mask=visible)


def _sdpa(q, k, v, attn_mask=None, is_causal=False):
    """PyTorch's SDPA on [B, S, heads, D] tensors; k and v expanded to one head per query head where SDPA would
    not run grouped-query attention in a fused kernel (`sdpa_takes_groups`)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D), SDPA's layout
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not sdpa_takes_groups(q.device.type, q.dtype, attn_mask is not None, q.shape[-1]):
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # (B, Hkv, S, D) -> (B, Hq, S, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)  # (B, H, S, D) -> (B, S, H, D)


def sdpa_takes_groups(device_type, dtype, masked, head_dim):
    """Whether SDPA runs grouped-query attention in a fused kernel: on CPU, and on CUDA in fp16 or bf16 without a
    mask for heads up to 256. Elsewhere it falls back to its math kernel, which holds every score [B, Hq, S, S]."""
    return device_type == "cpu" or (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not masked
                                    and head_dim <= 256)


# ----------------------------------------------------------------------------------------------------------------
# rules 2 and 4: the batch (its labels shifted by rule 1 before it comes here) and the loss


def shard_for_sp(input_ids, labels, position_ids, group=None):
    """Full sequences [B, S] -> this rank's [B, S_pad/P] input ids, labels, position ids and token index (where each
    token sits in the padded sequence, as ring.shard_for_ring gives it; a model reads it for packed documents under
    a ring). labels come shifted (labels[:, i] is the token after input_ids[:, i], or -100). Pads at the end to a
    multiple of P (input 0, label -100, positions counting on): nothing is dropped, and a causal kernel keeps real
    tokens from seeing the padding. Positions are cut, never renumbered. group=None: one rank."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape or position_ids.shape != input_ids.shape:
        raise ValueError(f"shard_for_sp: input_ids {tuple(input_ids.shape)}, labels {tuple(labels.shape)}, "
                         f"position_ids {tuple(position_ids.shape)}: want [B, S] each, labels already shifted")
    P, rank = size_and_rank(group)
    pad = -input_ids.shape[1] % P
    input_ids, labels = F.pad(input_ids, (0, pad), value=0), F.pad(labels, (0, pad), value=-100)  # (B, S_pad)
    counting_on = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)  # (B, pad)
    position_ids = torch.cat([position_ids, counting_on], dim=1)  # (B, S_pad)
    token_index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)  # (B, S_pad)
    return tuple(t.chunk(P, dim=1)[rank] for t in (input_ids, labels, position_ids, token_index))  # (B, S_pad/P)


def global_valid_tokens(labels, group=None):
    """The labelled tokens (label != -100) of the whole global batch, an int64 tensor, never 0 (no labels: loss 0, not
    NaN). labels: this rank's [B, S_local], or a list (one per micro-step); group: every rank of the batch, data- and
    sequence-parallel. Each rank divides the SUM of its token losses by it; summed, its gradients are the mean's."""
    labels = [labels] if torch.is_tensor(labels) else labels
    count = sum(((l != -100).sum() for l in labels), torch.zeros((), dtype=torch.int64))  # () int64; 0 for []
    if size_and_rank(group)[0] > 1:
        with _gloo_lets_go(count):
            dist.all_reduce(count, group=group)
    return count.clamp(min=1)


def check_shards(x, group=None):
    """ValueError on every rank unless every rank of the group holds token ids x of one [B, S_local], as shard_for_sp
    cuts them (else the all-to-alls abort or hang). A model calls it once a forward: one all-gather of two numbers."""
    shapes = _every_rank([*x.shape] if x.dim() == 2 else [-1, -1], x.device, group)  # -1: not [B, S_local]
    if len(set(shapes)) > 1 or shapes[0][0] == -1:
        raise ValueError(f"the ranks of the SP group must hold [batch, tokens] shards of one shape; they hold "
                         f"{shapes} by rank (-1: not [batch, tokens]); each S/P tokens of one batch (shard_for_sp)")


def _every_rank(numbers, device, group):
    """Every rank's list of numbers, as tuples in rank order (one all-gather)."""
    P = size_and_rank(group)[0]
    if P == 1:
        return [tuple(numbers)]
    mine = torch.tensor(numbers, device=device)
    every = [torch.empty_like(mine) for _ in range(P)]
    with _gloo_lets_go(mine, *every):
        dist.all_gather(every, mine, group=group)
    return [tuple(t.tolist()) for t in every]


def size_and_rank(group):
    """(P, this process's rank in the group); (1, 0) for group=None: one rank, no communication (not WORLD)."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


# ----------------------------------------------------------------------------------------------------------------
# bytes: what this process sent, beside the formula

all_to_all_stats = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}  # this process's


def reset_all_to_all_stats():
    all_to_all_stats.update(forward={"calls": 0, "bytes": 0}, backward={"calls": 0, "bytes": 0})


def _count(counted_as, sent_bytes):
    counts = all_to_all_stats[counted_as]
    counts.update(calls=counts["calls"] + 1, bytes=counts["bytes"] + sent_bytes)


def all_to_all_bytes(heads, rank, head_bytes):
    """(bytes seq_to_heads sends, bytes heads_to_seq sends) from rank `rank`, for a tensor cut by `heads`;
    head_bytes: one head at one rank's tokens, B * S/P * D * element size. seq_to_heads sends my tokens of the other
    ranks' heads (a kv head that goes to several ranks counts once for each); heads_to_seq sends my heads of the
    other ranks' tokens."""
    return (head_bytes * sum(len(held) for j, held in enumerate(heads) if j != rank),
            head_bytes * (len(heads) - 1) * len(heads[rank]))


@contextmanager
def _gloo_lets_go(*tensors):
    """CPU only: after the collective, wait up to a second until gloo's worker thread drops its references to these
    tensors. Otherwise it may free one as the script exits, without the interpreter lock, and the process aborts."""
    holders = lambda: [n for t in tensors for n in (t._use_count(), sys.getrefcount(t))]  # taken alike before and after
    before = holders()
    yield
    deadline = time.monotonic() + 1.0
    while tensors[0].is_cpu and any(a > b for a, b in zip(holders(), before)) and time.monotonic() < deadline:
        time.sleep(1e-5)  # the interpreter lock is free for the worker thread meanwhile
