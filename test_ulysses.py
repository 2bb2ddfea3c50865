"""
Tests of ulysses.py, the SP contract, against one device: shard_for_sp and the exchange move exactly the right
tokens and heads (2 and 3 ranks, even and uneven heads, float32 and bf16); head_layout against its definition;
ulysses_attention's output, gradients, calls and bytes sent against attention on the whole sequence, for even and
uneven head layouts; the attention kernels against the dense formula; misuse refused on every rank;
torch.compile against eager; a user's script that exits 0 on every rank, and the wait for gloo that makes it so.
"""

import os
import sys
import time
import warnings
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import documents
import ring
import ulysses
from conftest import HERE, assert_all_close, my_tokens, qkv, run, run_ranks, sp_slice, usp_groups
from gpt import GPT, GPTConfig


def _shard_and_all_to_all_rank(rank, world_size, dtype):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 9, (2, 13), generator=g), torch.randint(0, 9, (2, 13), generator=g)
    labels[0, :5] = -100
    shard = ulysses.shard_for_sp(ids, labels, torch.arange(13).expand(2, 13), group)
    valid = [ulysses.global_valid_tokens([shard[1], shard[1][:1]], group),  # two micro-batches
             ulysses.global_valid_tokens([shard[1]] if rank == 1 else [], group)]  # the others: none this time
    full = torch.randn(2, 12, 4 * world_size, 3, generator=g).to(dtype)  # (B, S, H, D)
    local = sp_slice(full, rank, world_size).clone().requires_grad_()  # (B, S/P, H, D): my tokens
    even = ulysses.head_layout(4 * world_size, 1, world_size)[0]  # 4 heads a rank
    heads = ulysses.seq_to_heads(local, group, even).mul_(1.0)  # (B, S, H/P, D): all tokens, my heads; in place is fine
    back = ulysses.heads_to_seq(heads, group, even)
    grad_heads = torch.randn(heads.shape, generator=torch.Generator().manual_seed(1 + rank)).to(dtype)
    heads.backward(grad_heads)
    # uneven heads: 5 heads over the ranks as head_layout splits them, and a kv head that goes to every rank
    five = sp_slice(torch.randn(2, 12, 5, 3, generator=g).to(dtype), rank, world_size).requires_grad_()
    query, kv = ulysses.head_layout(5, 1, world_size)
    mine, shared = ulysses.seq_to_heads(five, group, query), ulysses.seq_to_heads(five[:, :, :1], group, kv)
    (mine.sum() + 2 * shared.sum()).backward()
    return (shard, valid, heads.detach(), back.detach(), local.grad, ulysses.heads_to_seq(grad_heads, group, even),
            mine.detach(), ulysses.heads_to_seq(mine, group, query).detach(), five.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_for_sp_and_the_all_to_all(world_size, dtype):
    """shard_for_sp pads at the end and keeps global positions (and each token's index); the valid-token count
    covers every rank, those without a micro-batch too; the exchange gives each rank exactly its heads of every
    token, heads_to_seq undoes it, and the backward of seq_to_heads is heads_to_seq. Uneven heads work the same way,
    and a kv head sent to every rank gets back the sum of their gradients. In bf16 too, bit for bit: the exchange
    only moves data."""
    results = run_ranks(world_size, _shard_and_all_to_all_rank, dtype)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 9, (2, 13), generator=g), torch.randint(0, 9, (2, 13), generator=g)
    labels[0, :5] = -100
    full = torch.randn(2, 12, 4 * world_size, 3, generator=g).to(dtype)
    five = torch.randn(2, 12, 5, 3, generator=g).to(dtype)
    pad = -13 % world_size
    for i, want in enumerate((torch.cat([ids, torch.zeros(2, pad, dtype=torch.long)], 1),
                              torch.cat([labels, torch.full((2, pad), -100)], 1),
                              torch.arange(13 + pad).expand(2, -1), torch.arange(13 + pad).expand(2, -1))):
        assert torch.equal(torch.cat([r[0][i] for r in results], dim=1), want)
    assert all(r[1][0] == (labels != -100).sum() + (labels[:1] != -100).sum() for r in results)
    assert all(r[1][1] == (results[1][0][1] != -100).sum() for r in results)  # rank 1's shard alone
    for rank, (_, _, heads, back, grad, inverse_of_grad, mine, mine_back, five_grad) in enumerate(results):
        assert heads.dtype == dtype and torch.equal(heads, sp_slice(full, rank, world_size, dim=2))  # my heads
        assert torch.equal(back, sp_slice(full, rank, world_size))
        assert torch.equal(grad, inverse_of_grad)
        query = ulysses.head_layout(5, 1, world_size)[0][rank]
        assert torch.equal(mine, five[:, :, query.start:query.stop])
        assert torch.equal(mine_back, sp_slice(five, rank, world_size))
        want = torch.ones_like(sp_slice(five, rank, world_size))  # each head's gradient from the rank that holds it
        want[:, :, 0] += 2 * world_size  # kv head 0 went to every rank: the sum of their gradients
        assert torch.equal(five_grad, want)


