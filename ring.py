"""
Ring attention: causal attention over a sequence split across the R ranks of a ring, each rank keeping its
own queries for every head while the keys and values travel. With ulysses.py it becomes Ulysses x Ring (USP),
sequence parallelism over more ranks than there are heads.

Ulysses hands each rank whole heads, so one sequence can use at most n_head ranks. A ring splits the other
way. Rank r holds a block of L = S/R tokens with all their heads; at each of R steps it attends its queries to
the key/value block it holds, while it passes that block on to rank r+1 and receives rank r-1's. After R
steps every query has met every key, and no rank ever held more than two key/value blocks (in backward, also up
to three dk/dv accumulators):

    step         0      1      2             kv_j: the key/value block of rank j (R = 3)
    rank 0     kv_0   kv_2   kv_1            each step sends the block to the next rank while the
    rank 1     kv_1   kv_0   kv_2            current one is being computed on
    rank 2     kv_2   kv_1   kv_0

Softmax over keys seen one block at a time. Attention over one block gives an output normalized over that
block's keys, o_b, and the log of its normalizer, lse_b = log sum_k exp(score_k). Two such results over
disjoint keys combine exactly:

    lse = log(exp(lse_a) + exp(lse_b))                 the normalizer over both blocks
    o   = (exp(lse_a) o_a + exp(lse_b) o_b) / exp(lse)  each output weighted by its share of it

written with sigmoids so that nothing overflows (`merge`), in float32 (float64 for float64 inputs). A row starts
with no keys (lse = -inf), so the first block merged into it passes through exactly; every query sees at least
itself, in its own block.

Backward is a second ring. The gradient of the keys and values of block j collects a term from every rank's
queries, so an accumulator for dk_j and dv_j travels with block j: each rank adds its term and passes both on,
and after R hops the accumulator is back home, complete. dq stays where the queries are.

Causal load balance. With contiguous blocks rank 0's queries see only their own block, and rank R-1's see all
R. Zigzag instead cuts the sequence into 2R chunks, and rank r holds chunks r and 2R-1-r: one early, one late.
Then every block from another rank costs half a block of work on every rank (`ring_work` counts it):

    chunks     0  1  2  3  4  5  6  7         R = 4: rank 0 holds chunks 0 and 7, rank 1 holds 1 and 6, ...
    rank       0  1  2  3  3  2  1  0

USP. An SP group of P = U x R ranks: U consecutive ranks form a Ulysses group, and the ranks at the same place
in each of the R Ulysses groups form a ring. This is all it takes:

    ulysses_attention(q, k, v, ulysses_group, partial(ring_attention, group=ring_group, layout="zigzag"))

The all-to-all gives each rank whole heads of its ring block, the ring runs over the blocks, and the all-to-all
gives the heads back. ulysses.shard_for_sp lays the tokens out in the zigzag order for it.

Packed documents. A query sees the keys of its own document only. Documents start where the global positions
are 0, so each rank learns every token's document once (an all-gather of the position ids). Each block is then
cut into runs of consecutive positions inside one document, and each run of queries meets the runs of its own
document's keys (`meeting_runs`): every key of a run that ends before it, causal on its own run, none after. So
the work is each document's own triangle, and without a window every piece is one the fused kernel takes.

Attention sinks (gpt-oss). Each query head h has a learned logit s_h that joins every query's softmax as one more
score, with no value: the denominator gains exp(s_h), and the output shrinks by the sink's share of it. To the
merge the sink is one more block, with lse = s_h and output 0, so the ring folds it in once per query, after all
the blocks (never once per block, which would count it R times):

    out <- out * sigmoid(lse - s_h)      lse <- log(exp(lse) + exp(s_h))

Backward needs nothing new for q, k and v: it already works from the final out and lse, and with the sink in the
denominator delta = rowsum(dout * out) is still the softmax's correction. The sink's own gradient is
d s_h = -sum over the queries of exp(s_h - lse) * delta: each rank sums its own queries', and the gradient
reduction of training (a sum over the ranks) makes it whole.

Per-document balance. Zigzag balances the causal work of ONE sequence. With packed documents the work is each
document's own triangle, so a rank that holds the tail of a long document does much more than one that holds
short ones. `document_layout` cuts each long document as zigzag cuts a sequence instead: 2R chunks, rank r
taking chunks r and 2R-1-r of it, and deals what remains (short documents whole) to the least busy rank. A rank
then holds any rising set of positions, not two chunks: shard_for_sp returns the position of each of its tokens
(token_index), and ring_attention takes them as the layout. Nothing else changes, because the keys a query sees
in a block are still one run of the block's positions (`key_ranges`).

    document    0 0 0 0 0 0 0 0 0 0 0 0 1 1 1 1     R = 2, every document cut (MIN_CHUNK = 1); each token's rank:
    zigzag      0 0 0 0 1 1 1 1 1 1 1 1 0 0 0 0     20 and 68 query-key pairs (`document_work` counts them)
    documents   0 0 0 1 1 1 1 1 1 0 0 0 0 1 1 0     44 and 44: each rank an early and a late chunk of each

The attention over one block is a fused flash kernel that returns the log-sum-exp (PyTorch's on CPU; flash-attn's
or PyTorch's on CUDA), with einsum tiles beside it as the readable reference, and for the blocks the fused kernel
does not take (a sliding window's).

The file reads down the call path: `ring_attention`, the ring itself (forward and backward), one step of it, the
attention over one block, and last the token layout and the plumbing (with the fused kernels). It depends on torch
alone (2.6 or later): copy it into your own project. `python bench.py ring` measures it, `python bench.py balance`
the two layouts of packed documents.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

try:  # optional, CUDA only: flash-attn, whose kernels return the log-sum-exp (2.7 or later: see block_kernel)
    import flash_attn
    from flash_attn import flash_attn_interface
    FLASH_ATTN_VERSION = tuple(int(n) for n in flash_attn.__version__.split(".")[:2])  # e.g. (2, 8)
except ImportError:
    flash_attn_interface = FLASH_ATTN_VERSION = None

aten = torch.ops.aten  # PyTorch's kernels, by name (test_kernels.py puts CPU stand-ins of the CUDA ones in their place)


def ring_attention(q, k, v, group=None, layout=None, window=None, causal=True, scale=None, return_lse=False,
                   fused=True, position_ids=None, sinks=None):
    """Attention over a sequence whose tokens are split over the R ranks of `group`, causal unless causal=False.

    q [B, L, Hq, D], k and v [B, L, Hkv, D] with Hq a multiple of Hkv: this rank's L tokens, laid out as
    `layout` says, which a ring of several ranks needs stated, as the tokens were sharded: "zigzag" (chunks r
    and 2R-1-r of 2R, what ulysses.shard_for_sp gives with a ring group) or "contiguous" (tokens [r*L, (r+1)*L)),
    or, with position_ids, a [B, L] tensor of the global position of each of my tokens, rising along each row (the
    token_index shard_for_sp returns, e.g. for document_layout; one more all-gather of B*L integers a call; the
    ranks' positions together must hold each position of the sequence once).
    Returns [B, L, Hq, D], and with return_lse=True also the log-sum-exp of each query's scores (and its sink)
    [B, L, Hq] in float32, float64 for float64 inputs (not differentiable). window: sliding-window attention over the
    last `window` tokens. scale: of the scores, 1/sqrt(D) by default. position_ids [B, L] (packed documents): the
    global positions of this rank's tokens, as shard_for_sp gives them; a document starts where they are 0, and a
    query sees keys of its own document only (one all-gather of them a call). sinks [Hq]: a learned logit per query
    head that joins each query's softmax as a score with no value (gpt-oss's attention sinks), differentiable,
    merged in float32 (float64 for float64 inputs) whatever their dtype. fused=False computes every block with the
    einsum tiles (the reference) instead of the fused kernel that `block_kernel` picks for the device, dtype and
    head size. Ranks whose q, k or v differ in shape or dtype, or a rank whose own q, k and v do not fit together,
    get one ValueError on every rank, naming each rank's value (one all-gather of 7 numbers a call). Differentiable,
    and traceable by torch.compile without packed documents; forward and backward each move R-1 key/value blocks per
    rank, backward also R dk/dv blocks (in float32, or float64 for float64 inputs).
    group=None or a group of one rank: attention over this rank's tokens alone.
    """
    R = size_and_rank(group)[0]
    named = not torch.is_tensor(layout)  # a layout by name, or each token's position
    if R > 1 and named and layout not in ("zigzag", "contiguous"):
        raise ValueError(f"layout={layout!r}: a ring of {R} ranks needs the layout its tokens were sharded in, "
                         f"'zigzag' (ulysses.shard_for_sp with a ring group) or 'contiguous'")
    if not named and (layout.shape != q.shape[:2] or position_ids is None):
        raise ValueError(f"layout {tuple(layout.shape)}: a layout given as positions is [B, L], one for each of my "
                         f"tokens, as shard_for_sp returns them for packed documents, with their position_ids")
    if window and not causal:
        raise ValueError("a sliding window looks back from each query: use it with causal=True")
    if R > 1 and not torch.compiler.is_compiling():
        check_same_inputs(q, k, v, group)  # before any rank refuses alone and leaves the others waiting
    if not _fit_together(q, k, v):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}: "
                         f"{_WANT}")
    if sinks is not None and sinks.shape != q.shape[2:3]:
        raise ValueError(f"sinks {tuple(sinks.shape)}: want one logit per query head, [{q.shape[2]}]")
    if R > 1 and named and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"{q.shape[1]} tokens on this rank: zigzag holds two equal chunks, so an even number "
                         f"(shard_for_sp pads the sequence to a multiple of 2 x the SP size)")
    indices = None if named or R == 1 else gather_ring(layout, group)  # (R, B, L): every rank's positions
    if indices is not None and not torch.compiler.is_compiling():  # every rank holds them all: all refuse alike
        _, B, L = indices.shape
        every_position = torch.arange(R * L, device=indices.device).expand(B, R * L)  # (B, S)
        if not ((indices.diff(dim=-1) > 0).all() and
                torch.equal(indices.transpose(0, 1).reshape(B, R * L).sort(-1).values, every_position)):
            raise ValueError(f"layout: the ring's {R} ranks hold positions that are not a layout of its "
                             f"{R * L} tokens: each rank's must rise along each row, and together hold each "
                             f"position once (as shard_for_sp's token_index does)")
    layout = "given" if indices is not None else layout if R > 1 else "contiguous"
    documents = None if position_ids is None else document_ids(position_ids, group, layout, indices)  # (B, S)
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1]) if fused else "tiles"
    out, lse = _ring_forward(q, k, v, sinks, documents, indices, "" if group is None else group.group_name, layout,
                             window, causal, q.shape[-1] ** -0.5 if scale is None else scale, kernel)
    return (out, lse.transpose(1, 2)) if return_lse else out  # lse (B, Hq, L) -> (B, L, Hq)


# The ring of the opening docstring as two operators of their own (torch.library.custom_op), forward and backward,
# so that torch.compile traces a model through it as one call (shapes and backward are registered at the end of
# the file). The group travels by name. Inside, tensors are head-major, [B, heads, L, D], as the block kernels take
# them: views of the [B, L, heads, D] inputs, no copies. sinks [Hq], or None. documents [B, S]: each token's document
# in sequence order (document_ids), or None. indices [R, B, L]: each ring rank's positions, for layout "given".


@torch.library.custom_op("ring::attention", mutates_args=())
def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                  documents: torch.Tensor | None, indices: torch.Tensor | None, group_name: str, layout: str,
                  window: int | None, causal: bool, scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward passes key/value blocks around and merges: (out [B, L, Hq, D], lse [B, Hq, L])."""
    group = _group(group_name)
    R, r = size_and_rank(group)
    B, L, Hq, D = q.shape
    mask = Mask(layout, window, causal, scale)
    mine = held(layout, indices, r, R, L)  # (L,) or (B, L)
    with torch.autocast(q.device.type, enabled=False):  # the merge in float32 (or float64), whatever autocast
        q_heads = q.transpose(1, 2)  # (B, L, Hq, D) -> (B, Hq, L, D), a view; each kernel widens what it must
        wide = torch.promote_types(q.dtype, torch.float32)
        out = q_heads.new_zeros(B, Hq, L, D, dtype=wide)  # no key yet: the first merged into a row passes through
        lse = q_heads.new_full((B, Hq, L), float("-inf"), dtype=wide)
        kv = torch.stack([k, v])  # (2, B, L, Hkv, D): one message a step, in the input dtype
        for step in range(R):  # at step s this rank holds the block of rank r - s
            if step < R - 1:
                incoming = pass_on(kv, group, "forward")  # sent while this block is computed on
            blocks = _blocks(mine, mask, (r - step) % R, R, kv, documents, indices)
            for batch, rows, _, lo, hi, block_k, block_v in blocks:
                block_out, block_lse = block_attention(q_heads[batch, :, rows], block_k, block_v, lo, hi, scale, kernel)
                merge(out[batch, :, rows], lse[batch, :, rows], block_out, block_lse)
            if step < R - 1:
                kv = arrived(*incoming)
        if sinks is not None:  # one more block, once per query, after all the others: lse = the sink, output 0
            merge(out, lse, 0.0, sinks.to(lse.dtype)[:, None])  # sinks (Hq,) -> (Hq, 1), against lse (B, Hq, L)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse  # (B, Hq, L, D) -> (B, L, Hq, D)


