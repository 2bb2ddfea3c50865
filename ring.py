"""
Ring attention: causal (or full) attention over a sequence split over the R ranks of a ring. A rank keeps its
queries while keys and values travel. With ulysses.py: Ulysses x Ring (USP), for more ranks than heads.

Rank r holds L = S/R tokens. At each of R steps it attends its queries to the key/value block it holds; in all
but the last it meanwhile sends that block to rank r+1 and receives rank r-1's. Then every query has met every key:

    step         0      1      2             kv_j: the key/value block of rank j (R = 3)
    rank 0     kv_0   kv_2   kv_1
    rank 1     kv_1   kv_0   kv_2
    rank 2     kv_2   kv_1   kv_0

Attention over one block gives an output o_b normalized over its keys, and the log of the normalizer, lse_b =
log sum_k exp(score_k). Two results over disjoint keys combine exactly (`merge`):

    lse = log(exp(lse_a) + exp(lse_b))          o = (exp(lse_a) o_a + exp(lse_b) o_b) / exp(lse)

Backward passes the blocks around again and, beside block j, an accumulator (float32 or wider) for dk_j and dv_j:
each rank adds its queries' term, and after R hops it is home, complete. dq stays with the queries.

Zigzag. With contiguous blocks rank 0's queries see one block and rank R-1's see R. Zigzag cuts the sequence into
2R chunks and gives rank r chunks r and 2R-1-r, one early and one late, so every rank does the same causal work
(documents.ring_work):  chunks 0 1 2 3 4 5 6 7  ->  ranks 0 1 2 3 3 2 1 0  (R = 4).

USP. P = U x R ranks: U consecutive ranks form a Ulysses group; the ranks at the same place in each Ulysses group
form a ring. `shard_for_ring` cuts the batch for it, and attention is one line:

    ulysses_attention(q, k, v, ulysses_group, partial(ring_attention, group=ring_group, layout="zigzag"))

Token indices rise along every layout (`check_layout`), so a query's keys in a block are one run (`key_ranges`), causal
or in a window; packed documents are first cut into runs of consecutive tokens of one document (`meeting_runs`). A fused
kernel takes blocks that see every key, or causal ones; the einsum tiles, the readable reference, any other. A sink
(gpt-oss: a logit per head in every softmax, with no value) is one last block to merge. The file reads down the call
path, the operators' autograd wiring last. It needs torch and ulysses.py (size_and_rank).
"""

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from ulysses import size_and_rank  # (ranks, this one's rank) in a group; (1, 0) for None, a ring of one rank

aten = torch.ops.aten  # PyTorch's kernels by name (test_kernels.py puts CPU stand-ins in place of the CUDA ones)


def ring_attention(q, k, v, group=None, layout=None, window=None, causal=True, scale=None, return_lse=False,
                   fused=True, position_ids=None, sinks=None):
    """Attention over a sequence split over the R ranks of `group` (None: this rank alone). q [B, L, Hq, D], k and v
    [B, L, Hkv, D] -> [B, L, Hq, D], contiguous, as q is made (the kernels read D in a row; cuDNN's backward wants q
    and out alike). return_lse: also the log-sum-exp [B, L, Hq], sinks included, float32 or wider, no gradient. layout:
    how the tokens were sharded: "zigzag" (shard_for_ring), "contiguous", or each token's index [B, L] in the padded
    sequence, rising on each rank, each token once over the ring (check_layout), with position_ids. window: the last
    `window` tokens, its own included (0 or None: no window). position_ids [B, L]: 0 where a packed document starts
    (under USP, gathered over the Ulysses group). sinks [Hq]: a logit per head. fused=False: the einsum tiles."""
    R = size_and_rank(group)[0]
    given = torch.is_tensor(layout)  # each token's index, not a layout by name
    if not torch.compiler.is_compiling():  # first: one error on every rank, before a rank could raise alone
        check_same_inputs(q, k, v, sinks, position_ids, layout, group, window, causal)
    if R > 1 and not given and layout not in ("zigzag", "contiguous"):  # a tensor's shape: check_same_inputs
        raise ValueError(f"layout={layout!r}: a ring of {R} ranks takes 'zigzag', 'contiguous' or token indices [B, L]")
    if window and (not causal or window < 0):
        raise ValueError(f"window={window}: a sliding window looks back from each query: 1 or more tokens, causal=True")
    if R > 1 and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"{q.shape[1]} tokens on this rank: zigzag's two equal chunks need an even number")
    indices = (check_layout(layout, group) if given else  # (R, B, L): each ring rank's token indices, or (R, 1, L)
               torch.stack([token_index(layout if R > 1 else "contiguous", j, R, q.shape[1])[None] for j in range(R)]))
    documents = None
    if position_ids is not None:  # each token index's document, a new one wherever position_ids is 0: [B, S]
        ids = gather_ring(position_ids.long(), group).cpu()  # (R, B, L): every ring rank's position_ids, one all-gather
        where = indices.expand_as(ids).transpose(0, 1).flatten(1)  # (B, R*L) = (B, S): each id's token index
        in_order = ids.new_empty(where.shape).scatter_(1, where, ids.transpose(0, 1).flatten(1))  # (B, S), in order
        documents = (in_order == 0).cumsum(1)  # (B, S)
    out, lse = _ring_forward(q.contiguous(), k, v, sinks, documents, indices, group.group_name if group else "",
                             window, causal, q.shape[-1] ** -0.5 if scale is None else scale, fused)
    return (out, lse.transpose(1, 2)) if return_lse else out  # lse (B, Hq, L) -> (B, L, Hq)


