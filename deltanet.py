"""
Gated DeltaNet: linear attention whose memory is a matrix, decayed and corrected token by token. Hybrid models
use it beside softmax attention (Qwen3-Next: three Gated DeltaNet layers to one softmax layer); gpt.py builds
its `d` layers from this file.

The gated delta rule. Per batch row and value head, a state M maps keys to values: a [Dk, Dv] matrix, M_0 = 0.
Token t decays it, corrects it towards v_t at k_t, and reads it at q_t:

    M_t = exp(g_t) (I - beta_t k_t k_t^T) M_{t-1} + beta_t k_t v_t^T        M_t [Dk, Dv]
    o_t = M_t^T q_t / sqrt(Dk)                                               o_t [Dv]

The same step in two halves, as `gated_delta_rule` computes it:

    M   = exp(g_t) M_{t-1}                      forget: g_t <= 0 is the log of the decay
    M_t = M + beta_t k_t (v_t - M^T k_t)^T      learn: a gradient step on |M^T k_t - v_t|^2 / 2, rate beta_t

With k_t L2-normalised (the layer does it) and beta_t in (0, 1), the step moves what M returns for k_t a share beta_t
of the way to v_t. A document start resets the state: exp(g_t) = 0 there. The kernels take softmax attention's
layout, one head per value head: q, k [B, S, H, Dk], v [B, S, H, Dv], g and beta [B, S, H], and `starts`, a
bool [B, S] marking where documents start (None: one document a row) -> o [B, S, H, Dv].
`gated_delta_rule` runs the recurrence token by token. It is the reference.

The chunked form. S rank-one updates one after another are slow. Cut the sequence into chunks of C = 64 tokens.
Inside a chunk, each state and each output is affine in the state M0 the chunk starts from: a matrix times M0, plus
a term from the chunk's own tokens. So the C steps unroll into matrix products. One triangular solve gives all the
chunk's corrections at once, as affine functions of M0 (the UT transform). Only the state is carried, in a loop
over the ceil(S/C) chunks. Every step of this algebra is an identity: nothing is dropped or approximated. So the chunked
form equals the recurrence up to float round-off (the tests hold it there at 1e-10 in float64).
`chunk_gated_delta_rule` writes the algebra out.

The causal convolution. Before the rule, every channel of q, k and v mixes each token with the conv_width-1 before it (4
taps by default): a depthwise convolution that never looks ahead, then silu. It restarts at every document start.

The layer. One projection turns x [B, S, h] into q and k [B, S, Hk, Dk], v and z [B, S, Hv, Dv], and b and a
[B, S, Hv]. beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias), with A_log and dt_bias per value head as
in Mamba2. There may be fewer key heads (q, k) than value heads (v, the state, the output): key head j serves
value heads j*G .. j*G + G-1, G = Hv / Hk, like grouped-query attention in reverse. The output is gated per
token: out = proj(RMSNorm(o) * silu(z)). There is no RoPE: the recurrence knows the order of the tokens.
`gated_delta_net` is everything in between: the conv and the rule, which need the whole sequence, and the L2
norms and gates. It computes in float32 (float64 stays) with autocast off: cumulative decays and a state carried
over the whole sequence would drift in bf16.

Under Ulysses SP the heads travel, as in softmax attention. gated_delta_net runs between the exchanges to heads
and back, on this rank's value heads; the rest stays outside (the gate's z never travels):

    local tokens, all heads          all tokens, my heads                    local tokens, all heads
    x -> q, k, v, z, b, a  --a2a-->  q, k, v, b, a:                 --a2a--> o -> RMSNorm(o) * silu(z) -> out
         (z stays here)              conv over the sequence (my heads'
                                     channels of its weight), silu, L2
                                     norm of q and k, gates from b and a
                                     (my heads' A_log and dt_bias), the
                                     gated delta rule -> o

Three all-to-alls per layer forward (q and k side by side to key heads, v, b and a to value heads, o back), and three
in backward. Value heads are split over the ranks as query heads are, and each rank receives exactly the key heads
its value heads use (`head_layout`, value heads in the role of query heads). A value head stays whole on one rank (a
key head may go to several): at most Hv ranks, and the bytes grow with S. With packed documents, the starts come
from the all-gathered position ids, since the rule runs over the whole sequence.

The context-parallel way (gdn_parallel="context") moves summaries of the state instead. Each rank keeps its own tokens
with all heads. The rule is affine in its starting state: over a run of tokens, state_out = T @ state_in + h_ext, with
h_ext [Dk, Dv] the state reached from zero and T [Dk, Dk] the product of the tokens' transitions exp(g_t) (I - beta_t
k_t k_t^T), the latest leftmost. A document start inside the run zeroes T by itself (its decay is 0). So:

    rank 0        rank 1        rank 2          each rank: (T_r, h_r) of its tokens, one kernel call a run
    T_0, h_0      T_1, h_1      T_2, h_2        all-gather the pairs, then each folds those before it:
      |             |             |
    s_0 = 0  ->  s_1 = h_0  ->  s_2 = T_1 s_1 + h_1       s_r: the state rank r starts from, float32 or wider

The same kernel gives the pair: append Dk zero columns to v and start from [0 | I]. A zero value column evolves by
the transitions alone, so the final state is [h_ext | T]. That call gives the outputs too: o_t = o_t(from 0) + s^T
(T_t^T q_t) / sqrt(Dk), and the appended columns' outputs are T_t^T q_t / sqrt(Dk) (T_t: the product of the
transitions up to t). The convolution takes the conv_width-1 tokens before each run from the ranks that hold them,
all-gathered (zeros before the sequence; each token with its document-start flag). Backward differentiates each
rank's fold and left contexts, and returns each gathered piece's gradient to its rank, summed. With a ring, zigzag
gives a rank one or two runs of the sequence (`token_runs`), each a link of the chain. Any number of ranks, and the
bytes do not grow with S: (P-1) x [Dk, Dv + Dk] a value head and conv_width-1 tokens, per run slot and row, each way.

The file reads: the recurrence, the chunked form, the convolution, the context-parallel way, gated_delta_net, the
layer. It needs torch, ring.py, ulysses.py, documents.py and tiled.py. `python -m harness.bench deltanet` times
the chunked form against the recurrence, and the two ways against each other.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from documents import document_bounds
from ring import gather_ring, token_index
from tiled import at_least_float32
from ulysses import all_to_all_bytes, head_layout, heads_to_seq, seq_to_heads, size_and_rank


@dataclass
class DeltaNetConfig:
    """Gated DeltaNet's settings (gpt.GPTConfig holds them among its own). 0: n_head heads of n_embd / n_head."""
    conv_width: int = 4  # the causal convolution over the sequence
    # key heads (q, k) and value heads (v, the state, the output), a multiple of them; Qwen3-Next: 16 and 32 of 128
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_parallel: str = "ulysses"  # under SP: "ulysses" moves the heads, "context" state summaries (beside a ring)

    def resolve_deltanet(self, n_head, head_dim):
        """Each 0 to its default, then a ValueError naming a setting that does not fit."""
        self.gdn_k_heads, self.gdn_v_heads = self.gdn_k_heads or n_head, self.gdn_v_heads or n_head
        self.gdn_k_dim, self.gdn_v_dim = self.gdn_k_dim or head_dim, self.gdn_v_dim or head_dim
        if self.gdn_v_heads % self.gdn_k_heads:
            multiples = ", ".join(str(self.gdn_k_heads * m) for m in range(1, 5))
            raise ValueError(f"gdn_v_heads={self.gdn_v_heads} is not a multiple of gdn_k_heads={self.gdn_k_heads}; "
                             f"choose gdn_v_heads in {{{multiples}, ...}}")
        if self.gdn_parallel not in ("ulysses", "context"):
            raise ValueError(f"gdn_parallel={self.gdn_parallel!r}: choose 'ulysses' or 'context'")