@torch.library.custom_op("ring::attention_backward", mutates_args=())
def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, sinks: torch.Tensor | None, documents: torch.Tensor | None,
                   indices: torch.Tensor | None, group_name: str, layout: str, window: int | None, causal: bool,
                   scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward is a second ring that carries each block's dk and dv home: (dq, dk, dv) shaped as q, k, v, and the
    sinks' gradient [Hq] from my queries (empty without sinks)."""
    group = _group(group_name)
    R, r = size_and_rank(group)
    B, L, Hq, D = q.shape
    Hkv, dtype = k.shape[2], q.dtype
    mask = Mask(layout, window, causal, scale)
    mine = held(layout, indices, r, R, L)  # (L,) or (B, L)
    with torch.autocast(q.device.type, enabled=False):
        q, out, dout = (t.transpose(1, 2) for t in (q, out, dout))  # (B, L, Hq, D) -> (B, Hq, L, D), views
        wide = torch.promote_types(dtype, torch.float32)  # the accumulators: float32, or float64
        dsinks = q.new_empty(0)
        if sinks is not None:  # the sink adds no value, so only the softmax's correction reaches it
            delta = (at_least_float32(dout) * at_least_float32(out)).sum(-1)  # (B, Hq, L)
            p_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse)  # (B, Hq, L): each query's weight on its sink
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)  # (Hq,)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)  # (B, Hq, L, D)
        kv = torch.stack([k, v])  # (2, B, L, Hkv, D)
        for step in range(R):
            if step < R - 1:
                incoming = pass_on(kv, group, "backward")
            dkv = dq.new_zeros(2, B, Hkv, L, D)  # this step's share of the block's dk and dv, a new buffer
            blocks = _blocks(mine, mask, (r - step) % R, R, kv, documents, indices)
            for batch, rows, cols, lo, hi, block_k, block_v in blocks:
                block_dq, block_dk, block_dv = block_gradients(
                    q[batch, :, rows], block_k, block_v, out[batch, :, rows], lse[batch, :, rows],
                    dout[batch, :, rows], lo, hi, scale, kernel)
                dq[batch, :, rows] += block_dq
                dkv[0, batch, :, cols] += block_dk
                dkv[1, batch, :, cols] += block_dv
            if step > 0:  # what the ranks before me added to this block's accumulator
                dkv += arrived(*accumulator)
            # on towards the block's home, where it arrives after step R-1 (a ring of one rank: home already)
            accumulator = pass_on(dkv, group, "backward") if R > 1 else (dkv, [])
            if step < R - 1:
                kv = arrived(*incoming)
        dk, dv = arrived(*accumulator).transpose(2, 3)  # my own block's, with every rank's term: (B, L, Hkv, D)
    dk, dv = (t.to(dtype).clone(memory_format=torch.contiguous_format) for t in (dk, dv))  # outputs own their memory
    return dq.transpose(1, 2).to(dtype).contiguous(), dk, dv, dsinks  # dq (B, Hq, L, D) -> (B, L, Hq, D)