# The ring as two operators (custom_op: one call each to torch.compile, so a graph never breaks at them), the
# group by name. Inside: q, out and dq head-major [B, Hq, L, D], kv as it travels [2, B, L, Hkv, D]; indices
# [R, B or 1, L]; documents [B, S], or None.


@torch.library.custom_op("ring::attention", mutates_args=())
def _ring_forward(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, documents: Tensor | None, indices: Tensor,
                  group_name: str, window: int | None, causal: bool, scale: float,
                  fused: bool) -> tuple[Tensor, Tensor]:
    """Pass the key/value blocks around and merge: (out [B, L, Hq, D], lse [B, Hq, L])."""
    group = _resolve_process_group(group_name) if group_name else None
    R, r = size_and_rank(group)
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1]) if fused else "tiles"  # chosen inside the op, untraced
    with torch.autocast(q.device.type, enabled=False):  # the merge in float32 (or float64), whatever autocast
        q_heads = q.transpose(1, 2)  # (B, L, Hq, D) -> (B, Hq, L, D), a view; each kernel widens what it must
        out = q_heads.new_zeros(q_heads.shape, dtype=torch.promote_types(q.dtype, torch.float32))  # (B, Hq, L, D)
        lse = out.new_full(out.shape[:-1], float("-inf"))  # (B, Hq, L): no key yet, so the first block passes through
        kv = torch.stack([k, v])  # (2, B, L, Hkv, D): one message per step but the last, in the input dtype
        for step in range(R):  # at step s this rank holds the block of rank (r - s) mod R
            incoming = pass_on(kv, group, "forward") if step < R - 1 else None  # sent while this block is computed on
            for batch, queries, _, lo, hi, k_b, v_b in _blocks(indices, r, step, kv, documents, window, causal):
                o_b, lse_b = block_attention(q_heads[batch, :, queries], k_b, v_b, lo, hi, scale, kernel)
                merge(out[batch, :, queries], lse[batch, :, queries], o_b, lse_b)
            kv = arrived(*incoming, q.device) if incoming else kv  # the block rank r-1 held this step
        if sinks is not None:  # one more block a query, after all the others: its lse the sink, its output 0
            merge(out, lse, out.new_zeros(()), sinks.to(lse.dtype)[:, None])  # sinks (Hq,) -> (Hq, 1), lse (B, Hq, L)
    return out.transpose(1, 2).to(q.dtype, copy=True, memory_format=torch.contiguous_format), lse  # -> (B, L, Hq, D)


