"""
Ulysses sequence parallelism: attention over a sequence that no single rank holds.

Each of the P ranks of a sequence-parallel (SP) group holds S/P consecutive tokens of every sequence, with
all H attention heads. Attention needs the whole sequence, but each head is independent of the others. So one
all-to-all trades the split: afterwards every rank holds the WHOLE sequence for H/P of the heads, runs any
ordinary attention kernel on it, and a second all-to-all trades back.

    rank r holds          all-to-all          rank r holds              all-to-all        rank r holds
    tokens r, all heads  ------------->  all tokens, heads r  --attn-->  ------------->  tokens r, all heads
    [B, S/P, H, D]       seq_to_heads       [B, S, H/P, D]              heads_to_seq      [B, S/P, H, D]

Each rank sends (P-1)/P of its local tensor, so the bytes per rank and link fall as 1/P when P grows with S
(Megatron-style SP all-gathers the full activation instead). The backward of an all-to-all is the opposite
all-to-all, so training costs the same traffic again.

This file depends on torch alone: copy it into your own project. The bytes it sends are counted in
`all_to_all_stats`, so a training script can print what was really sent.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # optional: flash-attn's kernels take the [B, S, H, D] layout as it is
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:
    flash_attn_func = flash_attn_varlen_func = None

# what this process has sent to other ranks: {"forward"|"backward": {"calls": int, "bytes": int}}
all_to_all_stats = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}


def reset_all_to_all_stats():
    for counts in all_to_all_stats.values():
        counts["calls"], counts["bytes"] = 0, 0


def _all_to_all(x, group, scatter_dim, gather_dim, direction):
    """Split x into P chunks along scatter_dim, send chunk j to rank j, concatenate the P received chunks
    along gather_dim (chunk i came from rank i). One collective call."""
    P = dist.get_world_size(group)
    # seq_to_heads shown: x (B, S/P, H, D) -> P chunks (B, S/P, H/P, D) -> send (P, B, S/P, H/P, D), row j to rank j
    send = torch.stack(x.chunk(P, dim=scatter_dim))
    recv = torch.empty_like(send)  # (P, B, S/P, H/P, D): row i holds rank i's tokens, of my heads
    dist.all_to_all_single(recv, send, group=group)
    all_to_all_stats[direction]["calls"] += 1
    all_to_all_stats[direction]["bytes"] += send.numel() * send.element_size() * (P - 1) // P  # my row stays
    return torch.cat(recv.unbind(0), dim=gather_dim)  # rows in rank order along the sequence: (B, S, H/P, D)


class _AllToAll(torch.autograd.Function):
    """The all-to-all as an autograd op. Its backward is the same all-to-all with scatter and gather swapped:
    the gradient of each received chunk goes back to the rank that sent it."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim, direction="forward")

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim, direction="backward"), None, None, None


def seq_to_heads(x, group):
    """[B, S/P, H, D] (my tokens, all heads) -> [B, S, H/P, D] (all tokens, my heads). Backward: heads_to_seq."""
    return _AllToAll.apply(x, group, 2, 1)


def heads_to_seq(x, group):
    """[B, S, H/P, D] (all tokens, my heads) -> [B, S/P, H, D] (my tokens, all heads). Backward: seq_to_heads."""
    return _AllToAll.apply(x, group, 1, 2)


def _sdpa(q, k, v, **kwargs):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D), SDPA's layout
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)
    return out.transpose(1, 2)  # (B, H, S, D) -> (B, S, H, D)


def causal_attention(q, k, v):
    """Default kernel. q [B, S, Hq, D], k and v [B, S, Hkv, D] with Hq a multiple of Hkv -> [B, S, Hq, D]."""
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_func(q, k, v, causal=True)
    return _sdpa(q, k, v, is_causal=True)


def local_attention(q, k, v, window):
    """Sliding-window causal attention: token i sees tokens i-window+1 .. i. Same layout as causal_attention.
    It is not dense causal attention, yet ulysses_attention runs it unchanged: the wrapper only moves heads."""
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0))
    i = torch.arange(q.shape[1], device=q.device)
    distance = i[:, None] - i[None, :]  # (S, S): query index minus key index
    return _sdpa(q, k, v, attn_mask=(distance >= 0) & (distance < window))