def _layout_by_hand(n_head, n_kv_head, P):
    """The head layout from its definition: contiguous runs of query heads, the first n_head % P ranks one more,
    and each rank's kv heads the set its query heads use."""
    sizes = [n_head // P + (r < n_head % P) for r in range(P)]
    query = [list(range(sum(sizes[:r]), sum(sizes[:r + 1]))) for r in range(P)]
    return query, [sorted({h // (n_head // n_kv_head) for h in heads}) for heads in query]


def test_head_layout():
    query, kv = ulysses.head_layout(6, 2, 4)  # the docstring's picture
    assert [list(r) for r in query] == [[0, 1], [2, 3], [4], [5]] and [list(r) for r in kv] == [[0], [0, 1], [1], [1]]
    for P, Hq, Hkv in [(P, Hq, Hkv) for Hq in range(1, 13) for Hkv in range(1, Hq + 1) if Hq % Hkv == 0
                       for P in range(1, Hq + 1)]:
        query, kv = ulysses.head_layout(Hq, Hkv, P)
        assert ([list(r) for r in query], [list(r) for r in kv]) == _layout_by_hand(Hq, Hkv, P)
    with pytest.raises(ValueError, match=r"sp=8 is larger than n_head=6: a rank would hold no head; "
                                         r"choose sp in \{1, 2, 3, 4, 5, 6\}"):
        ulysses.head_layout(6, 6, 8)
    with pytest.raises(ValueError, match=r"n_head=8 is not a multiple of n_kv_head=3; choose n_kv_head in "
                                         r"\{1, 2, 4, 8\}"):
        GPTConfig(n_head=8, n_kv_head=3, n_embd=64)


EVEN_CASES = [(2, 4, 4), (4, 8, 8), (2, 8, 2), (4, 8, 4), (4, 8, 2), (4, 4, 1)]  # (P, Hq, Hkv)
UNEVEN_CASES = [(4, 6, 6), (4, 6, 2), (4, 6, 3), (3, 8, 8), (3, 8, 2), (3, 4, 1), (4, 12, 4), (4, 5, 5), (2, 3, 1)]
KERNELS = [(ulysses.causal_attention, {}), (ulysses.sliding_window_attention, {"window": 5})]


def _attention_rank(rank, world_size, cases):
    results = []
    for P, Hq, Hkv in cases:
        q, k, v, grad_out = (sp_slice(t, rank, P) for t in qkv(2, 24, Hq, Hkv, 8))
        for attn_fn, kwargs in KERNELS:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            ulysses.reset_all_to_all_stats()
            out = ulysses.ulysses_attention(q, k, v, dist.group.WORLD, attn_fn, **kwargs)
            out.backward(grad_out)
            stats = {d: dict(c) for d, c in ulysses.all_to_all_stats.items()}
            results.append(((out.detach(), q.grad, k.grad, v.grad), stats))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ulysses_attention_matches_one_device(world_size):
    """Output and dq, dk, dv against one device, for even and uneven head layouts (MHA, GQA, kv heads fewer
    than ranks, query heads of one rank using their kv heads unevenly), with causal and sliding-window kernels.
    Each rank sends exactly the bytes of its head layout, in four all-to-alls each direction: q, k and v one call
    each to heads and the output back; backward, the output's gradient to heads and q's, k's and v's back."""
    cases = [c for c in EVEN_CASES + UNEVEN_CASES if c[0] == world_size]
    per_rank = run_ranks(world_size, _attention_rank, cases)
    for i, ((P, Hq, Hkv), (attn_fn, kwargs)) in enumerate((c, k) for c in cases for k in KERNELS):
        q, k, v, grad_out = qkv(2, 24, Hq, Hkv, 8)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attn_fn(q, k, v, **kwargs)
        out.backward(grad_out)
        got = [torch.cat(pieces, dim=1) for pieces in zip(*(r[i][0] for r in per_rank))]
        assert_all_close(got, [out, q.grad, k.grad, v.grad], where=f"P={P} Hq={Hq} Hkv={Hkv} {attn_fn.__name__}")
        unit = 2 * 24 // P * 8 * 4  # bytes of one head of a rank's tokens: B * S/P * D float32
        for rank, (_, stats) in enumerate(r[i] for r in per_rank):
            forward, backward = _heads_sent_by_hand(Hq, Hkv, P, rank)
            assert stats == {"forward": {"calls": 4, "bytes": unit * forward},  # q, k, v there; the output back
                             "backward": {"calls": 4, "bytes": unit * backward}}  # its gradient there; q's, k's, v's
            if Hq % P == 0 and (Hkv % P == 0 or P % Hkv == 0):  # even: what the even split always sent
                kv_sent = Hkv if Hkv % P == 0 else P  # P % Hkv == 0: every rank gets one kv head
                assert stats["forward"]["bytes"] == unit * (2 * Hq + 2 * kv_sent) * (P - 1) // P


def _heads_sent_by_hand(Hq, Hkv, P, rank):
    """(forward, backward): how many heads of its S/P tokens rank `rank` sends in one attention layer."""
    query, kv = _layout_by_hand(Hq, Hkv, P)
    others = [j for j in range(P) if j != rank]
    to_heads = sum(len(query[j]) + 2 * len(kv[j]) for j in others)  # q, k, v: other ranks' heads
    to_seq = (P - 1) * len(query[rank])  # the output: my heads of the other ranks' tokens
    back_to_heads = sum(len(query[j]) for j in others)  # the output's gradient, then q's, k's and v's
    back_to_seq = (P - 1) * (len(query[rank]) + 2 * len(kv[rank]))
    return to_heads + to_seq, back_to_heads + back_to_seq


def _dense_attention(q, k, v, allowed):
    """The textbook formula with an explicit [S, S] (or [B, S, S]) mask of allowed query-key pairs."""
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed.view(-1, 1, *allowed.shape[-2:]), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_attention_kernels_match_the_dense_formula():
    q, k, v, _ = qkv(2, 16, 4, 2, 8)
    i = torch.arange(16)
    causal = i[:, None] >= i[None, :]
    torch.testing.assert_close(ulysses.causal_attention(q, k, v), _dense_attention(q, k, v, causal))
    torch.testing.assert_close(ulysses.sliding_window_attention(q, k, v, window=5),
                               _dense_attention(q, k, v, causal & (i[:, None] - i[None, :] < 5)))
    for window in (0, None):  # no window, as ring.ring_attention takes it
        torch.testing.assert_close(ulysses.sliding_window_attention(q, k, v, window), _dense_attention(q, k, v, causal))
    with pytest.raises(ValueError, match=r"^window=-1: a sliding window looks back from each query: 1 or more tokens"):
        ulysses.sliding_window_attention(q, k, v, -1)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1],
                                 [5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])  # row 1 opens mid-document
    document = (position_ids == 0).cumsum(1)  # (B, S): which document each token is in
    same_document = document[:, :, None] == document[:, None, :]  # (B, S, S)
    torch.testing.assert_close(documents.document_attention(q, k, v, position_ids),
                               _dense_attention(q, k, v, causal & same_document))
    torch.testing.assert_close(documents.document_attention(q, k, v, position_ids, window=3),
                               _dense_attention(q, k, v, causal & same_document & (i[:, None] - i[None, :] < 3)))
    with pytest.raises(ValueError, match=r"document_attention: position_ids \(2, 8\), want the full sequence's \[B, "
                                         r"S\] = \[2, 16\] \(under Ulysses, gather_sequence's\)"):
        documents.document_attention(q, k, v, position_ids[:, :8])  # a rank's own half, not the gathered whole


def test_packed_attention_compiles_once_for_any_documents():
    """Under torch.compile, document_attention runs eagerly between graphs (its loop follows the data's documents):
    rows of 2, 3 and 4 documents compile nothing new, and the result is eager's."""
    q, k, v, _ = qkv(2, 16, 4, 2, 8)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda *inputs: 2 * documents.document_attention(*inputs), backend=counter)
    frames = []
    for length in (8, 6, 4):  # documents of `length` tokens: 2, 3 and 4 a row
        position_ids = (torch.arange(16) % length).expand(2, 16)  # (B, S)
        torch.testing.assert_close(compiled(q, k, v, position_ids), 2 * documents.document_attention(q, k, v,
                                                                                                      position_ids))
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == frames[:1] * 3, frames


def _unequal_shards_rank(rank, world_size):
    model, messages = GPT(GPTConfig(n_layer=1, n_embd=32), sp_group=dist.group.WORLD), []
    for idx in (torch.zeros(2, 3 + rank, dtype=torch.long),  # rank 0: 3 tokens, rank 1: 4
                torch.zeros(3, dtype=torch.long) if rank else torch.zeros(2, 3, dtype=torch.long),  # rank 1: no batch
                torch.zeros(2, 3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long)):  # alike, and not [B, S]
        try:
            model(idx, torch.arange(idx.shape[-1]).expand_as(idx))
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_shards_of_different_lengths_are_refused():
    """Shards made by hand with different lengths, or of other dimensions, on one rank or on both: a clear error on
    every rank, not an abort inside gloo, nor an error from deep inside the model."""
    for messages in run_ranks(2, _unequal_shards_rank):
        assert [m[:m.index(" by rank")] for m in messages] == [
            f"the ranks of the SP group must hold [batch, tokens] shards of one shape; they hold {shapes}"
            for shapes in ("[(2, 3), (2, 4)]", "[(2, 3), (-1, -1)]", "[(-1, -1), (-1, -1)]", "[(-1, -1), (-1, -1)]")]


def _mismatched_inputs_rank(rank, world_size):
    """ulysses_attention where rank 1 passes one token more, q of another dtype, one query head more, v of another
    dtype than its q and k, k of another head size than its q, q, k and v of a dtype the check does not know, or k
    and v of three dimensions."""
    messages = []
    for tokens, dtype, heads, v_dtype, k_size in ((4 + rank, torch.float32, 4, None, 8),
                                                  (4, (torch.float32, torch.float64)[rank], 4, None, 8),
                                                  (4, torch.float32, 4 + 2 * rank, None, 8),
                                                  (4, torch.float32, 4, (torch.float32, torch.float64)[rank], 8),
                                                  (4, torch.float32, 4, None, 8 + 8 * rank),
                                                  (4, (torch.float32, torch.complex64)[rank], 4, None, 8)):
        q, k, v = (torch.randn(2, tokens, h, d, dtype=dtype) for h, d in ((heads, 8), (2, k_size), (2, 8)))
        try:
            ulysses.ulysses_attention(q, k, v.to(v_dtype or dtype), dist.group.WORLD)
        except ValueError as e:
            messages.append(str(e))
    q, k, v = (torch.randn(2, 4, h, 8) for h in (4, 2, 2))
    try:  # rank 1: k and v [B, S/P, Hkv], no head size to read
        ulysses.ulysses_attention(q, *((k[..., 0], v[..., 0]) if rank else (k, v)), dist.group.WORLD)
    except ValueError as e:
        messages.append(str(e))
    try:  # every rank alike, but k's head size is not q's
        ulysses.ulysses_attention(q, k[..., :4], v, dist.group.WORLD)
    except ValueError as e:
        messages.append(str(e))
    for sinks in ([torch.zeros(4), torch.zeros(5)], [torch.zeros(4), None]):  # rank 1: a sink too many, or none
        try:
            ulysses.ulysses_attention(q, k, v, dist.group.WORLD, ring.ring_attention, sinks=sinks[rank])
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_ranks_that_pass_different_inputs_are_refused():
    """Ranks whose q, k, v differ in tokens, dtype or heads, or a rank whose own q, k, v do not fit together (v's
    dtype, k's head size, a dtype it does not know, k and v of three dimensions), or every rank alike with q and k
    of different head sizes, or a rank with sinks of another shape or none: one error on every rank naming what each
    rank passed, never an abort inside gloo, nor ranks left waiting in the all-to-all or computing apart."""
    for rank, messages in enumerate(run_ranks(2, _mismatched_inputs_rank)):
        fine, unfit = (2, 4, 4, 8, 2, 8, 8, 1, 0), (-1,) * 9  # [B, S/P, Hq, D, Hkv, Dk, Dv, dtype, sinks?]; 1: float32
        by_rank = [[fine, (2, 5, 4, 8, 2, 8, 8, 1, 0)], [fine, (2, 4, 4, 8, 2, 8, 8, 0, 0)],
                   [fine, (2, 4, 6, 8, 2, 8, 8, 1, 0)]]
        by_rank += [[fine, unfit]] * 4 + [[unfit, unfit], [fine[:8] + (1,), unfit], [fine[:8] + (1,), fine]]
        assert messages == [f"ulysses_attention: q, k, v differ between the ranks or do not fit together ([B, S/P, "
                            f"Hq, D, Hkv, Dk, Dv, dtype, sinks?] by rank: {every}); want q [B, S/P, Hq, D], k [B, S/P, "
                            f"Hkv, D], v [B, S/P, Hkv, Dv] of one float dtype, sinks [Hq] or none, alike on every rank"
                            for every in by_rank], (rank, messages)


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "broadcast", "gather", "scatter", "reduce_scatter_tensor")