def gated_delta_rule(q, k, v, g, beta, starts=None):
    """The recurrence, one token at a time: the obvious reference the chunked form must equal."""
    decay = g.exp() if starts is None else g.exp().masked_fill(starts[:, :, None], 0.0)  # (B, S, H)
    M = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])  # (B, H, Dk, Dv)
    outputs = []
    for t in range(q.shape[1]):
        M = decay[:, t, :, None, None] * M
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", M, k[:, t])  # (B, H, Dv): v_t minus what M returns for k_t
        M = M + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", M, q[:, t]) * q.shape[-1] ** -0.5)  # (B, H, Dv)
    return torch.stack(outputs, dim=1)  # (B, S, H, Dv)


def chunk_gated_delta_rule(q, k, v, g, beta, starts=None, chunk_size=64, initial_state=None, output_final_state=False):
    """The same result, chunk by chunk: matrix products inside a chunk of C tokens, a loop only across chunks.
    initial_state [B, H, Dk, Dv]: the state before the first token (None: zeros). output_final_state: return
    (o, the state after the last token).

    In a chunk entered with state M0, let G_t = g_1 + ... + g_t and Dec[t, s] = exp(G_t - G_s) for s <= t in
    the same document (else 0). The corrected values U (u_t = beta_t (v_t - (exp(g_t) M_{t-1})^T k_t)) solve a
    triangular system, (I + A) U = beta V - beta exp(G) K M0 with A[t, s] = beta_t Dec[t, s] k_t.k_s for s < t, so
        U = U~ - W M0,   U~ = (I + A)^-1 beta V,   W = (I + A)^-1 beta exp(G) K       (the UT transform)
        O = (exp(G) Q M0 + (Q K^T * Dec) U) / sqrt(Dk)                    (the carried state, then the chunk)
        M_next = exp(G_C) M0 + (K * exp(G_C - G))^T U                      (the state handed on)
    A document start zeroes every decay that crosses it, exp(G) and exp(G_C - G) included.
    """
    B, S, H, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, S)  # a short sequence is one chunk of its own length
    n = -(-S // C)  # n chunks; the last is padded with tokens that change nothing

    def chunked(x):  # (B, S, H, ...) -> (B, H, n, C, ...)
        x = F.pad(x.transpose(1, 2), (0, 0) * (x.dim() - 3) + (0, n * C - S))
        return x.reshape(B, H, n, C, *x.shape[3:])

    q, k, v, g, beta = map(chunked, (q * Dk ** -0.5, k, v, g, beta))  # (B, H, n, C, Dk or Dv); g, beta (B, H, n, C)
    starts = torch.zeros(B, S, dtype=torch.bool, device=q.device) if starts is None else starts
    document = F.pad(starts, (0, n * C - S)).reshape(B, 1, n, C).cumsum(-1)  # (B, 1, n, C): 0: M0's document
    G = g.cumsum(-1)  # (B, H, n, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C, C)
    same_document = (document[..., :, None] == document[..., None, :]) & causal  # (B, 1, n, C, C)
    Dec = _masked_exp(G[..., :, None] - G[..., None, :], same_document)  # (B, H, n, C, C)
    from_start = _masked_exp(G, document == 0)  # (B, H, n, C): exp(G), M0 to token t
    to_end = _masked_exp(G[..., -1:] - G, document == document[..., -1:])  # (B, H, n, C): exp(G_C - G)
    # the UT transform, for every chunk at once: one triangular solve of [beta V | beta exp(G) K] gives U~ and W
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * Dec).tril(-1)  # (B, H, n, C, C)
    rhs = torch.cat([beta[..., None] * v, (beta * from_start)[..., None] * k], dim=-1)  # (B, H, n, C, Dv + Dk)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # (B, H, n, C, Dv + Dk)
    U_tilde, W = solved.split([Dv, Dk], -1)  # (B, H, n, C, Dv), (B, H, n, C, Dk)
    # the one sequential part: the state, carried across chunks
    M, entering, U = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(q.dtype), [], []
    k_to_end = (k * to_end[..., None]).transpose(-1, -2)  # (B, H, n, Dk, C)
    for i in range(n):
        u = U_tilde[:, :, i] - W[:, :, i] @ M  # (B, H, C, Dv)
        entering.append(M)  # M0 of chunk i
        U.append(u)
        M = from_start[:, :, i, -1, None, None] * M + k_to_end[:, :, i] @ u  # (B, H, Dk, Dv)
    entering, U = torch.stack(entering, dim=2), torch.stack(U, dim=2)  # (B, H, n, Dk, Dv), (B, H, n, C, Dv)
    o = (q * from_start[..., None]) @ entering + ((q @ k.transpose(-1, -2)) * Dec) @ U  # (B, H, n, C, Dv)
    o = o.reshape(B, H, n * C, Dv)[:, :, :S].transpose(1, 2)  # (B, S, H, Dv)
    return (o, M) if output_final_state else o