def document_attention(q, k, v, position_ids, window=None):
    """Causal (or sliding-window) attention inside each document of a packed sequence, never across documents.
    position_ids [B, S] are the positions of the FULL sequence; a document starts wherever they are 0. On CUDA
    with flash-attn one variable-length kernel call covers all documents; otherwise SDPA runs per document,
    so memory grows with the longest document, never as S^2."""
    B, S, Hq, D = q.shape
    starts = position_ids.flatten() == 0  # (B*S,)
    starts[::S] = True  # each row of the batch starts a document
    cu_seqlens = torch.cat([starts.nonzero().flatten(), torch.tensor([B * S], device=q.device)])  # (documents + 1,)
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # (B*S, heads, D): the batch as one long token stream
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu_seqlens = cu_seqlens.to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True,
                                     window_size=(window - 1, 0) if window else (-1, -1))
    else:
        bounds = cu_seqlens.tolist()
        documents = [(q[None, s:e], k[None, s:e], v[None, s:e]) for s, e in zip(bounds[:-1], bounds[1:])]
        out = torch.cat([(local_attention(*d, window) if window else causal_attention(*d))[0] for d in documents])
    return out.view(B, S, Hq, D)


def gather_sequence(x, group):
    """[B, S/P] -> [B, S]: all-gather a small per-token tensor (position ids: B*S integers, never a mask) over
    the SP group, so that a kernel that runs on the full sequence knows its document boundaries."""
    P = 1 if group is None else dist.get_world_size(group)
    if P == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def sp_sizes(n_head, n_kv_head):
    """The SP sizes that can split these heads: P divides n_head, and P and n_kv_head divide one another."""
    return [p for p in range(1, n_head + 1) if n_head % p == 0 and (n_kv_head % p == 0 or p % n_kv_head == 0)]


def kv_heads_to_send(n_head, n_kv_head, sp):
    """How many key/value heads go into the all-to-all, or ValueError for a head layout that cannot be split."""
    if sp not in sp_sizes(n_head, n_kv_head):
        problem = (f"n_head={n_head} is not divisible by sp={sp}" if n_head % sp else
                   f"n_kv_head={n_kv_head} and sp={sp}: one must divide the other")
        raise ValueError(f"{problem}; choose sp in {{{', '.join(map(str, sp_sizes(n_head, n_kv_head)))}}}")
    if n_kv_head % sp == 0:
        return n_kv_head  # every rank receives n_kv_head/sp heads, the ones its n_head/sp query heads use
    return sp  # sp % n_kv_head == 0: each kv head is copied sp/n_kv_head times, every rank receives exactly one


def ulysses_attention(q, k, v, group=None, attn_fn=None, **attn_kwargs):
    """Attention over the full sequence when each rank holds S/P tokens.

    q [B, S/P, Hq, D], k and v [B, S/P, Hkv, D] -> [B, S/P, Hq, D]. attn_fn(q, k, v, **attn_kwargs) sees the
    full sequence in the same layout, [B, S, heads, D]; it defaults to causal attention. group=None or a group
    of one rank runs attn_fn directly. Costs one all-to-all for q, k and v together and one for the output.
    """
    attn_fn = attn_fn or causal_attention
    P = 1 if group is None else dist.get_world_size(group)
    if P == 1:
        return attn_fn(q, k, v, **attn_kwargs)
    B, S_local, Hq, D = q.shape
    Hkv = k.shape[2]
    n_send = kv_heads_to_send(Hq, Hkv, P)
    if n_send != Hkv:  # kv head j is used by query heads [j*Hq/Hkv, (j+1)*Hq/Hkv), which land on P/Hkv ranks
        k, v = (t.repeat_interleave(n_send // Hkv, dim=2) for t in (k, v))  # (B, S/P, Hkv, D) -> (B, S/P, P, D)
    # Pack q, k, v so that the chunk for rank j holds its query heads and the kv heads they use:
    # (B, S/P, heads, D) -> (B, S/P, P, heads/P, D), concatenated -> (B, S/P, P*(hq + 2*hkv), D)
    hq, hkv = Hq // P, n_send // P
    qkv = torch.cat([t.reshape(B, S_local, P, -1, D) for t in (q, k, v)], dim=3).flatten(2, 3)
    qkv = seq_to_heads(qkv, group)  # (B, S, hq + 2*hkv, D)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)  # (B, S, hq, D), (B, S, hkv, D), (B, S, hkv, D)
    out = attn_fn(q, k, v, **attn_kwargs)  # (B, S, hq, D)
    return heads_to_seq(out, group)  # (B, S/P, Hq, D)