def _check_off_rank(rank, world_size):
    """The collectives this rank makes in one forward of ulysses_attention, with the input check and without."""
    made = []
    for name in COLLECTIVES:
        setattr(dist, name, partial(lambda name, call, *args, **kwargs: made.append(name) or call(*args, **kwargs),
                                    name, getattr(dist, name)))
    q, k, v, _ = (sp_slice(t, rank, world_size) for t in qkv(2, 8, 4, 2, 8))
    per_check = {}
    for check in (True, False):
        made.clear()
        ulysses.ulysses_attention(q, k, v, dist.group.WORLD, check=check)
        per_check[check] = list(made)
    return per_check


def test_check_false_skips_the_input_check():
    """A forward makes four all-to-alls (q, k and v to heads, the output back) and, unless check=False, one
    all-gather before them, the input check's."""
    for per_check in run_ranks(2, _check_off_rank):
        assert per_check[False] == ["all_to_all_single"] * 4, per_check
        assert per_check[True] == ["all_gather"] + ["all_to_all_single"] * 4, per_check


def test_sinks_need_a_kernel_that_takes_them():
    """Sinks with the default kernel, which takes none, or not one a query head: refused in one line, before any
    collective."""
    q, k, v, _ = qkv(1, 8, 4, 2, 8)
    for sinks, attn_fn in ((torch.zeros(4), None), (torch.zeros(3), ring.ring_attention)):
        with pytest.raises(ValueError, match=rf"^ulysses_attention: sinks \({sinks.shape[0]},\) need one logit per "
                                             r"query head, \[4\], and an attn_fn that takes sinks=, e\.g\. "
                                             r"ring\.ring_attention$"):
            ulysses.ulysses_attention(q, k, v, attn_fn=attn_fn, sinks=sinks)