# ----------------------------------------------------------------------------------------------------------------
# one step of the ring: what travels to the next rank, and what my queries need of the block it holds


def pass_on(x, group, phase):
    """Start sending x to the next rank of the ring and receiving the previous rank's tensor of the same shape.
    Returns (received, works): `received` is filled once every work in `works` has been waited on."""
    R, r = size_and_rank(group)
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, group=group, group_peer=(r + 1) % R),
                                    dist.P2POp(dist.irecv, received, group=group, group_peer=(r - 1) % R)])
    ring_stats[phase]["calls"] += 1  # phase: "forward" or "backward", for the counts
    ring_stats[phase]["bytes"] += x.nbytes
    return received, works


def arrived(received, works):
    for work in works:
        work.wait()
    return received


def _blocks(mine, mask, rank, R, kv, documents, indices):
    """What my queries (at positions `mine`) need of the key/value block of ring rank `rank`, held in kv
    [2, B, L, Hkv, D]: a list of (batch: a slice of the batch's rows; rows, cols: the cut, as slices; the rows'
    (lo, hi) within cols; the keys and values of cols, head-major views in the input dtype), empty if my queries
    see none of it. Every row of the batch sees the same keys, unless documents are packed: then each row is cut
    into runs of consecutive positions inside one document (with a layout given per row, at its own positions),
    and each run of my queries meets each run of its document's keys, so that the work is each document's own
    triangle and, without a window, every piece is one the fused kernel takes (every key, or causal)."""
    theirs = held(mask.layout, indices, rank, R, kv.shape[2])  # (L,) or (B, L)
    if documents is None:  # (batch, where my queries and their keys start in the blocks, their positions)
        parts = [(slice(None), 0, 0, mine, theirs)]
    else:
        mine, theirs = (t.expand(len(documents), -1) for t in (mine, theirs))  # (B, L) each: every row's own
        parts = [(slice(b, b + 1), queries.start, keys.start, mine[b, queries], theirs[b, keys])
                 for b, row in enumerate(documents) for queries, keys in meeting_runs(mine[b], theirs[b], row)]
    blocks = []
    for batch, q_start, k_start, q_index, k_index in parts:
        lo, hi = key_ranges(q_index, k_index, mask.window, mask.causal)
        if (part := cut(lo, hi)) is None:
            continue
        rows, cols = part  # within the document's queries and keys; then within the blocks
        queries = slice(q_start + rows.start, q_start + rows.stop)
        keys = slice(k_start + cols.start, k_start + cols.stop)
        block_k, block_v = kv[:, batch, keys].transpose(2, 3)  # (B, Hkv, cols, D) each, views
        blocks.append((batch, queries, keys, lo[rows] - cols.start, hi[rows] - cols.start, block_k, block_v))
    return blocks