def _masked_exp(log_decay, keep):
    """exp(log_decay) where keep, else 0, masked before exp so that nothing overflows."""
    return torch.where(keep, log_decay, 0.0).exp() * keep


def causal_conv1d(x, weight, starts=None):
    """Depthwise causal convolution over the sequence, restarting at every document: x [B, S, ch], weight [ch, taps]
    -> [B, S, ch], out_t = sum_i weight[:, taps-1-i] * x_{t-i} over the tokens of t's document (ch: channels)."""
    return _causal_conv(x, weight) if starts is None else _conv_by_document(x, weight, starts)  # (B, S, ch)


@torch._disable_dynamo  # torch.compiler.disable, Dynamo imported at the first call; compiled, its loop over the data's documents would recompile for each new count
def _conv_by_document(x, weight, starts):
    (B, S, ch), bounds = x.shape, document_bounds(starts).tolist()
    stream = x.reshape(1, B * S, ch)  # the batch as one stream of documents
    documents = [_causal_conv(stream[:, s:e], weight) for s, e in zip(bounds[:-1], bounds[1:])]  # (1, length, ch) each
    return torch.cat(documents, dim=1).view(B, S, ch)  # (1, B*S, ch) -> (B, S, ch)


def _causal_conv(x, weight):
    """x [B, length, ch] -> [B, length, ch]: the convolution over those tokens, zero before the first."""
    x = F.pad(x.transpose(1, 2), (weight.shape[1] - 1, 0))  # (B, ch, taps-1 + length)
    return F.conv1d(x, weight[:, None], groups=x.shape[1]).transpose(1, 2)  # (B, ch, length) -> (B, length, ch)


