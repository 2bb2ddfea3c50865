"""
Ulysses sequence parallelism: the whole contract in one file.

Each of the P ranks of a sequence-parallel (SP) group holds S/P consecutive tokens of every sequence, with
all H attention heads. Attention needs the whole sequence, but each head is independent of the others. So one
all-to-all trades the split: afterwards every rank holds the WHOLE sequence for its share of the heads, runs
any ordinary attention kernel on it, and a second all-to-all trades back.

    rank r holds          all-to-all          rank r holds              all-to-all        rank r holds
    tokens r, all heads  ------------->  all tokens, heads r  --attn-->  ------------->  tokens r, all heads
    [B, S/P, H, D]       seq_to_heads       [B, S, H_r, D]              heads_to_seq      [B, S/P, H, D]

Each rank sends (P-1)/P of its local tensor, so the bytes per rank and link stay constant when P grows with S
(Megatron-style SP all-gathers the full activation instead). The backward of an all-to-all is the opposite
all-to-all, so training costs the same traffic again.

Four rules make training on P ranks equal to training on one device, and this file holds all four:
  1. shift the labels by one BEFORE sharding (the label of a shard's last token lives on the next rank);
  2. pad every sequence at its end to a multiple of P, give rank r tokens [r*S/P, (r+1)*S/P), and keep the
     GLOBAL position ids of those tokens (RoPE and document boundaries need them): `shard_for_sp`;
  3. attention over the full sequence: `ulysses_attention` (everything else in a transformer is per token);
  4. divide each rank's SUM of token losses by the valid tokens of the WHOLE global batch
     (`global_valid_tokens`), and SUM the gradients over all ranks (data- and sequence-parallel alike).

It depends on torch alone: copy it into your own project. The bytes it sends are counted in `all_to_all_stats`.
`python ulysses.py` benchmarks it against the alternatives (see the end of the file).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # optional: flash-attn's kernels take the [B, S, H, D] layout as it is
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:
    flash_attn_func = flash_attn_varlen_func = None


def size_and_rank(group):
    """(P, this process's rank in the group); (1, 0) for group=None, which means no communication."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


# ----------------------------------------------------------------------------------------------------------------
# rules 1, 2 and 4: the batch and the loss


def shard_for_sp(input_ids, labels, position_ids, group=None):
    """Full sequences [B, S] -> this rank's [B, S_pad/P] input ids, labels and position ids.

    labels must already be shifted (labels[:, i] is the token after input_ids[:, i], or -100). Pads at the end
    to a multiple of P (input 0, label -100, positions counting on), so nothing is dropped and causal attention
    keeps every real token from seeing the padding. Position ids are those of the full sequence: rank r's first
    token is at position r*S_pad/P (unless a document starts there), never 0. group=None: one rank.
    """
    P, rank = size_and_rank(group)
    pad = -input_ids.shape[1] % P
    input_ids, labels = F.pad(input_ids, (0, pad), value=0), F.pad(labels, (0, pad), value=-100)  # (B, S_pad)
    counting_on = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)  # (B, pad)
    position_ids = torch.cat([position_ids, counting_on], dim=1)  # (B, S_pad)
    return tuple(t.chunk(P, dim=1)[rank] for t in (input_ids, labels, position_ids))  # (B, S_pad/P) each


def global_valid_tokens(labels, group=None):
    """The number of labelled tokens (label != -100) in the whole global batch, as an int64 tensor: labels is
    this rank's [B, S_local] tensor or a list of them (one per gradient-accumulation micro-step), group holds
    every rank of the batch (all data- and sequence-parallel ranks; None: this process alone).

    Each rank divides the SUM of its token losses by this number, so the gradients, summed over the ranks,
    are those of the mean loss over the global batch. Never 0: a batch without labels gives loss 0, not NaN."""
    labels = [labels] if torch.is_tensor(labels) else labels
    count = sum((l != -100).sum() for l in labels)  # () int64
    if size_and_rank(group)[0] > 1:
        dist.all_reduce(count, group=group)
    return count.clamp(min=1)