@torch.library.custom_op("ring::attention_backward", mutates_args=())
def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, documents: Tensor | None,
                   indices: Tensor, group_name: str, window: int | None, causal: bool, scale: float,
                   fused: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A second ring carries each block's dk and dv home: (dq, dk, dv) shaped as q, k, v."""
    group = _resolve_process_group(group_name) if group_name else None
    R, r = size_and_rank(group)
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1]) if fused else "tiles"
    with torch.autocast(q.device.type, enabled=False):
        q, out, dout = (t.transpose(1, 2) for t in (q, out, dout.contiguous()))  # (B, Hq, L, D); dout laid as out
        dq = q.new_zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32))  # (B, Hq, L, D)
        kv = torch.stack([k, v])  # (2, B, L, Hkv, D)
        for step in range(R):
            incoming = pass_on(kv, group, "backward") if step < R - 1 else None
            dkv = dq.new_zeros(kv.transpose(2, 3).shape)  # (2, B, Hkv, L, D): my queries' terms for the block I hold
            for batch, queries, keys, lo, hi, k_b, v_b in _blocks(indices, r, step, kv, documents, window, causal):
                dq_b, *dkv_b = block_gradients(q[batch, :, queries], k_b, v_b, out[batch, :, queries],
                                               lse[batch, :, queries], dout[batch, :, queries], lo, hi, scale, kernel)
                dq[batch, :, queries] += dq_b
                dkv[:, batch, :, keys] += torch.stack(dkv_b)  # (2, B or 1, Hkv, keys, D)
            if step > 0:  # rank r-1's sum for this same block, which it held a step ago
                dkv += arrived(*accumulator, q.device)
            accumulator = pass_on(dkv, group, "backward") if R > 1 else (dkv, [])  # to r+1; home after step R-1
            kv = arrived(*incoming, q.device) if incoming else kv
        dk, dv = arrived(*accumulator, q.device).transpose(2, 3)  # my own block's, every rank's term: (B, L, Hkv, D)
    dq = dq.transpose(1, 2)  # (B, Hq, L, D) -> (B, L, Hq, D), a view
    return tuple(t.to(q.dtype, copy=True, memory_format=torch.contiguous_format) for t in (dq, dk, dv))  # own memory


def pass_on(x, group, phase):
    """Start sending x to the next rank and receiving the previous rank's: (received, works), see `arrived`."""
    R, r = size_and_rank(group)
    x = x.cpu() if x.is_cuda and dist.get_backend(group) != "nccl" else x  # gloo sends no CUDA tensor point to point
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, group=group, group_peer=(r + 1) % R),
                                    dist.P2POp(dist.irecv, received, group=group, group_peer=(r - 1) % R)])
    ring_stats[phase]["calls"] += 1  # phase: "forward" or "backward"
    ring_stats[phase]["bytes"] += x.nbytes
    return received, works


def arrived(received, works, device):  # the block, on the device it goes on from (it may come through host memory)
    for work in works:
        work.wait()
    return received.to(device)


def _blocks(indices, r, step, kv, documents, window, causal):
    """The pieces of the block kv [2, B, L, Hkv, D] that rank r holds at `step` which its queries see: (batch, queries,
    keys: slices of the batch, the L queries, the L keys; lo, hi: the i-th of `queries` sees k[:, :, lo[i]:hi[i]]; k,
    v [B or 1, Hkv, keys, D] views). Packed documents: a piece per run of a document's queries and run of its keys."""
    if step == 0 and documents is None and not window and causal and kv.shape[2]:  # own block: query i sees keys 0 .. i
        hi = torch.arange(1, kv.shape[2] + 1)  # (L,): no search needed, token indices rise
        yield slice(None), slice(None), slice(None), torch.zeros_like(hi), hi, *kv.transpose(2, 3)
        return
    q_at, k_at = indices[r], indices[(r - step) % len(indices)]  # (B or 1, L) each: queries' and keys' token indices
    if documents is None or not kv.shape[2]:  # parts: (batch, queries' and keys' starts, their token indices)
        parts = [(slice(None), 0, 0, q_at[0], k_at[0])]
    else:
        q_at, k_at = (t.expand(len(documents), -1) for t in (q_at, k_at))  # (B, L) each: every row's own
        parts = [(slice(b, b + 1), queries.start, keys.start, q_at[b, queries], k_at[b, keys])
                 for b, row in enumerate(documents) for queries, keys in meeting_runs(q_at[b], k_at[b], row)]
    for batch, q_start, k_start, q_index, k_index in parts:
        lo, hi = (k_start + x for x in key_ranges(q_index, k_index, window, causal))  # (run's queries,): block's keys
        if (part := cut(lo, hi)) is None:
            continue
        rows, keys = part  # rows: of the run's queries; keys: of the block
        queries = slice(q_start + rows.start, q_start + rows.stop)  # of the block
        yield batch, queries, keys, lo[rows] - keys.start, hi[rows] - keys.start, *kv[:, batch, keys].transpose(2, 3)