def meeting_runs(q_index, k_index, documents):
    """(queries, keys), two slices of q_index [Lq] and k_index [Lk] (positions, rising): each run of consecutive
    positions inside one document among the queries, with each such run of the same document among the keys.
    documents [S]: each position's document."""
    def runs(index):  # {document: [slice, ...]}
        new = torch.ones(len(index), dtype=torch.bool)  # (L,): where a run starts
        new[1:] = (index.diff() != 1) | (documents[index].diff() != 0)
        starts = new.nonzero().flatten()  # (runs,)
        bounds = [*starts.tolist(), len(index)]
        found = {}
        for document, start, stop in zip(documents[index[starts]].tolist(), bounds, bounds[1:]):  # one read of them
            found.setdefault(document, []).append(slice(start, stop))
        return found
    keys = runs(k_index)
    return [(queries, keys_run) for document, query_runs in runs(q_index).items() for queries in query_runs
            for keys_run in keys.get(document, [])]


# ----------------------------------------------------------------------------------------------------------------
# one block: attention of my queries to one key/value block, with the log-sum-exp of each row
#
# q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D], head-major; query head i uses kv head i // (Hq / Hkv) (grouped-query
# attention), and a kv head is never copied. Which keys query i sees comes as one run, keys lo[i] .. hi[i] - 1
# (key_ranges). Two kinds of kernel compute the same numbers:
#
#   fused    the block in one call of a flash-attention kernel that returns the log-sum-exp (`block_kernel` picks
#            which: PyTorch's on CPU; flash-attn's, PyTorch's flash or its memory-efficient kernel on CUDA). It
#            covers the two masks a ring without a window meets: every key (a block from another rank, or its cut, or
#            an earlier run of the same document) and causal on the diagonal (my own block or run, Lq = Lk). It never
#            holds scores against a whole block.
#   tiles    the readable reference, in einsums, for any (lo, hi): QUERY_TILE queries at a time, so the scores in
#            memory are [B, Hq, QUERY_TILE, Lk] at most. It takes the blocks the fused kernel does not cover (a
#            sliding window's), and any block when fused=False or when no fused kernel takes the inputs (float64 on
#            CUDA, say). It computes in float32 (float64 for float64 inputs) on every device: scores, log-sum-exp
#            and the softmax's correction are statistics.

QUERY_TILE = 512


def block_attention(q, k, v, lo, hi, scale, kernel):
    """(output normalized over this block's keys [B, Hq, Lq, D], its log-sum-exp [B, Hq, Lq]), both in float32 (float64
    for float64 inputs), query i seeing keys lo[i] .. hi[i] - 1. A query that sees no key of the block gets output 0
    and lse -inf, which `merge` ignores. kernel: a fused kernel's name (`block_kernel`), or "tiles"."""
    if kernel != "tiles" and (mask := _fused_mask(lo, hi, k.shape[2])) is not None:
        return FUSED[kernel][0](q, k, v, mask == "causal", scale)
    q, k, v = (at_least_float32(t) for t in (q, k, v))
    G = q.shape[1] // k.shape[1]  # query heads per kv head
    q = q.unflatten(1, (k.shape[1], G))  # (B, Hq, Lq, D) -> (B, Hkv, G, Lq, D)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # (B, Hkv, G, Lq, D)
    lse = q.new_full(q.shape[:-1], float("-inf"))  # (B, Hkv, G, Lq)
    for queries, keys, mask in _tiles(lo, hi, q.device):
        scores = _scores(q[..., queries, :], k[:, :, keys], mask, scale)  # (B, Hkv, G, T, keys)
        top = scores.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)  # (B, Hkv, G, T, 1); 0 for a row that sees none
        p = scores.sub_(top).exp_()  # unnormalized, in place: the largest of a row is 1
        total = p.sum(-1)  # (B, Hkv, G, T)
        # divided by the sum, as one softmax is: exp(scores - lse) would carry lse's rounding into every output
        out[..., queries, :] = torch.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, keys]) / total.clamp(min=1e-30)[..., None]
        lse[..., queries] = top.squeeze(-1) + total.log()  # log of the softmax's normalizer; -inf for no key
    return out.flatten(1, 2), lse.flatten(1, 2)  # (B, Hq, Lq, D), (B, Hq, Lq)