# ----------------------------------------------------------------------------------------------------------------
# the context-parallel way: the state travels, not the tokens

# the bytes this process has sent for the context-parallel way, by direction
context_stats = {"forward": 0, "backward": 0}


def reset_context_stats():
    context_stats.update(forward=0, backward=0)


def _all_to_all_sum(grad, group):
    """The gradient of an all-gather: grad [P, ...], row j my gradient of rank j's piece -> the sum of every rank's row
    for my piece: a reduce-scatter, by all-to-all and sum (gloo's own is an all-reduce: 2x the bytes)."""
    P = grad.shape[0]
    send = grad.contiguous()
    received = torch.empty_like(send)  # (P, ...): row i is rank i's gradient of my piece
    dist.all_to_all_single(received, send, group=group)
    context_stats["backward"] += send.nbytes * (P - 1) // P  # row `rank` stays here
    return received.sum(0)  # (...): my piece's gradient from every rank


class _GatherThen(torch.autograd.Function):
    """fn(every rank's x), x [slots, ...] one slot per run of this rank (slots: the most runs a rank has; a spare
    slot holds zeros), gathered to [P, slots, ...] in the order (ring rank, Ulysses rank): an all-gather over the
    Ulysses group, then one over the ring. Backward: fn's gradient for every rank's x, each rank's summed back to
    it. Gather and fn are one step of autograd on purpose: a rank whose runs come first uses nothing it gathered,
    and autograd would skip the backward of a gather whose result is unused, leaving the other ranks waiting."""

    @staticmethod
    @torch._disable_dynamo  # torch.compiler.disable (Dynamo imported at the first call): torch.compile runs it eagerly: Dynamo traces neither the gathers nor their bytes
    def forward(ctx, x, context, fn):
        every = x.contiguous()
        for group in context:
            P = size_and_rank(group)[0]
            if P == 1:
                every = every[None]  # (1, ...)
                continue
            parts = [torch.empty_like(every) for _ in range(P)]
            dist.all_gather(parts, every, group=group)
            context_stats["forward"] += every.nbytes * (P - 1)  # what I hold so far, to each other rank
            every = torch.stack(parts)  # (U, slots, ...), then (R, U, slots, ...)
        ctx.context, ctx.fn = context, fn
        ctx.save_for_backward(every)
        return fn(every.flatten(0, 1))  # fn of (P, slots, ...)

    @staticmethod
    def backward(ctx, grad):
        every, = ctx.saved_tensors
        with torch.enable_grad():
            every = every.detach().requires_grad_()
            mine = ctx.fn(every.flatten(0, 1))
        # (R, U, slots, ...); zeros where my result used none of it (my runs come first)
        grad = torch.autograd.grad(mine, every, grad, materialize_grads=True)[0] if mine.requires_grad else \
            torch.zeros_like(every)
        for group in reversed(ctx.context):  # the ring's, then the Ulysses group's: (R, U, slots, ...) -> (slots, ...)
            grad = grad[0] if size_and_rank(group)[0] == 1 else _all_to_all_sum(grad, group)
        return grad, None, None