def meeting_runs(q_index, k_index, documents):
    """(queries, keys), slices of q_index [Lq] and k_index [Lk]: each run of consecutive token indices of one document
    (documents [S]: each index's) among the queries, with each run of the same document among the keys."""
    def runs(index):  # {document: [slice, ...]}
        new = F.pad((index.diff() != 1) | (documents[index].diff() != 0), (1, 0), value=True)  # (L,): a run starts
        starts = new.nonzero().flatten()  # (runs,)
        bounds, found = [*starts.tolist(), len(index)], {}
        for document, start, stop in zip(documents[index[starts]].tolist(), bounds, bounds[1:]):
            found.setdefault(document, []).append(slice(start, stop))
        return found
    keys = runs(k_index)
    return [(queries, run) for document, query_runs in runs(q_index).items() for queries in query_runs
            for run in keys.get(document, [])]


# ----------------------------------------------------------------------------------------------------------------
# one block: q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D]; query head i uses kv head i // (Hq/Hkv), never copied; query
# i sees keys lo[i] .. hi[i] - 1. The einsum tiles take QUERY_TILE queries at a time, in float32 (or float64).

QUERY_TILE = 512


def block_attention(q, k, v, lo, hi, scale, kernel):
    """(out normalized over the block's keys [B, Hq, Lq, D], lse [B, Hq, Lq]); a query that sees none: 0 and -inf."""
    if kernel != "tiles" and (mask := _fused_mask(lo, hi, k.shape[2])) is not None:
        return FUSED[kernel][0](q, k, v, mask == "causal", scale)
    q, k, v = (at_least_float32(t) for t in (q, k, v))
    q = q.unflatten(1, (k.shape[1], -1))  # (B, Hq, Lq, D) -> (B, Hkv, G, Lq, D): G query heads per kv head
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # (B, Hkv, G, Lq, D)
    lse = q.new_full(q.shape[:-1], float("-inf"))  # (B, Hkv, G, Lq)
    for queries, keys, scores in _tiles(q, k, lo, hi, scale):  # scores (B, Hkv, G, T, keys)
        top = scores.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)  # (B, Hkv, G, T, 1); 0 for a row that sees none
        p = scores.sub_(top).exp_()  # unnormalized, in place: the largest of a row is 1
        total = p.sum(-1)  # (B, Hkv, G, T)
        # divided by the sum, as one softmax is: exp(scores - lse) would carry lse's rounding into every output
        out[..., queries, :] = torch.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, keys]) / total.clamp(min=1e-30)[..., None]
        lse[..., queries] = top.squeeze(-1) + total.log()  # log of the softmax's normalizer; -inf for no key
    return out.flatten(1, 2), lse.flatten(1, 2)  # (B, Hq, Lq, D), (B, Hq, Lq)


def merge(out, lse, block_out, block_lse):
    """Fold one block's result into the running one, in place (out, lse: views). logaddexp takes log(e^a + e^b) as
    max(a, b) + log(1 + e^-|a - b|): the larger passes exactly; the rounding of a - b reaches only the correction."""
    torch.logaddexp(lse, block_lse, out=lse)  # -inf where both are -inf
    w = (block_lse - lse).exp_().nan_to_num_(0.0)  # e^lse_b / e^lse, the block's share; 0 where both are -inf
    out.lerp_(block_out, w[..., None])  # o_a + w (o_b - o_a) = (1 - w) o_a + w o_b, the file's formula