@pytest.mark.parametrize("labels_len, positions_shape, wrong", [(15, (2, 16), r"labels \(2, 15\)"),
                                                                  (16, (16,), r"position_ids \(16,\)"),
                                                                  (16, (2, 17), r"position_ids \(2, 17\)")],
                         ids=["labels-short", "positions-1d", "positions-long"])
def test_shard_for_sp_names_the_argument_of_the_wrong_shape(labels_len, positions_shape, wrong):
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"^shard_for_sp: input_ids \(2, 16\), .*{wrong}.*: want \[B, S\] each"):
        ulysses.shard_for_sp(ids, torch.zeros(2, labels_len, dtype=torch.long), torch.zeros(positions_shape))


COMPILE_CASES = {2: [(4, 2)], 3: [(6, 2)], 4: [(6, 3)]}  # P: (Hq, Hkv); GQA, and 3 and 4 split kv heads unevenly


def _compiled_attention_rank(rank, world_size, backend):
    """ulysses_attention compiled with fullgraph (any break is an error) against eager, for two sequence lengths
    marked dynamic; per head layout, the largest difference (outputs and input gradients) and the graphs made."""
    results = []
    for Hq, Hkv in COMPILE_CASES[world_size]:
        torch._dynamo.reset()  # a model has one head layout: each case starts afresh
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(ulysses.ulysses_attention, backend=backend, fullgraph=True)
        worst = 0.0
        for S in (24, 36):
            q, k, v, grad_out = (sp_slice(t, rank, world_size) for t in qkv(2, S, Hq, Hkv, 8))
            pair = []
            for attention in (ulysses.ulysses_attention, compiled):
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                for t in inputs:
                    torch._dynamo.mark_dynamic(t, 1)  # the sequence length
                out = attention(*inputs, dist.group.WORLD)
                pair.append([out, *torch.autograd.grad(out, inputs, grad_out)])
            worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(*pair)])
        results.append((worst, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compiled_attention_matches_eager(world_size):
    """torch.compile(ulysses_attention, fullgraph=True) traces the exchange without a break (the all-to-all is
    an operator of its own) and equals eager, forward and backward, with uneven heads and GQA; a second sequence
    length, marked dynamic, reuses the graph."""
    for rank_results in run_ranks(world_size, _compiled_attention_rank, "aot_eager"):
        assert rank_results == [(pytest.approx(0, abs=1e-6), 1)] * len(COMPILE_CASES[world_size])



USP_COMPILE_CASES = {2: (1, 2, 4, 2), 3: (1, 3, 6, 2), 4: (2, 2, 6, 3)}  # P: (U, R, Hq, Hkv)


def _usp(U, R):
    """The USP attention of this rank when the world is an SP group of U x R (ring attention as the kernel of
    ulysses_attention), and its two groups."""
    ulysses_group, ring_group = usp_groups(U, R)
    return partial(ulysses.ulysses_attention, group=ulysses_group,
                   attn_fn=partial(ring.ring_attention, group=ring_group, layout="zigzag")), ulysses_group, ring_group


def _largest_difference(attention, compiled, Hq, Hkv, lengths, groups):
    """The largest difference between attention and compiled (outputs and the gradients of q, k, v) over these
    sequence lengths, each rank passing its tokens of the sequence as shard_for_sp (or shard_for_ring) cuts it."""
    worst = 0.0
    for S in lengths:  # no token count equal to another size (B, heads, D), which would tie them together
        index = my_tokens(S, *groups)
        q, k, v, grad_out = (t[:, index] for t in qkv(2, S, Hq, Hkv, 8))
        pair = []
        for function in (attention, compiled):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = function(*inputs)
            pair.append([out, *torch.autograd.grad(out, inputs, grad_out)])
        worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(*pair)])
    return worst