def zigzag_only(layout, ring_group):
    """ValueError on every rank unless a ring's tokens, each one's token index [B, U L] on my ring rank, are laid out
    in zigzag order: the runs are chained in that order (token_runs)."""
    every = gather_ring(layout, ring_group)  # (R, B, U L): every ring rank's, so all decide alike
    zigzag = torch.stack([token_index("zigzag", r, len(every), every.shape[2]) for r in range(len(every))])  # (R, U L)
    if not torch.equal(every, zigzag[:, None].expand_as(every).to(every.device)):
        raise ValueError("the tokens are laid out in another order than zigzag (as documents.document_layout lays them "
                         "out), which Gated DeltaNet layers do not take under a ring: their runs are chained in the "
                         "zigzag order; shard with the default layout")


def token_runs(context, L):
    """Each rank's L local tokens as runs of consecutive global positions, as shard_for_sp (zigzag: shard_for_ring)
    lays them out: for rank r*U + u of the U*R ranks (ring rank r, Ulysses rank u), [(first global position, first
    local index, length)]. Two runs where a rank's tokens span both chunks of its ring rank, unless the ring rank is
    the last (its chunks meet): with U = 3, R = 2 and L = 6, rank 1 holds [(6, 0, 3), (27, 3, 3)]. Else one run."""
    (U, _), (R, _) = (size_and_rank(group) for group in context)
    runs = []
    for r in range(R):
        block = token_index("zigzag" if R > 1 else "contiguous", r, R, U * L)  # (U*L,): ring rank r's positions
        for index in block.chunk(U):  # (L,): those of its Ulysses ranks, in order
            cuts = [0, *((index[1:] != index[:-1] + 1).nonzero().flatten() + 1).tolist(), L]
            runs.append([(index[s].item(), s, e - s) for s, e in zip(cuts[:-1], cuts[1:])])
    return runs


def chain(context, L):
    """(mine, before, slots): this rank's runs [(first global position, first local index, length)]; for each of them
    the runs that come before it in the global sequence, in order, as (rank, slot, length), slot being the run's
    place on its rank; and slots, the most runs a rank has (every rank sends that many, so that all gathers match)."""
    runs = token_runs(context, L)
    (U, u), (_, r) = (size_and_rank(group) for group in context)
    ordered = sorted((start, rank, slot, length) for rank, its in enumerate(runs)
                     for slot, (start, _, length) in enumerate(its))
    mine = runs[r * U + u]
    before = [[(rank, slot, length) for first, rank, slot, length in ordered if first < start] for start, _, _ in mine]
    return mine, before, max(map(len, runs))


def left_contexts(x, starts, context, width, links):
    """x [B, L, ch]: this rank's channels before the convolution; starts [B, L] its document starts (None: none);
    links: chain(context, L) -> for each of its runs the `width` tokens before it in the global sequence,
    [B, width, ch + 1], the last channel 1.0 where a document starts; zeros before the first token. Every rank
    sends `width` rows per run: its last tokens, after zeros if the run is shorter (the runs before it fill in)."""
    B, L, ch = x.shape
    mine, before, slots = links
    flags = x.new_zeros(B, L) if starts is None else starts.to(x.dtype)  # (B, L)
    flagged = torch.cat([x, flags[..., None]], dim=2)  # (B, L, ch + 1): the flags ride along as one more channel
    tails = [F.pad(flagged[:, i:i + l], (0, 0, width, 0))[:, l:] for _, i, l in mine]  # a run's last width rows
    tails += [torch.zeros_like(tails[0])] * (slots - len(mine))  # (B, width, ch + 1) each

    def lefts(every):  # (P, slots, B, width, ch + 1) -> (my runs, B, width, ch + 1)
        zeros = every.new_zeros(B, width, ch + 1)  # before the sequence; then each earlier run's rows, not its padding
        return torch.stack([torch.cat([zeros, *(every[rank, slot, :, width - min(width, length):]
                                                for rank, slot, length in earlier)], dim=1)[:, -width:]
                            for earlier in before])
    return _GatherThen.apply(torch.stack(tails), context, lefts)  # (my runs, B, width, ch + 1)