def merge(out, lse, block_out, block_lse):
    """Fold one block's result into the running one, in place: the exact softmax over the keys of both. The new lse
    is the larger of the two plus a correction, log(e^a + e^b) = max(a, b) + log(1 + e^-|a - b|): the larger one
    passes through exactly, and the rounding of a - b (large scores: lse in the hundreds, where float32 keeps four
    decimals) only reaches the small correction. lse_a + (lse_b - lse_a) + ... would round there and shift every
    probability of the softmax's backward. A row that has seen no key yet (lse -inf) and sees none here stays so."""
    w = torch.sigmoid(block_lse - lse).nan_to_num_(0.0)  # e^lse_b / e^lse; nan where both are -inf
    out.sub_(w[..., None] * (out - block_out))  # o_a + w (o_b - o_a)
    lse.copy_(torch.maximum(lse, block_lse) - F.logsigmoid((lse - block_lse).abs()).nan_to_num_(0.0))  # log(1+e^-x)


def block_gradients(q, k, v, out, lse, dout, lo, hi, scale, kernel):
    """dq, dk, dv of one block, given the FINAL output and lse of my queries, so that p below is their true
    attention to this block's keys, and delta = rowsum(dout * out) the softmax's true correction: the softmax's
    backward, block by block. Shapes as block_attention's; dk and dv [B, Hkv, Lk, D]; the tiles' in float32 (or
    float64), a fused kernel's as it returns them."""
    if kernel != "tiles" and (mask := _fused_mask(lo, hi, k.shape[2])) is not None:
        return FUSED[kernel][1](dout, q, k, v, out, lse, mask == "causal", scale)
    q, k, v, out, dout = (at_least_float32(t) for t in (q, k, v, out, dout))
    Hkv, G = k.shape[1], q.shape[1] // k.shape[1]
    q, out, dout = (t.unflatten(1, (Hkv, G)) for t in (q, out, dout))  # (B, Hq, Lq, D) -> (B, Hkv, G, Lq, D)
    lse = lse.unflatten(1, (Hkv, G))  # (B, Hkv, G, Lq)
    delta = (dout * out).sum(-1)  # (B, Hkv, G, Lq)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for queries, keys, mask in _tiles(lo, hi, q.device):
        scores = _scores(q[..., queries, :], k[:, :, keys], mask, scale)  # (B, Hkv, G, T, keys)
        p = scores.sub_(lse[..., queries, None]).exp_()  # the block's share of the final softmax
        dv[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", p, dout[..., queries, :])
        dp = torch.einsum("bhgqd,bhkd->bhgqk", dout[..., queries, :], v[:, :, keys])  # (B, Hkv, G, T, keys)
        dscores = dp.sub_(delta[..., queries, None]).mul_(p).mul_(scale)  # through the softmax and the scale
        dq[..., queries, :] = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k[:, :, keys])
        dk[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", dscores, q[..., queries, :])
    return dq.flatten(1, 2), dk, dv  # (B, Hq, Lq, D), (B, Hkv, Lk, D) x2


def _fused_mask(lo, hi, Lk):
    """"full" when every query sees every key, "causal" when query i sees keys 0 .. i of a square block, else
    None: the two masks the fused kernels take."""
    if (lo != 0).any():
        return None
    if (hi == Lk).all():
        return "full"
    return "causal" if len(hi) == Lk and (hi == torch.arange(1, Lk + 1)).all() else None


def _tiles(lo, hi, device):
    """(queries, keys, mask or None) for each tile of up to QUERY_TILE queries that sees any key: slices of the
    block's queries and keys, and the [queries, keys] mask of what each query sees, None when it sees them all."""
    tiles = []
    for start in range(0, len(lo), QUERY_TILE):
        tile_lo, tile_hi = lo[start:start + QUERY_TILE], hi[start:start + QUERY_TILE]
        if (part := cut(tile_lo, tile_hi)) is None:
            continue
        rows, keys = part
        tile_lo, tile_hi = tile_lo[rows], tile_hi[rows]  # (T,)
        queries = slice(start + rows.start, start + rows.stop)
        if (tile_lo == keys.start).all() and (tile_hi == keys.stop).all():
            tiles.append((queries, keys, None))
            continue
        key = torch.arange(keys.start, keys.stop)[None, :]  # (1, keys)
        mask = (key >= tile_lo[:, None]) & (key < tile_hi[:, None])  # (T, keys)
        tiles.append((queries, keys, mask.to(device)))
    return tiles


def _scores(q, k, mask, scale):
    """Scaled scores of queries q [B, Hkv, G, Lq, D] against keys k [B, Hkv, Lk, D], -inf where the mask hides a
    key: [B, Hkv, G, Lq, Lk]."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k).mul_(scale)  # (B, Hkv, G, Lq, Lk)
    return scores if mask is None else scores.masked_fill_(~mask, float("-inf"))


# ----------------------------------------------------------------------------------------------------------------
# the fused kernels: which one computes a block, and what each one needs
#
# Each kernel below is called from one small function whose docstring states its contract: the layouts it reads, the
# dtypes and head sizes it takes, what it returns. The choice among them is one function of what decides it
# (`block_kernel`), so that a test on a machine without a GPU can ask which kernel a GPU would run, and run it
# through a stand-in that enforces the same contract (test_kernels.py). All take and return head-major tensors,
# q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] with Hq a multiple of Hkv (views: any strides, the last dim contiguous),
# and give back (out [B, Hq, Lq, D], lse [B, Hq, Lq]) in float32 (float64 for float64 inputs) and, backward,
# (dq, dk, dv) shaped as q, k, v.


def block_kernel(device_type, dtype, head_dim, flash_attn_version=FLASH_ATTN_VERSION):
    """The fused kernel for a ring's blocks, by name, or "tiles" where none takes these inputs:

        cpu_flash    CPU: every dtype, every head size (16-bit inputs widened to float32)
        flash_attn   CUDA, fp16 or bf16, head size a multiple of 8 up to 256, flash-attn 2.7 or later installed
        sdpa_flash   the same without flash-attn: PyTorch's own CUDA flash kernel (one of those SDPA runs)
        efficient    CUDA, float32 with a head size a multiple of 4, or 16-bit past 256: PyTorch's memory-efficient
                     kernel
        tiles        anything else (float64 on CUDA, 16-bit head sizes that are not a multiple of 8), in float32
    """
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda":
        return "tiles"
    if sixteen_bit and head_dim % 8 == 0 and head_dim <= 256:
        return "flash_attn" if flash_attn_version is not None and flash_attn_version >= (2, 7) else "sdpa_flash"
    if (sixteen_bit and head_dim % 8 == 0) or (dtype == torch.float32 and head_dim % 4 == 0):
        return "efficient"
    return "tiles"


def at_least_float32(t):
    """16-bit floats as float32; float32 and float64 as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _cpu_flash_forward(q, k, v, causal, scale):
    """PyTorch's flash kernel for CPU: any head size, grouped-query attention as it is, float64, float32 and 16-bit;
    16-bit inputs go in as float32, where it is as fast and the ring exact. It returns the lse as [B, Hq, Lq] (a view
    of [B, Lq, Hq] memory)."""
    q, k, v = (at_least_float32(t) for t in (q, k, v))
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v, out = (at_least_float32(t) for t in (dout, q, k, v, out))
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _flash_attn_forward(q, k, v, causal, scale):
    """flash-attn 2.7 or later, through its private calls (the public ones keep the lse from a backward of ours;
    their arguments changed in 2.7). It takes [B, L, heads, D] with the last dim contiguous (it copies otherwise),
    fp16 or bf16 alike for q, k and v, a head size that is a multiple of 8 up to 256 (its public calls pad, these do
    not), and Hq a multiple of Hkv. Returns out [B, Lq, Hq, D] in the input dtype and lse [B, Hq, Lq] in float32."""
    out, lse, _, _ = flash_attn_interface._flash_attn_forward(*(t.transpose(1, 2) for t in (q, k, v)), 0.0, scale,
                                                              causal, -1, -1, 0.0, None, False)
    return out.transpose(1, 2).float(), lse  # (B, Lq, Hq, D) -> (B, Hq, Lq, D)


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    """Its backward takes dout and out in q's dtype, writes dq, dk, dv into tensors we give it, and reads the lse
    as a CONTIGUOUS [B, Hq, Lq] float32 array, without making it one: a view of the ring's lse (with zigzag, half of
    a block's rows) must be copied first, or the gradients come out wrong."""
    dq, dk, dv = (torch.empty_like(t.transpose(1, 2)) for t in (q, k, v))  # (B, L, heads, D)
    flash_attn_interface._flash_attn_backward(*(t.transpose(1, 2).to(q.dtype) for t in (dout, q, k, v, out)),
                                              lse.contiguous(), dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None,
                                              False)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # (B, L, heads, D) -> (B, heads, L, D)


def _sdpa_flash_forward(q, k, v, causal, scale):
    """PyTorch's own CUDA flash kernel, the one SDPA runs for 16-bit inputs: [B, heads, L, D] with the last dim
    contiguous, fp16 or bf16, a head size that is a multiple of 8 up to 256 (SDPA pads, this call does not), and Hq a
    multiple of Hkv. Returns out in the input dtype and lse [B, Hq, Lq] in float32."""
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out.float(), lse


def _sdpa_flash_backward(dout, q, k, v, out, lse, causal, scale):
    """Like flash-attn's, it reads the lse as a contiguous [B, Hq, Lq] array without making it one; dout and out in
    q's dtype. Of the bookkeeping its forward returns it takes the lengths (no cumulative lengths: not varlen) and,
    with no dropout, no random state."""
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        no_rng, no_rng, scale=scale)