def _dynamic_compile_rank(rank, world_size):
    """ulysses_attention and the USP attention compiled with fullgraph=True and dynamic=True against eager, for two
    sequence lengths; per case, the largest difference (outputs and input gradients) and the frames compiled."""
    U, R, Hq, Hkv = USP_COMPILE_CASES[world_size]
    usp, ulysses_group, ring_group = _usp(U, R)
    cases = [(partial(ulysses.ulysses_attention, group=dist.group.WORLD), *COMPILE_CASES[world_size][0],
              (dist.group.WORLD,)), (usp, Hq, Hkv, (ulysses_group, ring_group))]
    results = []
    for attention, Hq, Hkv, groups in cases:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(attention, backend=counter, fullgraph=True, dynamic=True)
        results.append((_largest_difference(attention, compiled, Hq, Hkv, (48, 96), groups), counter.frame_count))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compiled_attention_dynamic(world_size):
    """torch.compile(..., fullgraph=True, dynamic=True) of ulysses_attention (GQA, uneven heads) and of the USP
    attention (ring attention over the ring group as its kernel, U x R = 1 x 2, 1 x 3, 2 x 2) equals eager within
    1e-6, forward and backward, and compiles once for two sequence lengths: every size is symbolic but the head
    counts, and the ring's passes are one operator."""
    for rank_results in run_ranks(world_size, _dynamic_compile_rank):
        assert rank_results == [(pytest.approx(0, abs=1e-6), 1)] * 2