def check_shards(x, group=None):
    """ValueError unless every rank of the group holds a batch of the same [B, S_local] shape as x ([B, S_local,
    ...]). The all-to-alls assume it, and a mismatch would otherwise abort the processes inside the collective.
    shard_for_sp always cuts equal shards; a model that takes shards made by hand calls this once per forward
    (one all-gather of two numbers)."""
    P = size_and_rank(group)[0]
    if P == 1:
        return
    shapes = [torch.zeros(2, dtype=torch.long, device=x.device) for _ in range(P)]
    dist.all_gather(shapes, torch.tensor(x.shape[:2], device=x.device), group=group)
    shapes = [tuple(s.tolist()) for s in shapes]
    if len(set(shapes)) > 1:
        raise ValueError(f"the ranks of the SP group hold [batch, tokens] shards of different shapes, {shapes} by "
                         f"rank; each must hold S/P tokens of the same batch (shard_for_sp pads S to a multiple of P)")


# ----------------------------------------------------------------------------------------------------------------
# which heads each rank holds


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

    With P dividing n_head and n_kv_head this is the plain even split; with P a multiple of n_kv_head every
    rank gets one kv head (replication); and in every case the all-to-all sends exactly these heads.
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


# ----------------------------------------------------------------------------------------------------------------
# the all-to-all
#
# One all_to_all_single moves any number of tensors, each cut along its own ranges, with one copy on the way in
# and one on the way out. For seq_to_heads of q, k, v on rank 0 of P = 2 (t0, t1: the two halves of the
# sequence; h0, h1: the heads ranks 0 and 1 hold):
#
#     send buffer      [ q[t0,h1] | k[t0,h1] | v[t0,h1] ]      one copy in, already in send order
#     receive buffer   [ q[t1,h0] | k[t1,h0] | v[t1,h0] ]      the send buffer is freed once it has gone
#     q [B, S, h0, D] = [ q[t0,h0] ; q[t1,h0] ]                one copy out, into head-major memory
#
# What stays on this rank, q[t0,h0] and the like, never enters the buffers: it goes straight from the input
# into the output. heads_to_seq and both backwards do the same with the roles of tokens and heads swapped.
# A tensor of all tokens (q, k, v here, the output's gradient in backward) is stored head-major, [B, h0, S, D],
# and handed on with [B, S, h0, D] shape: SDPA reads that memory as it is.

# what this process has sent to other ranks: {"forward"|"backward": {"calls": int, "bytes": int}}
all_to_all_stats = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}


def reset_all_to_all_stats():
    for counts in all_to_all_stats.values():
        counts["calls"], counts["bytes"] = 0, 0


def _pack(pieces):
    """The pieces back to back in one new flat buffer: one copy each."""
    buffer = pieces[0].new_empty(sum(piece.numel() for piece in pieces))
    offset = 0
    for piece in pieces:
        buffer[offset:offset + piece.numel()].view(piece.shape).copy_(piece)
        offset += piece.numel()
    return buffer