def context_conv1d(x, weight, starts, lefts, mine):
    """causal_conv1d over each of this rank's runs after its left context: x [B, L, ch] -> [B, L, ch]."""
    width = weight.shape[1] - 1
    out = []
    for left, (_, i, l) in zip(lefts, mine):
        run = torch.cat([left[..., :-1], x[:, i:i + l]], dim=1)  # (B, width + l, ch)
        run_starts = None if starts is None else torch.cat([left[..., -1] > 0, starts[:, i:i + l]], dim=1)
        out.append(causal_conv1d(run, weight, run_starts)[:, width:])  # (B, l, ch)
    return torch.cat(out, dim=1)  # (B, L, ch)


def context_gated_delta_rule(q, k, v, g, beta, starts, context, links):
    """chunk_gated_delta_rule over the whole sequence, when this rank holds only its runs of it (q, k, v, g, beta,
    starts as that takes them, [B, L, ...] each; context: the Ulysses and ring groups; links: chain's). One call of the
    kernel per run gives its outputs from a zero state, its summary [h_ext | T] and what a starting state adds to each
    output; the gathered summaries of the runs before it give its starting state."""
    (B, _, H, Dk), Dv = q.shape, v.shape[-1]
    mine, before, slots = links
    identity = torch.eye(Dk, dtype=q.dtype, device=q.device).expand(B, H, Dk, Dk)  # (B, H, Dk, Dk)
    zero_and_identity = torch.cat([q.new_zeros(B, H, Dk, Dv), identity], dim=-1)  # (B, H, Dk, Dv + Dk): [0 | I]
    outputs, summaries = [], []
    for _, i, l in mine:
        run = slice(i, i + l)
        o, final = chunk_gated_delta_rule(q[:, run], k[:, run], F.pad(v[:, run], (0, Dk)), g[:, run], beta[:, run],
                                          None if starts is None else starts[:, run],
                                          initial_state=zero_and_identity, output_final_state=True)
        outputs.append(o)  # (B, l, H, Dv + Dk): the outputs from state 0, then T_t^T q_t / sqrt(Dk)
        summaries.append(final)  # (B, H, Dk, Dv + Dk): [h_ext | T]
    summaries += [torch.zeros_like(summaries[0])] * (slots - len(mine))

    def fold(every):  # (P, slots, B, H, Dk, Dv + Dk) -> (my runs, B, H, Dk, Dv): the state each run starts from
        starting = []
        for earlier in before:
            state = q.new_zeros(B, H, Dk, Dv)  # (B, H, Dk, Dv), in the kernel's float32 (or wider)
            for rank, slot, _ in earlier:
                h_ext, T = every[rank, slot].split([Dv, Dk], dim=-1)  # (B, H, Dk, Dv), (B, H, Dk, Dk)
                state = T @ state + h_ext
            starting.append(state)
        return torch.stack(starting)
    states = _GatherThen.apply(torch.stack(summaries), context, fold)  # (my runs, B, H, Dk, Dv)
    out = []
    for o, state in zip(outputs, states):
        from_zero, through = o.split([Dv, Dk], dim=-1)  # (B, l, H, Dv), (B, l, H, Dk)
        out.append(from_zero + torch.einsum("blhk,bhkv->blhv", through, state))  # (B, l, H, Dv)
    return torch.cat(out, dim=1)  # (B, L, H, Dv)