def _efficient_forward(q, k, v, causal, scale):
    """PyTorch's memory-efficient CUDA kernel: [B, heads, L, D], float32, fp16 or bf16 (never float64), 16-bit head
    sizes a multiple of 8 (its loads are aligned), and ONE kv head per query head, so k and v are expanded here. It
    returns out in the input dtype and lse [B, Hq, Lq rounded up to a multiple of 32] in float32, padded with inf."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))  # (B, Hkv, Lk, D) -> (B, Hq, Lk, D)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                            scale=scale)
    return out.float(), lse[..., :q.shape[2]]  # (B, Hq, Lq, D), (B, Hq, Lq)


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    """Its backward wants the lse as its forward made it: a head stride that is a multiple of 32 (it refuses a
    contiguous [B, Hq, Lq] copy). dout and out in q's dtype; with no dropout its random state is unused."""
    G = q.shape[1] // k.shape[1]
    k_, v_ = (t.repeat_interleave(G, dim=1) for t in (k, v))  # (B, Hkv, Lk, D) -> (B, Hq, Lk, D)
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # (B, Hq, Lq rounded up to 32)
    no_seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype), q, k_, v_, None, out.to(q.dtype), lse, no_seed, no_seed, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, *(t.unflatten(1, (k.shape[1], G)).sum(2) for t in (dk, dv))  # (B, Hq, Lk, D) -> (B, Hkv, Lk, D)


FUSED = {"cpu_flash": (_cpu_flash_forward, _cpu_flash_backward),  # name: (forward, backward)
         "flash_attn": (_flash_attn_forward, _flash_attn_backward),
         "sdpa_flash": (_sdpa_flash_forward, _sdpa_flash_backward),
         "efficient": (_efficient_forward, _efficient_backward)}


# ----------------------------------------------------------------------------------------------------------------
# the token layout: which tokens a rank holds, and which keys its queries see