def block_gradients(q, k, v, out, lse, dout, lo, hi, scale, kernel):
    """dq, dk, dv from the FINAL out and lse: p is then the true attention to these keys, delta the true correction."""
    if kernel != "tiles" and (mask := _fused_mask(lo, hi, k.shape[2])) is not None:
        return FUSED[kernel][1](dout, q, k, v, out, lse, mask == "causal", scale)
    q, k, v, out, dout = (at_least_float32(t) for t in (q, k, v, out, dout))
    q, out, dout = (t.unflatten(1, (k.shape[1], -1)) for t in (q, out, dout))  # (B, Hq, Lq, D) -> (B, Hkv, G, Lq, D)
    lse = lse.unflatten(1, (k.shape[1], -1))  # (B, Hkv, G, Lq)
    delta = (dout * out).sum(-1)  # (B, Hkv, G, Lq)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for queries, keys, scores in _tiles(q, k, lo, hi, scale):  # scores (B, Hkv, G, T, keys)
        p = scores.sub_(lse[..., queries, None]).exp_()  # the block's share of the final softmax
        dv[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", p, dout[..., queries, :])
        dp = torch.einsum("bhgqd,bhkd->bhgqk", dout[..., queries, :], v[:, :, keys])  # (B, Hkv, G, T, keys)
        dscores = dp.sub_(delta[..., queries, None]).mul_(p).mul_(scale)  # through the softmax and the scale
        dq[..., queries, :] = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k[:, :, keys])
        dk[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", dscores, q[..., queries, :])
    return dq.flatten(1, 2), dk, dv  # (B, Hq, Lq, D), (B, Hkv, Lk, D) x2


def _fused_mask(lo, hi, Lk):
    """"full" when every query sees every key, "causal" when query i sees keys 0 .. i of a square block, else None."""
    causal = len(hi) == Lk and (hi == torch.arange(1, Lk + 1)).all()
    return None if (lo != 0).any() else "full" if (hi == Lk).all() else "causal" if causal else None


def _tiles(q, k, lo, hi, scale):
    """(queries, keys, scaled scores [B, Hkv, G, T, keys], -inf where a key is not seen) for each tile that sees any."""
    for start in range(0, len(lo), QUERY_TILE):
        if (part := cut(lo[start:start + QUERY_TILE], hi[start:start + QUERY_TILE])) is None:
            continue
        rows, keys = part  # rows of this tile
        queries = slice(start + rows.start, start + rows.stop)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q[..., queries, :], k[:, :, keys]).mul_(scale)
        key = torch.arange(keys.start, keys.stop)  # (keys,)
        hidden = (key < lo[queries, None]) | (key >= hi[queries, None])  # (T, keys)
        yield queries, keys, scores.masked_fill_(hidden.to(q.device), float("-inf")) if hidden.any() else scores


# ----------------------------------------------------------------------------------------------------------------
# the fused kernels, a (forward, backward) pair each in FUSED, named by `block_kernel`, a function of what decides it:
# a test without a GPU asks it what a GPU runs, and runs that through stand-ins with their contracts (test_kernels.py)


def block_kernel(device_type, dtype, head_dim, gpu=None):
    """"cpu_flash" on CPU. On CUDA, fp16 or bf16, a head size a multiple of 8: "cudnn" (causal; full: flash) up to 128
    on Hopper with cuDNN after 9.15.0, as SDPA prefers, else "cuda_flash" up to 256. Else "tiles". gpu: cuda_gpu()'s."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return "cpu_flash" if device_type == "cpu" else "tiles"
    (major, _), cudnn = gpu or cuda_gpu()
    return "cudnn" if major == 9 and cudnn > 91500 and head_dim <= 128 else "cuda_flash"


def cuda_gpu():  # (compute capability, cuDNN version) of the current GPU: ((9, 0), 91900), an H200 with cuDNN 9.19
    return torch.cuda.get_device_capability(), torch.backends.cudnn.version() or 0


def at_least_float32(t):  # 16-bit floats as float32; float32 and float64 as they are
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _cpu_flash_forward(q, k, v, causal, scale):  # any head size, grouped heads; 16-bit as float32 (exact)
    return aten._scaled_dot_product_flash_attention_for_cpu(*map(at_least_float32, (q, k, v)), 0.0, causal, scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v, out = map(at_least_float32, (dout, q, k, v, out))
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cuda_forward(q, k, v, causal, scale, cudnn=False):
    """PyTorch's CUDA flash kernel takes the last dim contiguous, fp16 or bf16 alike for q, k, v, a head size that is a
    multiple of 8 up to 256 (SDPA pads; this call does not), Hq a multiple of Hkv. cuDNN's: head size <= 128, two
    keys or more (a one-key block is "full"), lse [B, Hq, Lq, 1], causal blocks only (full ones go to flash)."""
    if cudnn and causal:
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, scale=scale)[:2]
        return out.float(), lse.squeeze(-1)  # lse (B, Hq, Lq, 1) -> (B, Hq, Lq)
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out.float(), lse


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, cudnn=False):
    """Each reads the lse as CONTIGUOUS memory (a view, as zigzag's half rows, gives wrong gradients silently), dout
    and out in q's dtype; cuDNN's, dout and out laid out as q (PyTorch keys its cached graph on q, k, v's strides)."""
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
    if cudnn and causal:
        return aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse.unsqueeze(-1).contiguous(),
                                                                 no_rng, no_rng, None, None, None, q.shape[2],
                                                                 k.shape[2], 0.0, True, scale=scale)  # lse 4-D
    return aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        no_rng, no_rng, scale=scale)