def _all_to_all(tensors, group, send, receive, split_dim, join_dim, direction):
    """For every tensor t: send t.narrow(split_dim, send[t][j]) to rank j, and place what rank i sends at
    receive[t][i] along join_dim, all in ONE collective call. Returns the joined tensors. A place that several
    ranks fill (on its way back, a kv head that had gone to several ranks) receives their sum."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    others = [j for j in range(P) if j != me]
    cut = lambda t, ranges, j, dim: t.narrow(dim, ranges[j].start, len(ranges[j]))
    # what comes back from rank i, per tensor: my part of it (split_dim) over rank i's range of join_dim
    joined_shapes = []
    for t, ranges_out, ranges_in in zip(tensors, send, receive):
        shape = list(t.shape)
        shape[split_dim], shape[join_dim] = len(ranges_out[me]), ranges_in[-1].stop
        joined_shapes.append(shape)
    piece_shapes = [[shape[:join_dim] + [len(ranges[i])] + shape[join_dim + 1:] for shape, ranges in
                     zip(joined_shapes, receive)] for i in range(P)]
    numel = lambda shapes: sum(torch.Size(shape).numel() for shape in shapes)

    pieces = [[cut(t, ranges, j, split_dim) for t, ranges in zip(tensors, send)] for j in range(P)]  # for rank j

    # 1. one copy into the send buffer, destination by destination; my own pieces stay where they are
    send_buffer = _pack([piece for j in others for piece in pieces[j]])
    # 2. one collective
    send_sizes = [sum(piece.numel() for piece in pieces[j]) if j != me else 0 for j in range(P)]
    receive_sizes = [numel(piece_shapes[i]) if i != me else 0 for i in range(P)]
    receive_buffer = tensors[0].new_empty(sum(receive_sizes))
    dist.all_to_all_single(receive_buffer, send_buffer, receive_sizes, send_sizes, group=group)
    all_to_all_stats[direction]["calls"] += 1
    all_to_all_stats[direction]["bytes"] += send_buffer.numel() * send_buffer.element_size()
    # The collective has finished with the send buffer (the call is synchronous), so its memory goes now, before
    # the outputs exist: the two never coexist. Resized rather than just dropped, because the backend's worker
    # thread may hold a reference to it a moment longer.
    send_buffer.untyped_storage().resize_(0)
    # 3. one copy out of the receive buffer (and out of my own tensors) into the joined tensors
    memory_order = lambda n: [0, 2, 1, *range(3, n)] if join_dim == 1 else list(range(n))  # all tokens: head-major
    outputs = [torch.empty_permuted(shape, memory_order(len(shape)), dtype=t.dtype, device=t.device)
               for t, shape in zip(tensors, joined_shapes)]
    received = iter(receive_buffer.split([torch.Size(shape).numel() for i in others for shape in piece_shapes[i]]))
    incoming = [[next(received).view(shape) for shape in piece_shapes[i]] if i != me else pieces[me] for i in range(P)]
    for k, (out, ranges) in enumerate(zip(outputs, receive)):
        shared = any(a.stop > b.start for a, b in zip(ranges, ranges[1:]))  # kv heads that went to several ranks
        if shared:
            out.zero_()
        for i in range(P):
            target = cut(out, ranges, i, join_dim)
            target.add_(incoming[i][k]) if shared else target.copy_(incoming[i][k])
    return outputs


class _AllToAll(torch.autograd.Function):
    """_all_to_all as an autograd op. Its backward is the same exchange with send and receive swapped (and the
    split and join dimensions): the gradient of each received piece goes back to the rank that sent it."""

    @staticmethod
    def forward(ctx, group, send, receive, split_dim, join_dim, *tensors):
        ctx.exchange = (group, send, receive, split_dim, join_dim)
        return tuple(_all_to_all(tensors, group, send, receive, split_dim, join_dim, "forward"))

    @staticmethod
    def backward(ctx, *grads):
        group, send, receive, split_dim, join_dim = ctx.exchange
        return None, None, None, None, None, *_all_to_all(grads, group, receive, send, join_dim, split_dim, "backward")


def _exchange(x, group, heads, to_heads):
    """seq_to_heads or heads_to_seq of a tensor or a tuple of tensors (then in one collective call)."""
    P = size_and_rank(group)[0]
    if P == 1:
        return x
    single = torch.is_tensor(x)
    tensors = (x,) if single else tuple(x)
    if len({(t.dtype, t.device) for t in tensors}) > 1:  # they share one buffer
        raise ValueError(f"tensors that travel in one all-to-all must share dtype and device; got "
                         f"{[(t.dtype, str(t.device)) for t in tensors]}")
    if heads is None:  # one tensor, H/P heads a rank
        H = tensors[0].shape[2] * (1 if to_heads else P)
        if H % P:
            raise ValueError(f"{H} heads do not split evenly over {P} ranks: pass heads=head_layout(...)[0]")
        heads = head_layout(H, 1, P)[0]
    heads = (heads,) if single else tuple(heads)
    S_local = tensors[0].shape[1] if to_heads else tensors[0].shape[1] // P
    tokens = [range(i * S_local, (i + 1) * S_local) for i in range(P)]  # rank i's tokens in the full sequence
    if to_heads:
        out = _AllToAll.apply(group, heads, (tokens,) * len(tensors), 2, 1, *tensors)
    else:
        out = _AllToAll.apply(group, (tokens,) * len(tensors), heads, 1, 2, *tensors)
    return out[0] if single else out


def seq_to_heads(x, group, heads=None):
    """[B, S/P, H, D] (my tokens, all heads) -> [B, S, H_r, D] (all tokens, my heads), where heads[r] is the
    range of heads rank r receives (default: H/P each, in rank order; head_layout gives uneven splits).
    x may be a tuple of tensors with one heads list each: they all travel in ONE all-to-all. Differentiable;
    its backward is heads_to_seq."""
    return _exchange(x, group, heads, to_heads=True)


def heads_to_seq(x, group, heads=None):
    """[B, S, H_r, D] (all tokens, my heads) -> [B, S/P, H, D] (my tokens, all heads): the inverse of
    seq_to_heads, with the same heads. Differentiable; its backward is seq_to_heads."""
    return _exchange(x, group, heads, to_heads=False)


def all_to_all_bytes(heads, rank, elements):
    """Bytes rank `rank` sends when seq_to_heads moves a tensor whose every (token, head) pair is `elements`
    bytes, per local token: (seq_to_heads, heads_to_seq of the same heads). It sends the heads of every
    other rank for its own tokens, and takes back its own heads of every other rank's tokens."""
    return (elements * sum(len(h) for j, h in enumerate(heads) if j != rank),
            elements * (len(heads) - 1) * len(heads[rank]))


