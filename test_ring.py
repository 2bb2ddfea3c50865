"""
Tests of ring.py and documents.py against one device: ring attention on 2, 3 and 4 ranks (zigzag and contiguous
layouts, GQA, a sliding window, packed documents, float64, float32 and bf16, and the bytes each rank sends), Ulysses
x Ring (USP) on U x R ranks and the batch cut for it (shard_for_ring), sinks, the causal work per rank of each
layout, and per-document balance.
"""

import itertools
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import documents
import ring
import ulysses
from conftest import assert_all_close, attention_formula, my_tokens, qkv, run_ranks, usp_groups, whole_sequence


RING_CASES = [("zigzag", torch.float64, None, True), ("contiguous", torch.float64, None, True),
              ("zigzag", torch.float32, None, True), ("contiguous", torch.float32, None, True),
              ("zigzag", torch.float64, 3, True), ("zigzag", torch.bfloat16, None, True),
              ("zigzag", torch.float64, None, False), ("contiguous", torch.float32, None, False),
              ("zigzag", torch.bfloat16, None, False)]  # (layout, dtype, window, fused)
# bf16: the ring computes in float32 from bf16 inputs, against one device in float64 from the same bf16 numbers;
# what remains is the rounding of each result to bf16 (8 significant bits: 2^-9 relative) and a float32 sum
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def _full_attention(q, k, v, window, grad_out, position_ids=None):
    """One device: output and dq, dk, dv of causal (or sliding-window) attention over the whole sequence, inside
    each document when position_ids are given."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if position_ids is not None:
        out = documents.document_attention(q, k, v, position_ids, window)
    else:
        out = ulysses.sliding_window_attention(q, k, v, window) if window else ulysses.causal_attention(q, k, v)
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _ring_rank(rank, R, cases):
    ring.QUERY_TILE = 5  # several query tiles a block
    results = []
    for layout, dtype, window, fused in cases:
        index = ring.token_index(layout, rank, R, 24 // R)
        q, k, v, grad_out = (t.to(dtype)[:, index].requires_grad_() for t in qkv(2, 24, 4, 2, 8))
        ring.reset_ring_stats()
        out = ring.ring_attention(q, k, v, dist.group.WORLD, layout, window, fused=fused)
        out.backward(grad_out)
        results.append(([out.detach(), q.grad, k.grad, v.grad], {d: dict(c) for d, c in ring.ring_stats.items()}))
    return results


@pytest.mark.parametrize("R", [2, 3, 4])
def test_ring_attention_matches_one_device(R):
    """Output and dq, dk, dv of ring attention on R ranks against one device: batch 2, GQA (4 query heads, 2 kv
    heads), zigzag and contiguous layouts, float64 within 1e-12 and float32 within 1e-5, bf16 within its rounding
    (outputs and gradients come back in bf16), and a sliding window; the fused block kernel and the einsum
    tiles alike.
    Each rank sends R-1 key/value blocks forward; backward those again and R dk/dv accumulators in float32. A
    backward that computed with the wrong block (the first one, say, instead of the one that arrived) fails."""
    per_rank = run_ranks(R, _ring_rank, RING_CASES)
    for i, (layout, dtype, window, fused) in enumerate(RING_CASES):
        q, k, v, grad_out = (t.to(dtype) for t in qkv(2, 24, 4, 2, 8))
        want = [t.to(dtype) for t in _full_attention(*(t.double() for t in (q, k, v)), window, grad_out.double())]
        got = [torch.zeros_like(t) for t in want]
        for rank in range(R):
            index = ring.token_index(layout, rank, R, 24 // R)
            for full, part in zip(got, per_rank[rank][i][0]):
                full[:, index] = part
        tolerance = TOLERANCE[dtype]
        assert_all_close(got, want, tolerance, tolerance, where=f"R={R} {layout} {dtype} window={window} fused={fused}")
        kv_bytes = 2 * 2 * (24 // R) * 2 * 8 * dtype.itemsize  # k and v: B * L * Hkv * D elements each
        dkv_bytes = kv_bytes * 4 // min(4, dtype.itemsize)  # their gradients, in float32 or wider
        expected = {"forward": {"calls": R - 1, "bytes": (R - 1) * kv_bytes},
                    "backward": {"calls": 2 * R - 1, "bytes": (R - 1) * kv_bytes + R * dkv_bytes}}
        assert [r[i][1] for r in per_rank] == [expected] * R
        assert ring.ring_bytes(R, kv_bytes, dkv_bytes) == (expected["forward"]["bytes"], expected["backward"]["bytes"])
        assert ring.ring_bytes(1, kv_bytes, dkv_bytes) == (0, 0)  # a ring of one sends nothing


# Packed documents in two rows of 24 tokens, each row its own. Row 0: documents at 0, 3, 12 (one token) and 13, the
# last crossing every rank of a ring of up to 4 in both layouts; row 1: at 0, 1 and 12. 12 is a chunk boundary for
# 2R = 4, 6 and 8 chunks, so documents start there on every ring tried.
PACKED_STARTS = [[0, 3, 12, 13], [0, 1, 12]]
PACKED_POSITIONS = torch.stack([torch.arange(24) - torch.tensor([max(s for s in starts if s <= i) for i in range(24)])
                                for starts in PACKED_STARTS])  # (2, 24): 0 where a document starts


def _packed_rank(rank, R, cases):
    ring.QUERY_TILE = 5
    results = []
    for layout, dtype, window, fused in cases:
        index = ring.token_index(layout, rank, R, 24 // R)
        q, k, v, grad_out = (t.to(dtype)[:, index].requires_grad_() for t in qkv(2, 24, 4, 2, 8))
        out = ring.ring_attention(q, k, v, dist.group.WORLD, layout, window, fused=fused,
                                  position_ids=PACKED_POSITIONS[:, index])
        out.backward(grad_out)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return results


PACKED_CASES = [("zigzag", torch.float64, None, True), ("contiguous", torch.float64, None, True),
                ("zigzag", torch.float32, None, True), ("contiguous", torch.float32, None, False),
                ("zigzag", torch.float64, 3, True)]  # (layout, dtype, window, fused)


@pytest.mark.parametrize("R", [2, 3, 4])
def test_ring_packed_documents_match_one_device(R):
    """Packed documents (PACKED_POSITIONS): output and dq, dk, dv of ring attention on R ranks against one device's
    attention inside each document, float64 within 1e-12 and float32 within 1e-5, both layouts, a sliding window,
    the fused kernel and the einsum tiles. A document crosses every rank, one starts at a chunk boundary, and the
    two rows of the batch have different documents."""
    per_rank = run_ranks(R, _packed_rank, PACKED_CASES)
    for i, (layout, dtype, window, fused) in enumerate(PACKED_CASES):
        q, k, v, grad_out = (t.to(dtype) for t in qkv(2, 24, 4, 2, 8))
        want = _full_attention(q, k, v, window, grad_out, PACKED_POSITIONS)
        got = [torch.zeros_like(t) for t in want]
        for rank in range(R):
            index = ring.token_index(layout, rank, R, 24 // R)
            for full, part in zip(got, per_rank[rank][i]):
                full[:, index] = part
        assert_all_close(got, want, TOLERANCE[dtype], TOLERANCE[dtype],
                         where=f"R={R} {layout} {dtype} window={window} fused={fused}")


def _usp_rank(rank, P, U, R, heads, cases):
    ring.QUERY_TILE = 5  # several query tiles a block
    ulysses_group, ring_group = usp_groups(U, R)
    S = 24
    index = my_tokens(S, ulysses_group, ring_group)  # my global tokens
    positions = documents.gather_sequence(PACKED_POSITIONS[:, index], ulysses_group)  # of my ring rank's tokens
    results = []
    for dtype, window, packed in cases:
        q, k, v, grad_out = (t.to(dtype)[:, index].requires_grad_() for t in qkv(2, S, *heads, 8))
        attend = partial(ring.ring_attention, group=ring_group, layout="zigzag", window=window,
                         position_ids=positions if packed else None)
        out = ulysses.ulysses_attention(q, k, v, ulysses_group, attend)
        out.backward(grad_out)
        results.append((index, [out.detach(), q.grad, k.grad, v.grad]))
    return results


@pytest.mark.parametrize("U, R, heads", [(2, 2, (4, 2)), (2, 3, (4, 2)), (4, 1, (4, 2)), (1, 4, (4, 2)),
                                         (3, 2, (8, 2))])
def test_ring_usp_matches_one_device(U, R, heads):
    """Ulysses x Ring on U x R ranks against one device, output and dq, dk, dv: float64 within 1e-12, float32
    within 1e-5, a sliding window, and packed documents (PACKED_POSITIONS). 4 query heads and 2 kv heads (with U = 4
    each kv head travels to two ranks), and 8 and 2 on U = 3 (uneven: 3, 3, 2 query heads, the middle rank using both
    kv heads). shard_for_ring gives each rank its tokens in the zigzag order, and every token to exactly one rank."""
    cases = [(torch.float64, None, False), (torch.float32, None, False), (torch.float64, 5, False),
             (torch.float64, None, True), (torch.float32, 5, True)]
    per_rank = run_ranks(U * R, _usp_rank, U, R, heads, cases)
    assert sorted(torch.cat([r[0][0] for r in per_rank]).tolist()) == list(range(24))
    for i, (dtype, window, packed) in enumerate(cases):
        q, k, v, grad_out = (t.to(dtype) for t in qkv(2, 24, *heads, 8))
        want = _full_attention(q, k, v, window, grad_out, PACKED_POSITIONS if packed else None)
        got = [torch.zeros_like(t) for t in want]
        for index, parts in (r[i] for r in per_rank):
            for full, part in zip(got, parts):
                full[:, index] = part
        tolerance = TOLERANCE[dtype]
        assert_all_close(got, want, tolerance, tolerance,
                         where=f"U={U} R={R} heads={heads} {dtype} window={window} packed={packed}")


def _shard_inputs(S):
    """Input ids, labels and position ids [2, S]: ids from 100 up, labels 0 to 6 again and again, packed positions."""
    return torch.arange(100, 100 + S).expand(2, S), torch.arange(S).expand(2, S) % 7, PACKED_POSITIONS[:, :S]


def same_positions(position_ids, R):
    """Not a layout: every ring rank the first S/R positions."""
    B, S = position_ids.shape
    return torch.arange(S // R).expand(B, R, S // R)


def falling_positions(position_ids, R):
    """Not a layout: each ring rank its zigzag positions, falling."""
    B, S = position_ids.shape
    return torch.stack([ring.token_index("zigzag", r, R, S // R).flip(0) for r in range(R)]).expand(B, R, S // R)


def _shard_rank(rank, P, U, R, S):
    ulysses_group, ring_group = usp_groups(U, R)
    ids, labels, positions = _shard_inputs(S)
    shards = [ring.shard_for_ring(ids, labels, positions, ulysses_group, ring_group, layout)
              for layout in (None, documents.document_layout)]
    errors = []
    for layout in (same_positions, falling_positions) if R > 1 else ():
        *_, my_positions, index = ring.shard_for_ring(ids, labels, positions, ulysses_group, ring_group, layout)
        index, my_positions = (documents.gather_sequence(t, ulysses_group) for t in (index, my_positions))  # as gpt.py
        q = torch.zeros(2, index.shape[1], 2, 8)  # (B, U L, H, D): the Ulysses group's tokens, as attention gets them
        try:
            ring.ring_attention(q, q, q, ring_group, index, position_ids=my_positions)
        except ValueError as e:
            errors.append(str(e))
    return shards, ulysses.shard_for_sp(ids, labels, positions, ulysses_group) if R == 1 else None, errors


# (U, R): the token index of each rank in world order (U consecutive ranks a Ulysses group), for S = 15: padded to a
# multiple of 2P (of P without a ring), ring rank r takes chunks r and 2R-1-r of 2R, its Ulysses ranks split them
SHARD_CASES = {(2, 2): [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]],
               (1, 3): [[0, 1, 2, 15, 16, 17], [3, 4, 5, 12, 13, 14], [6, 7, 8, 9, 10, 11]],
               (2, 1): [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]}


@pytest.mark.parametrize("U, R", list(SHARD_CASES))
def test_shard_for_ring_cuts_the_padded_sequence(U, R):
    """shard_for_ring on U x R ranks, 2 rows of 15 tokens: each rank's token index is the zigzag order (SHARD_CASES),
    the same in both rows; its ids, labels and positions are the padded sequence's at its token index (input 0,
    label -100, positions counting on past the last), so every rank's shards put back by token index give the padded
    sequence, each token once; with a ring of one rank it equals ulysses.shard_for_sp. With documents.document_layout
    each ring rank's tokens, joined over its Ulysses ranks in order, are document_layout's share of the padded row;
    a layout function whose ranks hold the same positions, or positions that fall, is refused on every rank when
    ring_attention gets its token index."""
    S_pad = len(sum(SHARD_CASES[U, R], []))
    per_rank = run_ranks(U * R, _shard_rank, U, R, 15)
    ids, labels, positions = _shard_inputs(15)  # the last positions: 1 and 2
    padded = [torch.cat([t, torch.full((2, S_pad - 15), fill)], dim=1) for t, fill in ((ids, 0), (labels, -100))]
    padded.append(torch.cat([positions, positions[:, -1:] + torch.arange(1, S_pad - 14)], dim=1))  # (2, S_pad) each
    for layout in range(2):
        indices = [shards[layout][3] for shards, _, _ in per_rank]
        if layout == 0:
            assert [index.tolist() for index in indices] == [[row] * 2 for row in SHARD_CASES[U, R]]
        else:
            every = documents.document_layout(padded[2], R)  # (2, R, S_pad/R)
            for r in range(R):
                assert torch.equal(torch.cat(indices[r * U:(r + 1) * U], dim=1), every[:, r]), (layout, r)
        assert all(sorted(row) == list(range(S_pad)) for row in torch.cat(indices, dim=1).tolist())
        for i, full in enumerate(padded):
            got = whole_sequence([shards[layout][i] for shards, _, _ in per_rank], indices)  # (2, S_pad)
            assert torch.equal(got, full), (layout, i)
    for shards, one_ring, errors in per_rank:
        assert one_ring is None or all(torch.equal(a, b) for a, b in zip(shards[0], one_ring))
        refused = "layout: each ring rank must hold rising token indices, each token once"
        assert errors == [refused] * (2 if R > 1 else 0), errors
    with pytest.raises(ValueError, match=r"^shard_for_ring: input_ids \(2, 15\), labels \(2, 14\), position_ids "):
        ring.shard_for_ring(ids, labels[:, 1:], positions, None, None)


def test_ring_work_is_balanced_by_zigzag():
    """Causal work per rank (query-key pairs computed): zigzag gives every rank the same, a contiguous split
    gives the last rank R times the first rank's."""
    for R in (2, 3, 4, 8):
        L = 4 * R
        assert len(set(documents.ring_work(R, L, "zigzag"))) == 1, R
        contiguous = documents.ring_work(R, L, "contiguous")
        assert contiguous == sorted(contiguous) and contiguous[-1] == R * contiguous[0], R
    # zigzag on R ranks: my own block (a causal pair of chunks) and half of each other block
    assert documents.ring_work(4, 8, "zigzag") == [8 * 8 + 3 * 8 * 4] * 4