FUSED = {"cpu_flash": (_cpu_flash_forward, _cpu_flash_backward), "cuda_flash": (_cuda_forward, _cuda_backward),
         "cudnn": (partial(_cuda_forward, cudnn=True), partial(_cuda_backward, cudnn=True))}


# ----------------------------------------------------------------------------------------------------------------
# the token layout: which tokens a rank holds, and which keys its queries see


def token_index(layout, rank, R, L):
    """Ring rank `rank`'s L token indices: one block ("contiguous"), or chunks rank and 2R-1-rank of 2R ("zigzag")."""
    chunks, n = ([rank, 2 * R - 1 - rank], L // 2) if layout == "zigzag" else ([rank], L)  # of 2R, or of R chunks
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks])  # (L,)


def key_ranges(q_index, k_index, window=None, causal=True):
    """(lo, hi) [Lq]: query i sees keys lo[i] .. hi[i] - 1, one run of k_index (its indices rise). Never a mask."""
    hi = torch.searchsorted(k_index, q_index, right=True) if causal else torch.full_like(q_index, len(k_index))
    lo = torch.searchsorted(k_index, q_index - window, right=True) if window else torch.zeros_like(hi)  # (Lq,)
    return lo, hi


def cut(lo, hi):
    """(rows, cols): the least slices holding each query that sees a key and each key seen (lo, hi rising); or None."""
    seen = (hi > lo).nonzero().flatten()  # (queries that see a key,)
    rows = slice(seen[0].item(), seen[-1].item() + 1) if len(seen) else None
    return None if rows is None else (rows, slice(lo[rows].min().item(), hi[rows].max().item()))


def shard_for_ring(input_ids, labels, position_ids, ulysses_group, ring_group, layout=None):
    """Full sequences [B, S] -> this rank's [B, S_pad/P] input ids, labels (shifted before), position ids and token
    index (its place in the padded sequence), P = U x R. Pads to a multiple of 2P (P for a ring of one, as
    ulysses.shard_for_sp): input 0, label -100, positions counting on. Ring rank r takes zigzag chunks r and 2R-1-r, or
    layout(padded position ids, R)[:, r] ([B, R, S_pad/R]: documents.document_layout's), split over its U ranks."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape or position_ids.shape != input_ids.shape:
        raise ValueError(f"shard_for_ring: input_ids {tuple(input_ids.shape)}, labels {tuple(labels.shape)}, "
                         f"position_ids {tuple(position_ids.shape)}: want [B, S] each, labels already shifted")
    (U, u), (R, r) = size_and_rank(ulysses_group), size_and_rank(ring_group)
    pad = -input_ids.shape[1] % (U if R == 1 else 2 * U * R)
    counting_on = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)  # (B, pad)
    padded = [F.pad(input_ids, (0, pad)), F.pad(labels, (0, pad), value=-100),
              torch.cat([position_ids, counting_on], 1)]  # (B, S_pad) each
    B, S_pad = padded[0].shape
    index = (layout(padded[2], R)[:, r] if R > 1 and layout is not None else  # (B, R, S_pad/R) -> (B, S_pad/R)
             token_index("zigzag" if R > 1 else "contiguous", r, R, S_pad // R).expand(B, -1))  # (B, S_pad/R)
    index = index.to(input_ids.device)  # a layout's indices are checked where attention takes them (check_layout)
    return tuple(t.chunk(U, dim=1)[u] for t in [t.gather(1, index) for t in padded] + [index])  # (B, S_pad/P) each


def check_layout(layout, group):
    """Every ring rank's token indices [B, L], as [R, B, L]; ValueError unless rising, each once (not when compiled)."""
    every = gather_ring(layout.long(), group).cpu()  # (R, B, L)
    tokens = every.transpose(0, 1).flatten(1)  # (B, R*L) = (B, S)
    if not torch.compiler.is_compiling() and ((every.diff(dim=-1) <= 0).any() or
                                              (tokens.sort(-1).values != torch.arange(tokens.shape[1])).any()):
        raise ValueError("layout: each ring rank must hold rising token indices, each token once")
    return every


# ----------------------------------------------------------------------------------------------------------------
# plumbing: the bytes sent, the check every rank agrees on, gathers, what torch.compile sees

ring_stats = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}  # what this process sent