class Mask(NamedTuple):
    """Which keys each query sees, and how its scores are scaled: the tokens' layout over the ring ("zigzag" or
    "contiguous"), a sliding window (None: none), causal or not, and the scale of the scores."""
    layout: str
    window: int | None
    causal: bool
    scale: float


def token_index(layout, rank, R, L):
    """The positions in the full sequence of the L tokens that ring rank `rank` of R holds, as a CPU tensor:
    one contiguous block ("contiguous"), or chunks rank and 2R-1-rank of 2R ("zigzag", L even)."""
    if layout == "contiguous":
        return torch.arange(rank * L, (rank + 1) * L)  # (L,)
    C = L // 2  # chunk length
    return torch.cat([torch.arange(rank * C, (rank + 1) * C), torch.arange((2 * R - 1 - rank) * C, (2 * R - rank) * C)])


def held(layout, indices, rank, R, L):
    """The positions of ring rank `rank`'s L tokens: token_index's [L] for a layout by name, or, for "given",
    indices[rank], [B, L] (each row its own)."""
    return indices[rank] if layout == "given" else token_index(layout, rank, R, L)


MIN_CHUNK = 64  # tokens: a document is cut into 2R chunks only if each holds this many; a shorter one goes whole


def document_layout(position_ids, R):
    """Per-document balance: each row of position_ids [B, S] (0 where a document starts, S a multiple of 2R)
    dealt to the R ranks of a ring, S/R tokens each, so that each rank does about 1/R of every document's causal
    work. Returns [B, R, S/R]: the positions each rank holds, rising (shard_for_sp gathers its tokens by them).

    Each piece of a row between document starts (the first may be a document's end, carried over from the row
    before) of n >= 2R x MIN_CHUNK tokens is cut as zigzag cuts a sequence: 2R chunks of n // 2R tokens from its
    two ends, rank r taking chunks r and 2R-1-r, an early one (queries that see few keys) and a late one (many).
    What remains, each shorter piece whole and the fewer than 2R tokens in the middle of a long one, goes heaviest
    first to the least busy rank it fits in whole, or, where it fits in none, fills the rank with the most room
    and goes on. Work: the query-key pairs of causal attention (`keys_seen`). Short pieces stay whole because each
    run of a document on a rank costs the ring a kernel call per block (`meeting_runs`)."""
    B, S = position_ids.shape
    L = S // R
    layout = torch.empty(B, R, L, dtype=torch.long)
    for b, positions in enumerate(position_ids.cpu()):
        seen = keys_seen(positions)  # (S,)
        starts = [*(seen == 1).nonzero().flatten().tolist(), S]
        taken, rest = [[] for _ in range(R)], []
        for start, end in zip(starts, starts[1:]):
            c = (end - start) // (2 * R) if end - start >= 2 * R * MIN_CHUNK else 0  # chunk length
            for r in range(R):  # chunk r from the front, chunk 2R-1-r from the back
                taken[r] += [*range(start + r * c, start + (r + 1) * c), *range(end - (r + 1) * c, end - r * c)]
            rest.append(range(start + R * c, end - R * c))
        work = [seen[t].sum().item() for t in taken]
        for run in sorted(rest, key=lambda run: -seen[run.start:run.stop].sum().item()):  # heaviest first
            while run:
                fits = [r for r in range(R) if L - len(taken[r]) >= len(run)]
                r = min(fits, key=work.__getitem__) if fits else max(range(R), key=lambda r: L - len(taken[r]))
                part, run = run[:L - len(taken[r])], run[L - len(taken[r]):]
                taken[r] += part
                work[r] += seen[part.start:part.stop].sum().item()
        layout[b] = torch.tensor(taken).sort(1).values  # (R, L)
    return layout


def keys_seen(positions):
    """positions [S] of one row (0 where a document starts) -> [S]: how many keys each token sees under causal
    attention, itself and those before it in its document within the row."""
    i = torch.arange(len(positions))
    start = torch.where(positions.cpu() == 0, i, 0).cummax(0).values  # (S,): where each token's piece starts
    return i - start + 1


def document_work(position_ids, layout):
    """Causal attention work per ring rank with packed documents: the query-key pairs its queries see, summed over
    the rows. position_ids [B, S]; layout [B, R, L], the positions each rank holds (document_layout's, or
    token_index's stacked). A list of R numbers."""
    seen = torch.stack([keys_seen(row) for row in position_ids])  # (B, S)
    return seen.gather(1, layout.flatten(1)).view(layout.shape).sum((0, 2)).tolist()


def key_ranges(q_index, k_index, window=None, causal=True):
    """Which keys each query may see: causal (else all of them), and within the last `window` tokens if given
    (`_blocks` gives it one document's queries and keys at a time). Positions in every layout rise along a rank's
    tokens, so the keys a query sees are one run of k_index: (lo, hi), two [Lq] tensors, query i seeing keys
    lo[i] .. hi[i] - 1 (none when lo[i] = hi[i]). Never a [Lq, Lk] mask."""
    hi = torch.searchsorted(k_index, q_index, right=True)  # (Lq,): the keys at or before each query
    if not causal:
        hi = torch.full_like(hi, len(k_index))
    lo = torch.searchsorted(k_index, q_index - window, right=True) if window else torch.zeros_like(hi)  # (Lq,)
    return lo, hi


def cut(lo, hi):
    """(rows, cols): the queries that see any key and the keys they see, as two slices, or None when no query
    sees any. This is all the work a block needs: with zigzag, a block from an earlier rank is cut to its first
    chunk of keys, and a block from a later rank to the queries of my second chunk."""
    rows = (hi > lo).nonzero().flatten()
    if len(rows) == 0:
        return None
    rows = slice(rows[0].item(), rows[-1].item() + 1)
    return rows, slice(lo[rows].min().item(), hi[rows].max().item())