def gated_delta_net(q, k, v, b, a, conv_weight, A_log, dt_bias, key_of_value=None, starts=None, context=None):
    """What a Gated DeltaNet layer computes before its output gate, for some of its heads: q and k [B, S, hk, Dk]
    and v [B, S, hv, Dv] before the convolution, b and a [B, S, hv, 1] (the inputs of beta and of the decay), the
    slices of the per-head parameters for those heads, and key_of_value, for each value head the index of its key
    head among the hk (None: hk = hv, one each) -> o [B, S, hv, Dv]. It computes in float32 (float64 stays) with
    autocast off, whatever the inputs' dtype: cumulative decays and a state carried over the whole sequence would
    drift in bf16's 8 significant bits. o comes back in the inputs' dtype, for the all-to-all or the output gate.

    context: (Ulysses group, ring group) for the context-parallel way. Then the inputs are this rank's tokens of
    the sequence (its runs, in the SP group's token order), all heads, and starts the document starts among them."""
    (B, S, hk, Dk), (hv, Dv) = q.shape, v.shape[2:]
    dtype = q.dtype
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2)  # (B, S, 2*hk*Dk + hv*Dv): the channels
    if context is not None:  # the left context of each run travels in the inputs' dtype
        links = chain(context, S)
        lefts = left_contexts(qkv, starts, context, conv_weight.shape[1] - 1, links)  # (my runs, B, taps-1, ch + 1)
    with torch.autocast(q.device.type, enabled=False):
        qkv, b, a, conv_weight, A_log, dt_bias = map(at_least_float32, (qkv, b, a, conv_weight, A_log, dt_bias))
        if context is None:
            channels = F.silu(causal_conv1d(qkv, conv_weight, starts))  # (B, S, 2*hk*Dk + hv*Dv)
        else:
            channels = F.silu(context_conv1d(qkv, conv_weight, starts, at_least_float32(lefts), links[0]))  # the same
        q, k, v = channels.split([hk * Dk, hk * Dk, hv * Dv], dim=2)  # (B, S, hk*Dk) twice, (B, S, hv*Dv)
        q, k = (F.normalize(t.view(B, S, hk, Dk), dim=-1) for t in (q, k))  # (B, S, hk, Dk)
        if key_of_value is not None:  # each value head gets its key head's q and k
            q, k = q[:, :, key_of_value], k[:, :, key_of_value]  # (B, S, hk, Dk) -> (B, S, hv, Dk)
        beta = b.squeeze(-1).sigmoid()  # (B, S, hv)
        g = -A_log.exp() * F.softplus(a.squeeze(-1) + dt_bias)  # (B, S, hv): the log of the decay, <= 0
        if context is None:
            o = chunk_gated_delta_rule(q, k, v.view(B, S, hv, Dv), g, beta, starts)  # (B, S, hv, Dv)
        else:
            o = context_gated_delta_rule(q, k, v.view(B, S, hv, Dv), g, beta, starts, context, links)  # the same
    return o.to(dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule, in place of softmax attention. Called as gpt.py calls its
    attention, layer(x, cos, sin, attend), with `attend` gated_delta_net and this forward's document starts. It
    uses no RoPE (cos and sin go unused): the recurrence knows the order of the tokens."""

    def __init__(self, cfg, sp_group, ring_group=None):
        super().__init__()
        Hk, Hv, Dk, Dv = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
        self.dims, self.sp_group, self.ring_group = (Hk, Hv, Dk, Dv), sp_group, ring_group
        self.parallel = cfg.gdn_parallel  # "ulysses" or "context"
        # q, k (Hk*Dk each), v, z (Hv*Dv each), b, a (Hv each)
        self.in_proj = nn.Linear(cfg.n_embd, 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv, bias=False)
        taps = cfg.conv_width  # the causal convolution's weights per channel
        self.conv_qk = nn.Parameter(torch.empty(2, Hk, Dk, taps).uniform_(-1, 1) / taps ** 0.5)  # q's and k's channels
        self.conv_v = nn.Parameter(torch.empty(Hv, Dv, taps).uniform_(-1, 1) / taps ** 0.5)  # v's
        self.A_log = nn.Parameter(torch.empty(Hv).uniform_(1, 16).log())  # decay rates, as in Mamba2
        dt = torch.empty(Hv).uniform_(math.log(1e-3), math.log(0.1)).exp()  # (Hv,)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.norm = GatedRMSNorm(Dv, eps=1e-6)
        self.proj = nn.Linear(Hv * Dv, cfg.n_embd, bias=False)

    def heads(self):
        """(value heads, key heads) of each rank between the all-to-alls: head_layout with value heads in the role
        of query heads, since value head h uses key head h // (Hv / Hk)."""
        Hk, Hv, _, _ = self.dims
        return head_layout(Hv, Hk, size_and_rank(self.sp_group)[0])

    def forward(self, x, cos, sin, attend):
        B, S_local, _ = x.shape
        Hk, Hv, Dk, Dv = self.dims
        # (B, S_local, h) -> q, k (B, S_local, Hk*Dk), v, z (B, S_local, Hv*Dv), b, a (B, S_local, Hv)
        q, k, v, z, b, a = self.in_proj(x).split([Hk * Dk, Hk * Dk, Hv * Dv, Hv * Dv, Hv, Hv], dim=-1)
        q, k = (t.view(B, S_local, Hk, Dk) for t in (q, k))  # (B, S_local, Hk, Dk)
        v, z = (t.view(B, S_local, Hv, Dv) for t in (v, z))  # (B, S_local, Hv, Dv)
        b, a = b[..., None], a[..., None]  # (B, S_local, Hv, 1)
        if self.parallel == "context":  # every head of my tokens stays here; the state's summaries travel
            mine_v, mine_k, context = range(Hv), range(Hk), (self.sp_group, self.ring_group)
        else:  # my value heads of the whole sequence come here
            value_heads, key_heads = self.heads()
            rank = size_and_rank(self.sp_group)[1]
            mine_v, mine_k, context = value_heads[rank], key_heads[rank], None
            qk = seq_to_heads(torch.cat([q, k], dim=-1), self.sp_group, key_heads)  # (B, S, hk, 2 Dk)
            vba = seq_to_heads(torch.cat([v, b, a], dim=-1), self.sp_group, value_heads)  # (B, S, hv, Dv + 2)
            (q, k), (v, b, a) = qk.split(Dk, dim=-1), vba.split([Dv, 1, 1], dim=-1)  # (B, S, h, *) each
        key_of_value = [h // (Hv // Hk) - mine_k.start for h in mine_v] if Hk < Hv else None
        conv = torch.cat([self.conv_qk[:, mine_k.start:mine_k.stop].flatten(0, 2),
                          self.conv_v[mine_v.start:mine_v.stop].flatten(0, 1)])  # (2*hk*Dk + hv*Dv, taps): my channels
        o = attend(q, k, v, b, a, conv, self.A_log[mine_v.start:mine_v.stop], self.dt_bias[mine_v.start:mine_v.stop],
                   key_of_value, context=context)  # (B, S, hv, Dv); with context (B, S_local, Hv, Dv)
        if context is None:
            o = heads_to_seq(o, self.sp_group, value_heads)  # (B, S_local, Hv, Dv)
        return self.proj(self.norm(o, z).flatten(2))  # (B, S_local, h); the gate z is per token: it never left

    def all_to_all_bytes(self, tokens, element_bytes):
        """(forward, backward) bytes this rank sends per call of `tokens` local tokens (B x S/P): q and k (Dk each) to
        the other ranks' key heads, v (Dv), b and a (one each) to their value heads, and the output (Dv) back; backward
        the reverse. The context-parallel way sends none (context_bytes counts what it sends)."""
        if self.parallel == "context":
            return 0, 0
        _, _, Dk, Dv = self.dims
        value_heads, key_heads = self.heads()
        rank = size_and_rank(self.sp_group)[1]
        (k_there, k_back), (v_there, v_back), (o_there, o_back) = (
            all_to_all_bytes(heads, rank, tokens * width * element_bytes)
            for heads, width in ((key_heads, 2 * Dk), (value_heads, Dv + 2), (value_heads, Dv)))
        return k_there + v_there + o_back, o_there + k_back + v_back

    def context_bytes(self, batch, tokens, element_bytes):
        """(forward, backward) bytes this rank sends per call on the context-parallel way, `tokens` local tokens in
        each of `batch` rows: per run slot (the most runs a rank has: 1 or 2) and row, P-1 pieces over the two gathers,
        the summary [h_ext | T], [Dk, Dv + Dk] a value head in float32 (or wider), and the last conv_width-1 tokens
        before the convolution (2*Hk*Dk + Hv*Dv channels, a start flag) in the inputs' dtype. Backward the same."""
        Hk, Hv, Dk, Dv = self.dims
        if self.parallel != "context":
            return 0, 0
        context = (self.sp_group, self.ring_group)
        P = size_and_rank(self.sp_group)[0] * size_and_rank(self.ring_group)[0]
        slots, width = chain(context, tokens)[2], self.conv_v.shape[-1] - 1
        run = Hv * Dk * (Dv + Dk) * max(4, element_bytes) + width * (2 * Hk * Dk + Hv * Dv + 1) * element_bytes
        sent = (P - 1) * slots * batch * run
        return sent, sent


class GatedRMSNorm(nn.RMSNorm):
    """The layer's output gate, RMSNorm(o) * silu(z) over each value head's Dv: nn.RMSNorm's weight and name, its
    statistics in at least float32 (o and the weight may be bf16), the normalised o in o's dtype."""

    def forward(self, o, z):
        normed = F.rms_norm(at_least_float32(o), o.shape[-1:], at_least_float32(self.weight), self.eps)
        return normed.to(o.dtype) * F.silu(z)  # (B, S_local, Hv, Dv)