# ----------------------------------------------------------------------------------------------------------------
# rule 3: attention over the full sequence


def ulysses_attention(q, k, v, group=None, attn_fn=None, **attn_kwargs):
    """Attention over the full sequence when each rank holds S/P tokens.

    q [B, S/P, Hq, D], k and v [B, S/P, Hkv, D] -> [B, S/P, Hq, D]. attn_fn(q, k, v, **attn_kwargs) sees the
    full sequence in the same layout, [B, S, heads, D], for this rank's heads (head_layout); it defaults to
    causal attention. group=None or a group of one rank runs attn_fn directly. Costs one all-to-all for q, k
    and v together and one for the output; backward the same.
    """
    attn_fn = attn_fn or causal_attention
    P, rank = size_and_rank(group)
    if P == 1:
        return attn_fn(q, k, v, **attn_kwargs)
    n_head, n_kv_head = q.shape[2], k.shape[2]
    query_heads, kv_heads = head_layout(n_head, n_kv_head, P)
    q, k, v = seq_to_heads((q, k, v), group, (query_heads, kv_heads, kv_heads))  # (B, S, hq or hkv, D)
    # Kernels with grouped-query attention take query head i to use kv head i // (hq / hkv). Where this rank's
    # heads do not split that way (8 heads, 2 kv heads, sp 3: the middle rank holds query heads 3, 4, 5, which
    # use kv heads 0, 1, 1), k and v are expanded to one kv head per query head here, never on the wire.
    hq, hkv = len(query_heads[rank]), len(kv_heads[rank])
    uses = [h // (n_head // n_kv_head) - kv_heads[rank].start for h in query_heads[rank]]
    if hq % hkv or uses != [i // (hq // hkv) for i in range(hq)]:
        k, v = (t.transpose(1, 2)[:, uses].transpose(1, 2) for t in (k, v))  # (B, S, hkv, D) -> (B, S, hq, D)
    return heads_to_seq(attn_fn(q, k, v, **attn_kwargs), group, query_heads)  # (B, S/P, Hq, D)


# ----------------------------------------------------------------------------------------------------------------
# attention kernels: any function of full-sequence q, k, v [B, S, heads, D] can run between the all-to-alls


def _sdpa(q, k, v, **kwargs):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D), SDPA's layout
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)
    return out.transpose(1, 2)  # (B, H, S, D) -> (B, S, H, D)