def ring_work(R, L, layout, window=None):
    """Attention work per rank: the query-key pairs of each block's cut, summed over the R steps (a tiled kernel
    skips part of the own block's too). A list of R numbers; zigzag makes them equal (for causal attention)."""
    work = []
    for r in range(R):
        cuts = [cut(*key_ranges(token_index(layout, r, R, L), token_index(layout, j, R, L), window)) for j in range(R)]
        work.append(sum((c[0].stop - c[0].start) * (c[1].stop - c[1].start) for c in cuts if c is not None))
    return work


# ----------------------------------------------------------------------------------------------------------------
# plumbing: the bytes sent, the ring's size, 16-bit inputs widened to float32

# what this process has sent around the ring: {"forward"|"backward": {"calls": int, "bytes": int}}
ring_stats = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}


def reset_ring_stats():
    for counts in ring_stats.values():
        counts["calls"], counts["bytes"] = 0, 0


def ring_bytes(R, kv_bytes, dkv_bytes):
    """(forward, backward) bytes one rank sends per ring_attention call: R-1 key/value blocks of kv_bytes each
    forward; backward the same again plus R accumulators of dkv_bytes (dk and dv in float32)."""
    return (R - 1) * kv_bytes, (R - 1) * kv_bytes + R * dkv_bytes


_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
_WANT = "want q [B, L, Hq, D] and k, v [B, L, Hkv, D] of one dtype, Hq a multiple of Hkv"


def _fit_together(q, k, v):
    """q [B, L, Hq, D], k and v [B, L, Hkv, D], of one dtype, Hq a multiple of Hkv."""
    return (q.dim() == k.dim() == 4 and k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0 and q.dtype == k.dtype == v.dtype)


def check_same_inputs(q, k, v, group):
    """ValueError on every rank unless every rank of the ring holds q, k and v that fit together (`_fit_together`,
    in a dtype named in _DTYPES), of the same batch, tokens, heads, head size and dtype as the other ranks': the
    sends assume it, and a mismatch would otherwise abort the processes inside gloo, or leave them waiting for a
    rank that stopped alone. One all-gather of 7 numbers."""
    R = size_and_rank(group)[0]
    fit = _fit_together(q, k, v) and q.dtype in _DTYPES
    sizes = [*q.shape, k.shape[2]] if fit else [-1] * 5  # unfit: refused on every rank below
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    mine = torch.tensor([*sizes, dtype, fit], device=q.device)  # B, L, Hq, D, Hkv, dtype, fit
    every = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every).tolist()  # (R, 7)
    unfit = [rank for rank, row in enumerate(every) if not row[-1]]
    if unfit:
        mine = (f" (this rank: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
                f"{v.dtype})" if not fit else "")
        raise ValueError(f"q, k and v do not fit together on ring rank {', '.join(map(str, unfit))}{mine}; {_WANT}")
    for i, name in enumerate(["batch size", "tokens", "query heads", "head size", "kv heads", "dtype"]):
        values = [_DTYPES[row[i]] if name == "dtype" else row[i] for row in every]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"{value} on rank {rank}" for rank, value in enumerate(values))
            raise ValueError(f"the ranks of the ring hold inputs of different {name}: {by_rank}; each must hold "
                             f"the same number of tokens of the same batch (shard_for_sp cuts them so)")


def gather_ring(x, group):
    """x [B, L] of every rank of the ring, on the CPU: [R, B, L]. One all-gather (B*S integers, never a mask)."""
    R, x = size_and_rank(group)[0], x.contiguous()
    every = [torch.empty_like(x) for _ in range(R)] if R > 1 else [x]  # (B, L) of each ring rank
    if R > 1:
        dist.all_gather(every, x, group=group)
    return torch.stack(every).cpu()  # (R, B, L)


def document_ids(position_ids, group, layout, indices=None):
    """position_ids [B, L] of this rank's tokens -> the document of every token of the ring's sequence [B, S], in
    sequence order, on the CPU: 0, 1, 2, ... counting the places where positions are 0. One all-gather of the ring's
    position ids. indices: every rank's positions [R, B, L], for layout "given"."""
    every = gather_ring(position_ids, group)  # (R, B, L)
    R, B, L = every.shape
    positions = torch.empty(B, R * L, dtype=position_ids.dtype)  # (B, S)
    for rank, theirs in enumerate(every):
        positions.scatter_(1, held(layout, indices, rank, R, L).expand(B, L), theirs)
    return (positions == 0).cumsum(1)  # (B, S)


def size_and_rank(group):
    """(R, this process's rank in the ring); (1, 0) for group=None, a ring of one rank."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def _group(group_name):
    return _resolve_process_group(group_name) if group_name else None


# what torch.compile sees of the ring: the shapes of its outputs, and which operator is its backward


@_ring_forward.register_fake
def _ring_forward_shapes(q, k, v, sinks, documents, indices, group_name, layout, window, causal, scale, kernel):
    """Exactly what the operator returns, strides too (inductor checks them): new contiguous tensors, whatever the
    memory layout of q (seq_to_heads hands over head-major memory)."""
    B, L, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(B, Hq, L, dtype=torch.promote_types(q.dtype, torch.float32))


@_ring_backward.register_fake
def _ring_backward_shapes(dout, q, k, v, out, lse, sinks, documents, indices, group_name, layout, window, causal,
                          scale, kernel):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks  # contiguous, as the operator's


def _keep_ring(ctx, inputs, output):
    q, k, v, sinks, documents, indices, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, *output, sinks, documents, indices)
    ctx.mark_non_differentiable(output[1])


def _ring_gradients(ctx, dout, _):
    q, k, v, out, lse, sinks, documents, indices = ctx.saved_tensors
    dq, dk, dv, dsinks = _ring_backward(dout, q, k, v, out, lse, sinks, documents, indices, *ctx.options)
    return dq, dk, dv, None if sinks is None else dsinks, None, None, *[None] * len(ctx.options)


_ring_forward.register_autograd(_ring_gradients, setup_context=_keep_ring)