def _inductor_rank(rank, world_size):
    """USP over Ulysses 2 x ring world_size/2, 3 query heads (of 6, on 2 kv heads) a Ulysses rank, compiled by
    inductor with fullgraph: static at one sequence length, and dynamic=True at two. Per mode, the largest
    difference to eager and the frames compiled."""
    usp, *groups = _usp(2, world_size // 2)
    results = []
    for dynamic, lengths in ((False, (48,)), (True, (48, 96))):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(usp, backend=counter, fullgraph=True, dynamic=dynamic)
        results.append((_largest_difference(usp, compiled, 8, 4, lengths, groups), counter.frame_count))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_compiled_attention_inductor(world_size):
    """The USP attention compiled by inductor (which generates code around the exchange and the ring, and checks
    that each operator returns the strides its fake function promised), Ulysses 2 x ring 1 and 2 x 2, equals eager
    within 1e-6, forward and backward, static and dynamic, one compile each. A ring whose fake outputs kept
    seq_to_heads' head-major strides stopped every rank here ("expected size 32==32, stride 16==8")."""
    for rank_results in run_ranks(world_size, _inductor_rank):
        assert rank_results == [(pytest.approx(0, abs=1e-6), 1)] * 2


USER_SCRIPT = """
import sys
sys.setswitchinterval(100)  # the main thread keeps the interpreter lock until it waits: it widens the window at exit
sys.path.insert(0, {here!r})
import torch
import torch.distributed as dist
import ring
import ulysses

torch.set_num_threads(1)
dist.init_process_group("gloo")
group = dist.group.WORLD  # held until the interpreter exits, as user scripts do
q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
ring.ring_attention(q, k, v, group, "zigzag").sum().backward()
ulysses.ulysses_attention(q, k, v, group).sum().backward()  # the last communication: the all-to-alls
dist.destroy_process_group()
"""


def test_ring_and_ulysses_user_script_exits_cleanly(tmp_path):
    """ring_attention and then ulysses_attention, forward and backward, destroy_process_group, exit: status 0 on
    every rank. gloo's worker threads once outlived such a script's last all-to-all and aborted it at exit
    ("terminate called without an active exception"): with sys.setswitchinterval(100), which widens that window,
    11 of 20 runs on 4 ranks aborted without ulysses.py's wait for gloo. One run shows the script as a user runs
    it; the next test holds the wait itself to its promise, call by call."""
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT.format(here=HERE))
    status, output, _ = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                             str(script)], env=dict(os.environ, PYTHONWARNINGS="error:::ulysses"))
    assert status == 0 and "terminate called" not in output, output[-2000:]