def reset_ring_stats():
    ring_stats.update(forward={"calls": 0, "bytes": 0}, backward={"calls": 0, "bytes": 0})


def ring_bytes(R, kv_bytes, dkv_bytes):
    """(forward, backward) bytes a rank sends per call: R-1 kv blocks, and backward R dk/dv accumulators too (R > 1)."""
    return (R - 1) * kv_bytes, (R - 1) * kv_bytes + (R * dkv_bytes if R > 1 else 0)


def check_same_inputs(q, k, v, sinks, position_ids, layout, group, window=None, causal=True):
    """One ValueError on every rank unless q, k, v fit together (sinks [Hq]; position_ids and token indices `layout`
    [B, L], if given) and match on every ring rank, options too: else gloo aborts, ranks wait, or compute apart."""
    dtypes, given = [torch.float64, torch.float32, torch.bfloat16, torch.float16], torch.is_tensor(layout)
    fit = (q.dim() == k.dim() == 4 and k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
           and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0 and q.dtype == k.dtype == v.dtype and q.dtype in dtypes
           and (sinks is None or sinks.shape == q.shape[2:3])
           and (position_ids is None or position_ids.shape == q.shape[:2])
           and (not given or layout.shape == q.shape[:2] and position_ids is not None))
    mine = ([*q.shape, k.shape[2], dtypes.index(q.dtype), position_ids is not None, sinks is not None, int(window or 0),
             causal, 2 if given else {"zigzag": 0, "contiguous": 1}.get(str(layout), 3)] if fit else [-1] * 11)
    every = gather_ring(torch.tensor([mine], device=q.device if group else "cpu"), group)[:, 0].tolist()  # (R, 11)
    if every[0][0] < 0 or any(row != every[0] for row in every):
        shown = "; ".join(f"{rank}: {'unfit' if row[0] < 0 else [*row[:5], dtypes[row[5]], *row[6:]]}"
                          for rank, row in enumerate(every))
        this = "" if fit else " (this rank: " + ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in dict(
            q=q, k=k, v=v, sinks=sinks, position_ids=position_ids, layout=layout).items() if torch.is_tensor(t)) + ")"
        raise ValueError(f"the inputs differ between the ranks or do not fit together ([B, L, Hq, D, Hkv, dtype, "
                         f"position_ids?, sinks?, window, causal, layout: 0 zigzag, 1 contiguous, 2 indices, 3 none or "
                         f"another] by rank: {shown}){this}; want q [B, L, Hq, D], k and v [B, L, Hkv, D], one dtype, "
                         f"Hkv dividing Hq, sinks [Hq], position_ids [B, L] (USP: gathered), indices only with them")


def gather_ring(x, group):
    """x (any shape, here [B, L]) of every rank of the group: [R, B, L], on x's device. One all-gather."""
    if group is None:
        return x[None]  # (1, B, L)
    every = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]  # (B, L) of each rank
    dist.all_gather(every, x.contiguous(), group=group)
    return torch.stack(every)  # (R, B, L)


# what torch.compile sees of the operators: their outputs' shapes and strides (new contiguous tensors), and autograd
_ring_forward.register_fake(lambda q, k, v, *rest: (q.new_empty(q.shape), q.new_empty(
    q.shape[0], q.shape[2], q.shape[1], dtype=torch.promote_types(q.dtype, torch.float32))))  # out, lse (B, Hq, L)
_ring_backward.register_fake(lambda dout, q, k, v, *rest: tuple(t.new_empty(t.shape) for t in (q, k, v)))


def _keep_ring(ctx, inputs, output):
    q, k, v, sinks, documents, indices, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, *output, sinks, documents, indices)
    ctx.mark_non_differentiable(output[1])


def _ring_gradients(ctx, dout, _):
    """dq, dk, dv by the backward ring. A sink has no value, so its gradient needs no ring: -sum p_sink delta here."""
    q, k, v, out, lse, sinks, documents, indices = ctx.saved_tensors
    dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, documents, indices, *ctx.options)
    if sinks is not None:
        delta = (at_least_float32(dout) * at_least_float32(out)).sum(-1).transpose(1, 2)  # (B, L, Hq) -> (B, Hq, L)
        sinks = -(torch.exp(sinks.to(lse.dtype)[:, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)  # (Hq,)
    return dq, dk, dv, sinks, None, None, *[None] * len(ctx.options)


_ring_forward.register_autograd(_ring_gradients, setup_context=_keep_ring)