def test_fused_kernel_covers_every_block_without_a_window():
    """Without a window every block a ring meets, cut to what its queries see, is one of the two masks the fused
    kernel takes: every key, or causal on the diagonal. With a window the cut blocks need the einsum tiles."""
    for R in (1, 2, 3, 4):
        for layout, window, fused in (("zigzag", None, True), ("contiguous", None, True), ("zigzag", 3, False)):
            for r in range(R):
                mine = ring.token_index(layout, r, R, 8)
                for j in range(R):
                    lo, hi = ring.key_ranges(mine, ring.token_index(layout, j, R, 8), window)
                    if (part := ring.cut(lo, hi)) is not None:
                        rows, cols = part
                        mask = ring._fused_mask(lo[rows] - cols.start, hi[rows] - cols.start, cols.stop - cols.start)
                        assert (mask is not None) == fused, (R, layout, window, r, j)


def test_a_ring_of_one_sends_nothing_and_takes_an_empty_shard():
    """group=None: a ring of one rank, its own block alone (the causal square, found without a search; or one
    document's runs). Against SDPA in float64 (1e-12), fused and with the tiles, nothing sent; a rank that holds no
    token gets empty results. q may lie in any strides (here its head size not contiguous): the fused kernel
    gets it contiguous."""
    for L, fused, packed, strided in itertools.product((0, 6), (True, False), (False, True), (False, True)):
        q = (torch.randn(1, L, 8, 4, dtype=torch.float64).transpose(2, 3) if strided else
             torch.randn(1, L, 4, 8, dtype=torch.float64)).requires_grad_()  # (1, L, 4, 8)
        k, v = (torch.randn(1, L, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        ring.reset_ring_stats()
        out = ring.ring_attention(q, k, v, fused=fused, position_ids=torch.arange(L)[None] if packed else None)
        out.backward(torch.ones_like(out))
        assert ring.ring_stats == {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}
        got = [out.detach(), q.grad, k.grad, v.grad]
        assert [t.shape for t in got] == [t.shape for t in (q, q, k, v)], (L, fused, packed)
        if L:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                                  enable_gqa=True).transpose(1, 2)
            want.backward(torch.ones_like(want))
            assert_all_close(got, [want.detach(), q.grad, k.grad, v.grad], 1e-12, 1e-12,
                             where=f"fused={fused} packed={packed} strided={strided}")


def _options_rank(rank, R):
    results = []
    for layout, causal, fused in (("zigzag", False, True), ("contiguous", False, False), ("zigzag", True, True),
                                  ("contiguous", True, False)):
        index = ring.token_index(layout, rank, R, 24 // R)
        q, k, v, grad_out = (t.double()[:, index].requires_grad_() for t in qkv(2, 24, 4, 2, 8))
        out, lse = ring.ring_attention(q, k, v, dist.group.WORLD, layout, causal=causal, scale=0.3, return_lse=True,
                                       fused=fused)
        out.backward(grad_out)
        results.append((index, [out.detach(), lse, q.grad, k.grad, v.grad]))
    errors = []
    for q in (torch.zeros(1, 12 if rank else 10, 4, 8),
              torch.zeros(1, 12, 4, 8, dtype=torch.float64 if rank else None)):
        try:
            ring.ring_attention(q, q, q, dist.group.WORLD, "zigzag")
        except ValueError as e:
            errors.append(str(e))
    try:  # no layout, on every rank alike
        ring.ring_attention(q.float(), q.float(), q.float(), dist.group.WORLD)
    except ValueError as e:
        errors.append(str(e))
    q = torch.zeros(1, 8, 4, 8)
    for kv in (torch.zeros(1, 8, 2, 4 if rank == 1 else 8), torch.zeros(1, 8, 2, 8, dtype=torch.float64 if rank == 1
                                                                          else None),
               torch.zeros(1, 8, 2, *([] if rank == 1 else [8]))):  # rank 1: k, v unlike its q
        try:
            ring.ring_attention(q, kv, kv, dist.group.WORLD, "zigzag")
        except ValueError as e:
            errors.append(str(e))
    kv = q[:, :, :2]
    try:  # rank 1: 3 sink logits for 4 query heads
        ring.ring_attention(q, kv, kv, dist.group.WORLD, "zigzag", sinks=torch.zeros(3 if rank == 1 else 4))
    except ValueError as e:
        errors.append(str(e))
    try:  # rank 1: position ids of one row for two rows of queries (the other row's output would stay zero)
        two = torch.zeros(2, 8, 4, 8)
        ring.ring_attention(two, two[:, :, :2], two[:, :, :2], dist.group.WORLD, "zigzag",
                            position_ids=torch.zeros(1 if rank == 1 else 2, 8, dtype=torch.long))
    except ValueError as e:
        errors.append(str(e))
    for window, causal in ((-1, True), (4, False)):
        try:  # a window that looks forward, or one without causal attention
            ring.ring_attention(q, kv, kv, dist.group.WORLD, "zigzag", window=window, causal=causal)
        except ValueError as e:
            errors.append(str(e))
    for option in (dict(sinks=torch.zeros(4)), dict(window=3), dict(window=-1), dict(causal=False),
                   dict(layout="contiguous"), dict(window=3.0)):  # on rank 1 alone (3.0: the row stays whole numbers)
        try:
            ring.ring_attention(q, kv, kv, dist.group.WORLD, **{"layout": "zigzag", **(option if rank == 1 else {})})
        except ValueError as e:
            errors.append(str(e))
    mine = ring.token_index("contiguous", rank, R, 8)[None]  # (1, 8): rising, each token once over the ranks
    ones = torch.ones(1, 8, dtype=torch.long)
    for index, position_ids in ((mine.flip(1) if rank == 1 else mine, ones),  # falling on rank 1
                                (ring.token_index("contiguous", 0, R, 8)[None], ones),  # the same on every rank
                                ("zigzag", None if rank == 1 else ones),  # position ids on ranks 0 and 2 only
                                (mine[:, :7] if rank == 1 else mine, ones),  # rank 1: indices of 7 tokens for 8
                                (mine, ones.int() if rank == 1 else ones),  # int32 position ids on rank 1: fine
                                (mine.int() if rank == 1 else mine, ones)):  # int32 token indices on rank 1: fine
        try:
            ring.ring_attention(q, kv, kv, dist.group.WORLD, index, position_ids=position_ids)
        except ValueError as e:
            errors.append(str(e))
    return results, errors


def test_ring_options_lse_and_mismatched_ranks():
    """causal=False, a softmax scale and the log-sum-exp as an output, on 3 ranks against one device in float64
    (1e-12), the fused kernel and the einsum tiles, each layout. Ranks that hold different token counts or dtypes
    get one error on every rank naming each rank's value, never a gloo abort, and so does a rank whose own k and v
    do not fit its q (another head size, another dtype, three dimensions), whose sinks do not fit its query heads, or
    whose position ids have fewer rows than its queries, or whose token indices do not fit its queries, and ranks that
    pass position ids or not (int32 on one rank, int64 on another, is fine), or one rank whose sinks, window (one
    that looks forward, too), causal or layout differ from the others'; a ring called without its layout is
    refused, and so are a window that looks forward, a window without causal attention, and token indices that fall
    on a rank or repeat a token."""
    R = 3
    per_rank = run_ranks(R, _options_rank)
    for i, causal in enumerate((False, False, True, True)):
        q, k, v, grad_out = (t.double().requires_grad_() for t in qkv(2, 24, 4, 2, 8))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 0.3  # (B, Hq, S, S)
        if causal:
            scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(2, dim=2))  # (B, S, Hq, D)
        out.backward(grad_out)
        want = [out.detach(), scores.logsumexp(-1).transpose(1, 2).detach(), q.grad, k.grad, v.grad]
        got = [torch.zeros_like(t) for t in want]
        for index, parts in (r[0][i] for r in per_rank):
            for full, part in zip(got, parts):
                full[:, index] = part
        assert_all_close(got, want, 1e-12, 1e-12, where=f"case {i}")
    want = ("; want q [B, L, Hq, D], k and v [B, L, Hkv, D], one dtype, Hkv dividing Hq, sinks [Hq], position_ids "
            "[B, L] (USP: gathered), indices only with them")
    by_rank = ("the inputs differ between the ranks or do not fit together ([B, L, Hq, D, Hkv, dtype, position_ids?, "
               "sinks?, window, causal, layout: 0 zigzag, 1 contiguous, 2 indices, 3 none or another] by rank: ")
    fp32, fp64 = "torch.float32", "torch.float64"
    row, plain = f"1, 8, 4, 8, 2, {fp32}", "0, 0, 0, 1, 0"  # plain: no position ids or sinks, no window, causal, zigzag
    for rank, (_, errors) in enumerate(per_rank):
        unfit = [f"{by_rank}0: [{row}, {options}]; 1: unfit; 2: [{row}, {options}])"
                 f"{mine if rank == 1 else ''}{want}" for mine, options in (
                     (f" (this rank: q (1, 8, 4, 8) {fp32}, k (1, 8, 2, 4) {fp32}, v (1, 8, 2, 4) {fp32})", plain),
                     (f" (this rank: q (1, 8, 4, 8) {fp32}, k (1, 8, 2, 8) {fp64}, v (1, 8, 2, 8) {fp64})", plain),
                     (f" (this rank: q (1, 8, 4, 8) {fp32}, k (1, 8, 2) {fp32}, v (1, 8, 2) {fp32})", plain),
                     (f" (this rank: q (1, 8, 4, 8) {fp32}, k (1, 8, 2, 8) {fp32}, v (1, 8, 2, 8) {fp32}, sinks (3,) "
                      f"{fp32})", "0, 1, 0, 1, 0"))]
        assert errors == [
            f"{by_rank}0: [1, 10, 4, 8, 4, {fp32}, {plain}]; 1: [1, 12, 4, 8, 4, {fp32}, {plain}]; 2: [1, 12, 4, 8, "
            f"4, {fp32}, {plain}]){want}",
            f"{by_rank}0: [1, 12, 4, 8, 4, {fp32}, {plain}]; 1: [1, 12, 4, 8, 4, {fp64}, {plain}]; 2: [1, 12, 4, 8, "
            f"4, {fp64}, {plain}]){want}",
            "layout=None: a ring of 3 ranks takes 'zigzag', 'contiguous' or token indices [B, L]"] + unfit + [
            f"{by_rank}0: [2, 8, 4, 8, 2, {fp32}, 1, {plain[3:]}]; 1: unfit; 2: [2, 8, 4, 8, 2, {fp32}, 1, "
            f"{plain[3:]}])" + (f" (this rank: q (2, 8, 4, 8) {fp32}, k (2, 8, 2, 8) {fp32}, v (2, 8, 2, 8) {fp32}, "
                                f"position_ids (1, 8) torch.int64)" if rank == 1 else "") + want] + [
            f"window={w}: a sliding window looks back from each query: 1 or more tokens, causal=True"
            for w in (-1, 4)] + [
            f"{by_rank}0: [{row}, {plain}]; 1: [{row}, {options}]; 2: [{row}, {plain}]){want}"
            for options in ("0, 1, 0, 1, 0", "0, 0, 3, 1, 0", "0, 0, -1, 1, 0", "0, 0, 0, 0, 0", "0, 0, 0, 1, 1",
                            "0, 0, 3, 1, 0")] + [
            "layout: each ring rank must hold rising token indices, each token once"] * 2 + [
            f"{by_rank}0: [{row}, 1, 0, 0, 1, 0]; 1: [{row}, {plain}]; 2: [{row}, 1, 0, 0, 1, 0]){want}",
            f"{by_rank}0: [{row}, 1, 0, 0, 1, 2]; 1: unfit; 2: [{row}, 1, 0, 0, 1, 2])" + (
                f" (this rank: q (1, 8, 4, 8) {fp32}, k (1, 8, 2, 8) {fp32}, v (1, 8, 2, 8) {fp32}, position_ids "
                f"(1, 8) torch.int64, layout (1, 7) torch.int64)" if rank == 1 else "") + want]


def _large_scores(seed=2):
    """q, k, v and the output's gradient [1, 16, heads, D], 4 query and 2 kv heads, q scaled by 300: scores in the
    hundreds, log-sum-exps near 1000, where float32 keeps four decimals."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(1, 16, h, 8, generator=g) for h in (4, 2, 2, 4))
    return q * 300, k, v, grad_out


def _large_scores_rank(rank, R):
    results = []
    for fused in (True, False):
        index = ring.token_index("zigzag", rank, R, 16 // R)
        q, k, v, grad_out = (t[:, index] for t in _large_scores())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = ring.ring_attention(q, k, v, dist.group.WORLD, "zigzag", fused=fused)
        out.backward(grad_out)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return results


def test_ring_keeps_one_softmax_precision_at_large_scores():
    """Scores in the hundreds (float32): the ring on 2 ranks, the fused kernel and the tiles, stays within 3x of one
    process's error against exact float64 math, output and each gradient (over 12 random inputs the worst was 3.3x,
    the median 1.1x). The merge keeps the larger log-sum-exp as it is; a merge that adds the difference of two lse
    values near 1000 rounds it, and tiles that normalize by exp(scores - lse) instead of by the sum carry lse's
    rounding into every output: on these inputs 27x and 38x."""
    q, k, v, grad_out = _large_scores()
    exact = _full_attention(*(t.double() for t in (q, k, v)), None, grad_out.double())
    one = _full_attention(q, k, v, None, grad_out)
    per_rank = run_ranks(2, _large_scores_rank)
    for i, fused in enumerate((True, False)):
        got = [torch.zeros_like(t) for t in exact]
        for rank in range(2):
            index = ring.token_index("zigzag", rank, 2, 8)
            for full, part in zip(got, per_rank[rank][i]):
                full[:, index] = part.double()
        for name, ours, theirs, truth in zip(("out", "dq", "dk", "dv"), got, one, exact):
            ring_error, one_error = (ours - truth).abs().max(), (theirs.double() - truth).abs().max()
            assert ring_error <= 3 * one_error, (fused, name, ring_error.item(), one_error.item())


# ================================================================================================================
# attention sinks: a logit per query head in each query's softmax, once per query however the ranks split it

SINK_HEADS = {2: (3, 1), 3: (8, 2), 4: (6, 2)}  # P: (query heads, kv heads), split unevenly over P Ulysses ranks
SINK_CASES = [  # (attention, dtype, window, packed, fused); "usp" on 4 ranks alone (Ulysses 2 x ring 2)
    ("ring zigzag", torch.float64, None, False, True), ("ring contiguous", torch.float32, None, False, False),
    ("ring zigzag", torch.float64, 3, True, False), ("ring zigzag", torch.float32, None, True, True),
    ("ring zigzag", torch.bfloat16, 3, False, True), ("ring compiled", torch.float32, None, False, True),
    ("ulysses", torch.float64, None, False, True), ("ulysses", torch.float32, 3, True, False),
    ("ulysses", torch.bfloat16, None, True, True), ("usp", torch.float64, 5, True, True),
    ("usp", torch.float32, None, False, False)]


def sink_logits(Hq, dtype):
    """Fixed sink logits [Hq], from -3 to 3: from nearly no share of a softmax to most of an early query's."""
    return torch.linspace(-3, 3, Hq, dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def _sinks_rank(rank, P, cases):
    ring.QUERY_TILE = 5  # several query tiles a block
    Hq, Hkv = SINK_HEADS[P]
    world = dist.group.WORLD
    ulysses_group, ring_group = usp_groups(2, 2) if P == 4 else (None, None)
    results = []
    for attention, dtype, window, packed, fused in cases:
        if attention.startswith("ring"):
            layout = attention.split()[1] if attention != "ring compiled" else "zigzag"
            index = ring.token_index(layout, rank, P, 24 // P)
            attend = partial(ring.ring_attention, group=world, layout=layout, window=window, fused=fused,
                             position_ids=PACKED_POSITIONS[:, index] if packed else None)
            if attention == "ring compiled":
                attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
        elif attention == "ulysses":  # ring attention of one rank as the kernel, on this rank's heads
            index = my_tokens(24, world, None)
            attend = partial(ulysses.ulysses_attention, group=world, attn_fn=partial(
                ring.ring_attention, window=window, fused=fused, position_ids=PACKED_POSITIONS if packed else None))
        else:
            index = my_tokens(24, ulysses_group, ring_group)
            positions = documents.gather_sequence(PACKED_POSITIONS[:, index], ulysses_group)  # my ring rank's
            attend = partial(ulysses.ulysses_attention, group=ulysses_group, attn_fn=partial(
                ring.ring_attention, group=ring_group, layout="zigzag", window=window, fused=fused,
                position_ids=positions if packed else None))
        q, k, v, grad_out = (t.to(dtype)[:, index].requires_grad_() for t in qkv(2, 24, Hq, Hkv, 8))
        sinks = sink_logits(Hq, dtype).requires_grad_()
        out = attend(q, k, v, sinks=sinks)
        out.backward(grad_out)
        results.append((index, [out.detach(), q.grad, k.grad, v.grad], sinks.grad))
    return results


@pytest.mark.parametrize("P", [2, 3, 4])
def test_sinks_match_one_device(P):
    """Attention sinks, output and the gradients of q, k, v and the sink logits against one device's formula (a
    softmax over the scores and the sink, the sink's column dropped): ring attention on P ranks (both layouts,
    a sliding window, packed documents, the fused kernel and the einsum tiles, compiled), ulysses_attention on P
    ranks with ring attention of one rank as its kernel (uneven heads: 3 on 1 kv head over 2 ranks, 8 on 2 over 3,
    6 on 2 over 4), and USP on 4 (Ulysses 2 x ring 2); float64 within 1e-12, float32 within 1e-5, bf16 within its
    rounding of the largest value, as test_kernels.py holds it (Ulysses sends a kv head's gradient back from several
    ranks, each part rounded to bf16, and adds them: without sinks too, 3 elements of 768 miss 2^-7 of their own
    size on 3 ranks). Each rank's sink gradient holds its own queries' (a ring) or heads' (Ulysses) share, and
    their sum is one device's. A sink merged at every block instead of once after the last, or the sinks of
    another rank's heads, fail here."""
    cases = [case for case in SINK_CASES if case[0] != "usp" or P == 4]
    per_rank = run_ranks(P, _sinks_rank, cases)
    for i, (attention, dtype, window, packed, fused) in enumerate(cases):
        Hq, Hkv = SINK_HEADS[P]
        q, k, v, grad_out = (t.to(dtype) for t in qkv(2, 24, Hq, Hkv, 8))
        want = attention_formula(q, k, v, grad_out, window, PACKED_POSITIONS if packed else None,
                                 sink_logits(Hq, dtype))
        indices = [r[i][0] for r in per_rank]
        got = [whole_sequence([r[i][1][j] for r in per_rank], indices).double() for j in range(4)]
        got.append(sum(r[i][2] for r in per_rank).double())
        scale = max(t.abs().max().item() for t in want) if dtype == torch.bfloat16 else 1
        assert_all_close(got, want, TOLERANCE[dtype], TOLERANCE[dtype] * scale,
                         where=f"P={P} {attention} {dtype} window={window} packed={packed} fused={fused}")


# ================================================================================================================
# per-document balance: each ring rank an early and a late share of every packed document

# row 0 as PACKED_POSITIONS'; row 1 opens inside a document carried over from the row before (positions 7 to 11),
# then documents of 1, 11 and 7 tokens
BALANCE_POSITIONS = torch.stack([PACKED_POSITIONS[0], torch.cat([torch.arange(7, 12), torch.arange(1), torch.arange(11),
                                                                 torch.arange(7)])])  # (2, 24)


def _balance_rank(rank, P, U, R, cases):
    ring.QUERY_TILE = 5
    ulysses_group, ring_group = usp_groups(U, R)
    results = []
    for dtype, window, fused, min_chunk in cases:
        documents.MIN_CHUNK = min_chunk
        _, _, positions, index = ring.shard_for_ring(*[BALANCE_POSITIONS] * 3, ulysses_group, ring_group,
                                                     documents.document_layout)
        layout, ring_positions = (documents.gather_sequence(t, ulysses_group) for t in (index, positions))  # my ring's
        q, k, v, grad_out = (t.to(dtype)[torch.arange(2)[:, None], index].requires_grad_()  # (B, 24/P, heads, D)
                             for t in qkv(2, 24, 4, 2, 8))
        sinks = sink_logits(4, dtype).requires_grad_()
        attend = partial(ring.ring_attention, group=ring_group, layout=layout, window=window, fused=fused,
                         position_ids=ring_positions)
        out = ulysses.ulysses_attention(q, k, v, ulysses_group, attend, sinks=sinks)
        out.backward(grad_out)
        results.append((index, [out.detach(), q.grad, k.grad, v.grad], sinks.grad))
    return results


@pytest.mark.parametrize("U, R", [(1, 2), (1, 3), (2, 2), (1, 4)])
def test_document_balance_matches_one_device(U, R):
    """The per-document layout (shard_for_ring with documents.document_layout, each row its own) under a ring of R and
    Ulysses x Ring, against one device's formula: output and the gradients of q, k, v and the sink logits, float64
    within 1e-12 and float32 within 1e-5, with a sliding window and attention sinks, fused and tiles; every
    document cut into 2R chunks (MIN_CHUNK 1), or every one dealt whole (MIN_CHUNK 8; on 3 ranks the longest fits
    in none and is split). Every token goes to exactly one rank. A layout the ring reads other than the one the
    data was cut in, or the first block of a row's runs overwriting the one before, fails here."""
    cases = [(torch.float64, None, True, 1), (torch.float64, 5, False, 1), (torch.float32, 5, True, 1),
             (torch.float32, None, False, 1), (torch.float64, None, True, 8), (torch.float32, 5, True, 8)]
    per_rank = run_ranks(U * R, _balance_rank, U, R, cases)
    for i, (dtype, window, fused, min_chunk) in enumerate(cases):
        indices = [r[i][0] for r in per_rank]
        assert all(sorted(row) == list(range(24)) for row in torch.cat(indices, dim=1).tolist())
        q, k, v, grad_out = (t.to(dtype) for t in qkv(2, 24, 4, 2, 8))
        want = attention_formula(q, k, v, grad_out, window, BALANCE_POSITIONS, sink_logits(4, dtype))
        got = [whole_sequence([r[i][1][j] for r in per_rank], indices).double() for j in range(4)]
        got.append(sum(r[i][2] for r in per_rank).double())
        assert_all_close(got, want, TOLERANCE[dtype], TOLERANCE[dtype],
                         where=f"U={U} R={R} {dtype} window={window} fused={fused} MIN_CHUNK={min_chunk}")