def _released_rank(rank, world_size):
    """ulysses_attention forward and backward, 10 times (9 collectives each: the input check's gather, and four
    exchanges forward and four backward), with the interpreter lock held as long as the main thread
    wants it, as at a script's exit. After each collective: do its tensors have only their holders of before
    (gloo's worker thread, which drops its references a moment after the call returns, no longer among them)?"""
    sys.setswitchinterval(100)
    wait, released = ulysses._gloo_lets_go, []

    @contextmanager
    def checked(*tensors):
        holders = lambda: [n for t in tensors for n in (t._use_count(), sys.getrefcount(t))]
        before = holders()
        with wait(*tensors):
            yield
        released.append(holders() == before)

    ulysses._gloo_lets_go = checked
    try:
        for _ in range(10):
            q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
            ulysses.ulysses_attention(q, k, v, dist.group.WORLD).sum().backward()
    finally:
        ulysses._gloo_lets_go = wait
    return released


def test_the_collectives_release_their_tensors_before_going_on():
    """Right after each all-to-all (and each gather of the input check), nothing but its caller holds its tensors:
    _gloo_lets_go waited for gloo to let go."""
    for released in run_ranks(2, _released_rank):
        assert len(released) == 90, f"{len(released)} collectives, not 90"
        assert all(released), f"gloo still held the tensors after {released.count(False)} of 90 collectives"


def test_the_wait_for_gloo_is_for_cpu_tensors_alone():
    """_gloo_lets_go waits until gloo has let go of a collective's CPU tensors. A CUDA backend keeps its work until
    the GPU is done and tells nobody, so for any other device it must not wait: here a tensor of the meta device,
    still held elsewhere as NCCL would hold it, passes at once and without the one-second warning."""
    held = torch.empty(4, device="meta")
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ulysses._gloo_lets_go(held):
            keep = [held]  # a reference made inside the block, as a backend's would be
    assert time.monotonic() - start < 0.5 and keep