def _use_flash(q):
    return flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def causal_attention(q, k, v):
    """Default kernel. q [B, S, Hq, D], k and v [B, S, Hkv, D] with Hq a multiple of Hkv -> [B, S, Hq, D]."""
    return flash_attn_func(q, k, v, causal=True) if _use_flash(q) else _sdpa(q, k, v, is_causal=True)


def local_attention(q, k, v, window):
    """Sliding-window causal attention: token i sees tokens i-window+1 .. i. Same layout as causal_attention.
    It is not dense causal attention, yet ulysses_attention runs it unchanged: the wrapper only moves heads."""
    if _use_flash(q):
        return flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0))
    i = torch.arange(q.shape[1], device=q.device)
    distance = i[:, None] - i[None, :]  # (S, S): query index minus key index
    return _sdpa(q, k, v, attn_mask=(distance >= 0) & (distance < window))


def document_bounds(starts):
    """starts [B, S], True where a document starts -> where each document of the batch, seen as one stream of
    B*S tokens, begins (every row begins one too), followed by B*S: flash-attn's cu_seqlens."""
    B, S = starts.shape
    starts = starts.flatten().clone()  # (B*S,)
    starts[::S] = True
    return torch.cat([starts.nonzero().flatten(), torch.tensor([B * S], device=starts.device)])  # (documents + 1,)


