"""
Packed documents under sequence parallelism.

A packed row holds several documents one after another; a document starts wherever its position ids are 0, and
a token attends only to the tokens of its own document. Under sequence parallelism no rank holds the whole row, so
each needs to know where the documents of the sequence begin:

  - Ulysses: after the all-to-all a rank holds the whole sequence for its heads, so it gathers the sequence's
    position ids once (`gather_sequence`) and runs `document_attention` on it:
        ulysses_attention(q, k, v, group, document_attention, position_ids=gather_sequence(position_ids, group))
  - a ring: ring.ring_attention(..., position_ids=...) gathers them over the ring itself and attends block by
    block, each run of a document's queries to the runs of its keys. Under Ulysses x Ring, the position ids and the
    token index are first gathered over the Ulysses group (`gather_sequence`), as gpt.py does.

Per-document balance. Zigzag balances the causal work of ONE sequence (`ring_work` counts each rank's). With
packed documents the work is each document's own triangle, so a rank that holds the tail of a long document does
much more than one that holds short ones. `document_layout` cuts each long document as zigzag cuts a sequence
instead: 2R chunks, rank r taking chunks r and 2R-1-r of it, and deals what remains (short documents whole where
they fit) to the least busy rank. A rank then holds any rising set of positions:
ring.shard_for_ring(..., layout=document_layout) returns each token's index (its place in the padded row), and
ring_attention takes them as the layout.

    document    0 0 0 0 0 0 0 0 0 0 0 0 1 1 1 1     R = 2, every document cut (MIN_CHUNK = 1); each token's rank:
    zigzag      0 0 0 0 1 1 1 1 1 1 1 1 0 0 0 0     20 and 68 query-key pairs (`document_work` counts them)
    documents   0 0 0 1 1 1 1 1 1 0 0 0 0 1 1 0     44 and 44: each rank an early and a late chunk of each

It needs torch, ulysses.py (its kernels) and ring.py (a gather, the token layout, the keys a query sees).
`python -m harness.bench balance` measures the two layouts.
"""

from functools import partial

import torch

import ulysses
from ring import cut, gather_ring, key_ranges, token_index


def gather_sequence(x, group):
    """[B, S/P] -> [B, S]: a small per-token tensor (position ids: B*S integers, never a mask) of every rank of the
    SP group, in rank order. One all-gather."""
    return gather_ring(x, group).movedim(0, 1).flatten(1)  # (P, B, S/P) -> (B, P, S/P) -> (B, S)


@torch._disable_dynamo  # torch.compiler.disable, Dynamo imported at the first call; compiled, its loop over the data's documents would recompile for each new count
def document_attention(q, k, v, position_ids, window=None):
    """Causal (or sliding-window) attention inside each document of a packed sequence, never across documents.
    q [B, S, Hq, D], k and v [B, S, Hkv, D] -> [B, S, Hq, D]. position_ids [B, S] are the positions of the FULL
    sequence; a document starts wherever they are 0. Ulysses' kernel runs once per document, so its scores grow with
    the longest document, never as S^2 (a window keeps every document's [n, n] mask for backward: the sum of n^2)."""
    B, S, Hq, D = q.shape
    if position_ids.shape != (B, S):  # this rank's own [B, S/P], say, would cut documents in the wrong places
        raise ValueError(f"document_attention: position_ids {tuple(position_ids.shape)}, want the full sequence's [B, "
                         f"S] = [{B}, {S}] (under Ulysses, gather_sequence's)")
    # every row starts a document, so none crosses rows: each is attended where it lies, as a view
    bounds = document_bounds(position_ids == 0).tolist()  # (documents + 1,)
    documents = [(s // S, s % S, e - s) for s, e in zip(bounds[:-1], bounds[1:])]  # (row, first token, length)
    kernel = partial(ulysses.sliding_window_attention, window=window) if window else ulysses.causal_attention
    out = [kernel(*(t[b:b + 1, i:i + n] for t in (q, k, v))) for b, i, n in documents]  # (1, n, Hq, D) each
    return torch.cat(out, dim=1).view(B, S, Hq, D)  # (1, B*S, Hq, D) -> (B, S, Hq, D)


def document_bounds(starts):
    """starts [B, S], True where a document starts -> where each document of the batch, seen as one stream of
    B*S tokens, begins (every row begins one too), followed by B*S (flash-attn's cu_seqlens)."""
    B, S = starts.shape
    starts = starts.flatten().clone()  # (B*S,)
    starts[::S] = True
    return torch.cat([starts.nonzero().flatten(), torch.tensor([B * S], device=starts.device)])  # (documents + 1,)


# ----------------------------------------------------------------------------------------------------------------
# balance: the causal work of each ring rank, and per-document balance, each rank an early and a late share of every
# long document


def ring_work(R, L, layout, window=None):
    """Attention work per ring rank in a layout by name ("zigzag", "contiguous"): queries x keys of each block's cut
    (ring.cut, the rectangle handed to the block kernel, masked pairs included) over the R steps. A list of R
    numbers; zigzag makes them equal for causal attention."""
    def pairs(mine, theirs):
        part = cut(*key_ranges(token_index(layout, mine, R, L), token_index(layout, theirs, R, L), window))
        return 0 if part is None else (part[0].stop - part[0].start) * (part[1].stop - part[1].start)
    return [sum(pairs(r, j) for j in range(R)) for r in range(R)]


MIN_CHUNK = 64  # tokens: a piece of a row is cut into 2R chunks only if each holds this many, else goes whole


def document_layout(position_ids, R):
    """Each row of position_ids [B, S] (0 where a document starts, S a multiple of R) dealt to the R ranks of a
    ring, S/R tokens each, so that each rank does about 1/R of the row's causal work and of each long document's.
    ValueError if R does not divide S (ring.shard_for_ring pads to a multiple of 2R first). Returns [B, R, S/R]:
    the token indices each rank holds, rising (ring.shard_for_ring gathers its tokens by them).

    Each piece of a row between document starts (the first may be a document's end, carried over from the row
    before) of n >= 2R x MIN_CHUNK tokens is cut as zigzag cuts a sequence: 2R chunks of n // 2R tokens from its
    two ends, rank r taking chunks r and 2R-1-r, an early one (queries that see few keys) and a late one (many).
    What remains, each shorter piece whole and the fewer than 2R tokens in the middle of a long one, goes heaviest
    first to the least busy rank it fits in whole, or, where it fits in none, fills the rank with the most room
    and goes on. Work: the query-key pairs of causal attention (`keys_seen`). Short pieces stay whole because each
    run of a document on a rank costs the ring a kernel call per block."""
    B, S = position_ids.shape
    if S % R:
        raise ValueError(f"document_layout: {S} tokens per row do not split over a ring of {R}; pad to a multiple of R")
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
                room = [L - len(t) for t in taken]  # free places on each rank
                fits = [j for j in range(R) if room[j] >= len(run)]
                r = min(fits, key=work.__getitem__) if fits else max(range(R), key=room.__getitem__)
                part, run = run[:room[r]], run[room[r]:]
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
    the rows. position_ids [B, S]; layout [B, R, L], the token indices each rank holds (document_layout's, or each
    rank's ring.token_index stacked and expanded to [B, R, L]). A list of R numbers."""
    seen = torch.stack([keys_seen(row) for row in position_ids])  # (B, S)
    return seen.gather(1, layout.flatten(1)).view(layout.shape).sum((0, 2)).tolist()