def document_attention(q, k, v, position_ids, window=None):
    """Causal (or sliding-window) attention inside each document of a packed sequence, never across documents.
    position_ids [B, S] are the positions of the FULL sequence; a document starts wherever they are 0. On CUDA
    with flash-attn one variable-length kernel call covers all documents; otherwise SDPA runs per document,
    so memory grows with the longest document, never as S^2."""
    B, S, Hq, D = q.shape
    cu_seqlens = document_bounds(position_ids == 0)  # (documents + 1,)
    if flash_attn_varlen_func is not None and _use_flash(q):
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # (B*S, heads, D): the batch as one long token stream
        cu_seqlens = cu_seqlens.to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True,
                                     window_size=(window - 1, 0) if window else (-1, -1))
        return out.view(B, S, Hq, D)
    # every row starts a document, so none crosses rows: each is attended where it lies, as a view
    bounds = cu_seqlens.tolist()
    documents = [(s // S, s % S, e - s) for s, e in zip(bounds[:-1], bounds[1:])]  # (row, first token, length)
    attend = lambda *qkv: local_attention(*qkv, window) if window else causal_attention(*qkv)
    out = [attend(*(t[b:b + 1, i:i + n] for t in (q, k, v))) for b, i, n in documents]  # (1, n, Hq, D) each
    return torch.cat(out, dim=1).view(B, S, Hq, D)  # (1, B*S, Hq, D) -> (B, S, Hq, D)


def gather_sequence(x, group):
    """[B, S/P] -> [B, S]: all-gather a small per-token tensor (position ids: B*S integers, never a mask) over
    the SP group, so that a kernel that runs on the full sequence knows its document boundaries."""
    P = size_and_rank(group)[0]
    if P == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# python ulysses.py: one attention layer, forward + backward, against what else could carry it (see --help)


class _OneTensorAllToAll(torch.autograd.Function):
    """(c): the all-to-all one tensor at a time, with DeepSpeed's copies: the chunk for each rank moved to the
    front (one copy), one collective, the received chunks moved into place (one copy). With B = 1 and token-major
    tensors (as SDPA returns them) one of the two is free: the chunks of the sequence already lie one after the
    other, so .contiguous() or .flatten() returns what it is given. Backward: the same with the dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, sent):
        ctx.args = (group, scatter_dim, gather_dim, sent)
        return _OneTensorAllToAll.exchange(x, group, scatter_dim, gather_dim, sent)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim, sent = ctx.args
        return _OneTensorAllToAll.exchange(grad, group, gather_dim, scatter_dim, sent), None, None, None, None

    @staticmethod
    def exchange(x, group, scatter_dim, gather_dim, sent):  # shapes for seq_to_heads (scatter heads, gather tokens)
        P = dist.get_world_size(group)
        send = x.unflatten(scatter_dim, (P, -1)).movedim(scatter_dim, 0)  # (B, S/P, H, D) -> (P, B, S/P, H/P, D)
        send = send.contiguous()  # row j goes to rank j
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        sent[0] += send.numel() * send.element_size() * (P - 1) // P  # row `rank` stays here
        joined = received.movedim(0, gather_dim)  # (P, B, S/P, H/P, D) -> (B, P, S/P, H/P, D): row i from rank i
        return joined.flatten(gather_dim, gather_dim + 1)  # -> (B, S, H/P, D)


class _GatherSequence(torch.autograd.Function):
    """(d): all-gather [B, S/P, H, D] along the sequence into [B, S, H, D]; backward reduce-scatters (sums)
    the full gradient back to each rank's tokens. Every rank sends (P-1)/P of the gathered tensor."""

    @staticmethod
    def forward(ctx, x, group, sent):
        ctx.group, ctx.sent = group, sent
        P, (B, S_local, H, D) = dist.get_world_size(group), x.shape
        full = x.new_empty(P * B, S_local, H, D)  # rank j's tokens in rows j*B .. (j+1)*B - 1
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, x.contiguous(), group=group)
        sent[0] += x.numel() * x.element_size() * (P - 1)
        return full.view(P, B, S_local, H, D).transpose(0, 1).reshape(B, P * S_local, H, D)  # (B, S, H, D)

    @staticmethod
    def backward(ctx, grad):
        P, (B, S, H, D) = dist.get_world_size(ctx.group), grad.shape
        mine = grad.new_empty(B, S // P, H, D)
        rows = grad.reshape(B, P, S // P, H, D).transpose(0, 1).reshape(P * B, S // P, H, D)  # rank j's: rows j*B..
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, rows, group=ctx.group)
        ctx.sent[0] += mine.numel() * mine.element_size() * (P - 1)
        return mine, None, None


class _Barrier(torch.autograd.Function):
    """Identity on tensors that waits for every rank of the group, in forward and again in backward."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        dist.barrier(group=group)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        dist.barrier(group=ctx.group)
        return None, *grads


def _three_all_to_alls(q, k, v, group, sent):
    """(c): ulysses_attention with q, k and v in three all-to-alls; sent[0] counts the bytes sent."""
    q, k, v = (_OneTensorAllToAll.apply(t, group, 2, 1, sent) for t in (q, k, v))  # (B, S, heads/P, D)
    return _OneTensorAllToAll.apply(causal_attention(q, k, v), group, 1, 2, sent)  # (B, S/P, H, D)


def _gathered_kv(q, k, v, group, sent):
    """(d): all of k and v, this rank's queries; sent[0] counts the bytes sent."""
    k, v = (_GatherSequence.apply(t, group, sent) for t in (k, v))  # (B, S, Hkv, D)
    i = torch.arange(q.shape[1]) + dist.get_rank(group) * q.shape[1]  # global positions of my queries
    return _sdpa(q, k, v, attn_mask=i[:, None] >= torch.arange(k.shape[1])[None, :])  # (B, S/P, H, D)


def _benchmark_rank(rank, P, port, args, results):
    """Time one attention layer, forward + backward, in every variant on this group of P processes."""
    import os
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    group, B, H, D = dist.group.WORLD, args.batch_size, args.heads, args.head_dim
    Hkv = args.kv_heads
    sent = [0]  # bytes this rank sent with (c) or (d); (b) counts its own in all_to_all_stats

    def kernel_alone(q, k, v, heads):  # (a): the full sequence for H/P heads, laid out as the all-to-all leaves it
        return causal_attention(*(t.transpose(1, 2) for t in heads))

    def kernel_synchronized(q, k, v, heads):  # (a) with a barrier wherever (b) has an all-to-all: no data moves
        out = kernel_alone(q, k, v, _Barrier.apply(group, *heads))
        return _Barrier.apply(group, out)[0]

    variants = {"(a) kernel alone": kernel_alone, "(a) with 4 barriers": kernel_synchronized,
                "(b) ulysses_attention": lambda q, k, v, _: ulysses_attention(q, k, v, group),
                "(c) 3 all-to-alls": lambda q, k, v, _: _three_all_to_alls(q, k, v, group, sent),
                "(d) all-gather k, v": lambda q, k, v, _: _gathered_kv(q, k, v, group, sent)}

    def forward_backward(name, inputs):
        """The input gradients are returned, as a model's projections take them, not accumulated into .grad:
        that would copy (a)'s into the head-major layout of its inputs, a copy no other variant makes."""
        out = variants[name](*inputs[:3], inputs[3:])
        return torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)

    for S in args.sequences[P]:
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(B, S // P, H, D, generator=g)  # this rank's tokens
        k, v = (torch.randn(B, S // P, Hkv, D, generator=g) for _ in range(2))
        heads = [torch.randn(B, n // P, S, D, generator=g) for n in (H, Hkv, Hkv)]  # (a)'s q, k, v, head-major
        names = list(variants) if P > 1 else ["(a) kernel alone"]
        times, sent_bytes = {name: [] for name in names}, {}
        for repetition in range(args.reps + 1):  # the first is a warm-up
            for name in names:
                inputs = [t.detach().requires_grad_() for t in (q, k, v, *heads)]
                reset_all_to_all_stats()
                sent[0] = 0
                dist.barrier()
                start = time.perf_counter()
                forward_backward(name, inputs)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                sent_bytes[name] = sent[0] + sum(c["bytes"] for c in all_to_all_stats.values())
        if rank == 0:
            results.put(("time", P, S, times, sent_bytes))
    if P > 1 and args.memory:  # peak tensor memory of the layer on rank 0, forward + backward
        from torch.distributed._tools.mem_tracker import MemTracker
        S = args.sequences[P][0]
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(B, S // P, H, D, generator=g)
        k, v = (torch.randn(B, S // P, Hkv, D, generator=g) for _ in range(2))
        for name in ("(b) ulysses_attention", "(c) 3 all-to-alls"):
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            tracker = MemTracker()
            tracker.track_external(*inputs)
            with tracker:
                forward_backward(name, inputs)
            peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
            if rank == 0:
                results.put(("memory", P, S, name, peak, q.numel() * q.element_size()))
    dist.destroy_process_group()


def _benchmark(args):
    """Start P gloo processes for each P, collect what rank 0 measured, print the two tables."""
    import socket
    import statistics
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    measured = []
    for P in sorted(args.sequences):
        results = context.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_benchmark_rank, args=(P, port, args, results), nprocs=P, start_method="spawn")
        while not results.empty():
            measured.append(results.get())
    B, H, D, Hkv, e = args.batch_size, args.heads, args.head_dim, args.kv_heads, 4

    def formula(name, P, S):  # bytes a rank sends, forward + backward, in closed form (P divides the heads)
        if name.startswith("(d)"):  # k and v gathered forward, their gradients reduce-scattered backward
            return 4 * B * S * Hkv * D * (P - 1) // P * e
        return 0 if name.startswith("(a)") else 2 * (2 * H + 2 * Hkv) * B * S * D * (P - 1) // P**2 * e

    timed = {(P, S): (times, sent) for _, P, S, times, sent in (m for m in measured if m[0] == "time")}
    median = lambda t: statistics.median(t[1:])  # the first repetition is a warm-up
    print(f"one attention layer, forward + backward: B={B} H={H} kv heads={Hkv} D={D}, float32, causal SDPA, gloo; "
          f"median of {args.reps}; overhead = time - (a), paired by repetition; middle half: its quartiles")
    print(f"{'P':>2} {'S':>6}  {'variant':<22} {'ms':>8} {'overhead ms':>12} {'middle half':>12} {'vs (c)':>7} "
          f"{'bytes sent/rank':>16} {'formula':>13}")
    for P in args.sp:
        times, sent = timed[P, args.seq_len]
        overheads = {name: [b - a for a, b in zip(times["(a) kernel alone"][1:], t[1:])] for name, t in times.items()}
        overhead = {name: statistics.median(o) for name, o in overheads.items()}
        for name, t in times.items():
            versus = f"{overhead[name] / overhead['(c) 3 all-to-alls']:.2f}x" if name[1] in "bc" else ""
            low, _, high = statistics.quantiles(overheads[name], n=4)
            print(f"{P:>2} {args.seq_len:>6}  {name:<22} {median(t) * 1e3:8.1f} {overhead[name] * 1e3:12.1f} "
                  f"{f'{low * 1e3:.0f} to {high * 1e3:.0f}':>12} {versus:>7} {sent[name]:>16,} "
                  f"{formula(name, P, args.seq_len):>13,}")
    for _, P, S, name, peak, q_bytes in (m for m in measured if m[0] == "memory"):
        print(f"peak memory of the layer, P={P} S={S}, rank 0 (MemTracker): {name} {peak / 2**20:.1f} MiB "
              f"(q on this rank: {q_bytes / 2**20:.1f} MiB)")
    print(f"weak scaling, S = {args.weak_seq_len} x P: bytes each rank sends (formula) and time")
    print(f"{'P':>2} {'S':>6}  {'(b) bytes (formula)':>24} {'(d) bytes (formula)':>24} {'(a) ms':>8} {'(b) ms':>8} "
          f"{'(d) ms':>8}")
    for P in (1, 2, 4):
        S = args.weak_seq_len * P
        times, sent = timed[P, S]
        b, d = (name if name in times else "(a) kernel alone" for name in ("(b) ulysses_attention",
                                                                          "(d) all-gather k, v"))
        bytes_and_formula = lambda name: f"{sent[name]:,} ({formula(name, P, S):,})"
        ms = lambda name: f"{median(times[name]) * 1e3:8.1f}"
        print(f"{P:>2} {S:>6}  {bytes_and_formula(b):>24} {bytes_and_formula(d):>24} {ms('(a) kernel alone')} "
              f"{ms(b)} {ms(d)}")


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="Benchmark one Ulysses attention layer against its alternatives: "
                                "(a) the attention kernel alone, (b) ulysses_attention, (c) q, k and v in three "
                                "all-to-alls, (d) all-gathered k and v", allow_abbrev=False)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence for the main table")
    p.add_argument("--weak-seq-len", type=int, default=1024, help="tokens per rank in the weak-scaling rows")
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4], help="SP sizes of the main table")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--reps", type=int, default=25, help="timed repetitions (after one warm-up)")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="measure peak memory")
    args = p.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    if args.reps < 2:
        p.error(f"--reps {args.reps}: must be at least 2 (the table gives the quartiles of the overhead)")
    for P in sorted(set(args.sp) | {2, 4}):  # (c) splits evenly; the weak-scaling rows run on 2 and 4 ranks
        if P < 2 or args.heads % P or args.kv_heads % P:
            p.error(f"--sp {P}: each SP size must be at least 2 and divide --heads {args.heads} and --kv-heads "
                    f"{args.kv_heads} (the weak-scaling rows use 2 and 4 as well)")
    args.sequences = {P: [args.seq_len] for P in args.sp}  # P -> the sequence lengths to time on P ranks
    for P in (1, 2, 4):
        args.sequences.setdefault(P, [])
        if args.weak_seq_len * P not in args.sequences[P]:
            args.sequences[P].append(args.weak_seq_len * P)
    _benchmark(args)
