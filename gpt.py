"""
A small decoder-only transformer (nanoGPT-style, with RoPE, RMSNorm and grouped-query attention) that trains
under Ulysses sequence parallelism, with softmax attention or Gated DeltaNet (linear attention) in each layer.

The model sees only its rank's S/P tokens. Everything except attention is per-token, so it runs on the local
tokens unchanged; attention goes through ulysses.py, the one place where tokens of different ranks meet. The
model knows nothing else about SP: it gets the SP group to pass to the all-to-alls, and the GLOBAL position of
each token (RoPE must rotate token i by i, not by its index inside the shard).

A layer is softmax attention or, in hybrid models (Qwen3-Next: three Gated DeltaNet layers to one softmax layer),
Gated DeltaNet, a linear attention with a recurrent state: the file reads config, RoPE, attention, MLP, block,
GPT, and then Gated DeltaNet in a section of its own.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ring import ring_attention, ring_bytes
from tiled import at_least_float32, tiled_lm_loss, tiled_mlp
from ulysses import (all_to_all_bytes, causal_attention, check_shards, document_attention, document_bounds,
                     gather_sequence, head_layout, heads_to_seq, kernel_kv_heads, sliding_window_attention,
                     seq_to_heads, size_and_rank, ulysses_attention)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 4  # < n_head: grouped-query attention; 1: multi-query attention
    n_embd: int = 128
    window: int = 0  # > 0: sliding-window attention over the last `window` tokens; 0: full causal attention
    rope_base: float = 10000.0
    layer_pattern: str = "a"  # layer i is layer_pattern[i % len]: a = softmax attention, d = Gated DeltaNet
    conv_width: int = 4  # Gated DeltaNet's causal convolution over the sequence
    # Gated DeltaNet's heads: key heads (q and k), value heads (v, the state, the output; a multiple of the key
    # heads, each key head serving n_v / n_k of them), and their dims. 0: n_head heads of n_embd / n_head.
    # Qwen3-Next: 16 key heads and 32 value heads, both of dim 128.
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    # How to compute, not what: these change memory and time, never the result.
    tiles: int = 1  # > 1: MLP and loss run over this many sequence tiles (tiled.py), never the full activation
    recompute: bool = False  # keep only each block's input; recompute the block in backward
    offload: bool = False  # with recompute, on CUDA: keep those block inputs in CPU memory until backward

    def __post_init__(self):
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size")
        if self.n_head % self.n_kv_head:
            divisors = ", ".join(str(k) for k in range(1, self.n_head + 1) if self.n_head % k == 0)
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}; "
                             f"choose n_kv_head in {{{divisors}}}")
        head_dim = self.n_embd // self.n_head
        self.gdn_k_heads, self.gdn_v_heads = self.gdn_k_heads or self.n_head, self.gdn_v_heads or self.n_head
        self.gdn_k_dim, self.gdn_v_dim = self.gdn_k_dim or head_dim, self.gdn_v_dim or head_dim
        if self.gdn_v_heads % self.gdn_k_heads:
            multiples = ", ".join(str(self.gdn_k_heads * m) for m in range(1, 5))
            raise ValueError(f"gdn_v_heads={self.gdn_v_heads} is not a multiple of gdn_k_heads={self.gdn_k_heads}; "
                             f"choose gdn_v_heads in {{{multiples}, ...}}")
        if not self.layer_pattern or set(self.layer_pattern) - set("ad"):
            raise ValueError(f"layer_pattern={self.layer_pattern!r}: use the letters a (softmax attention) and "
                             f"d (Gated DeltaNet), e.g. 'ddda'")


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


class Attention(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.sp_group = sp_group

    def forward(self, x, cos, sin, attend):
        B, S_local, _ = x.shape
        qkv = self.qkv(x).view(B, S_local, -1, self.head_dim)  # (B, S_local, n_head + 2*n_kv_head, D)
        q, k, v = qkv.split([self.n_head, self.n_kv_head, self.n_kv_head], 2)  # (B, S_local, heads, D) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # rotated by their global positions
        y = ulysses_attention(q, k, v, self.sp_group, attend)  # (B, S_local, n_head, D)
        return self.proj(y.reshape(B, S_local, -1))  # (B, S_local, h)

    def all_to_all_bytes(self, tokens, element_bytes):
        """(forward, backward) bytes this rank sends per call on `tokens` local tokens: q, k and v to the other
        ranks' heads and the output back; backward the reverse. ulysses.all_to_all_bytes counts each."""
        P, rank = size_and_rank(self.sp_group)
        query_heads, kv_heads = head_layout(self.n_head, self.n_kv_head, P)
        per_head = tokens * self.head_dim * element_bytes
        (q_there, q_back), (kv_there, kv_back) = (all_to_all_bytes(h, rank, per_head) for h in (query_heads, kv_heads))
        return q_there + 2 * kv_there + q_back, q_there + q_back + 2 * kv_back

    def ring_bytes(self, tokens, element_bytes, R):
        """(forward, backward) bytes this rank sends around a ring of R per call (ring.ring_bytes): the key/value
        block of the kv heads its kernel gets, for all U * tokens tokens of its Ulysses group."""
        U, rank = size_and_rank(self.sp_group)
        kv = len(kernel_kv_heads(self.n_head, self.n_kv_head, U, rank))
        block = 2 * tokens * U * kv * self.head_dim  # k and v, elements
        return ring_bytes(R, block * element_bytes, block * max(4, element_bytes))


def mlp(x, fc_weight, proj_weight):
    return F.linear(F.gelu(F.linear(x, fc_weight)), proj_weight)  # (B, s, h) -> (B, s, 4h) -> (B, s, h)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.tiles = cfg.tiles

    def forward(self, x):
        weights = (self.fc.weight, self.proj.weight)
        return tiled_mlp(mlp, x, weights, self.tiles) if self.tiles > 1 else mlp(x, *weights)


def rms_norm(x, weight, eps=None):
    """RMSNorm over the last dim, its statistics in at least float32 whatever the dtypes of x and of the weight
    (bf16 when ZeRO-3 or FSDP2 gathers it so); the result in x's dtype."""
    return F.rms_norm(at_least_float32(x), x.shape[-1:], at_least_float32(weight), eps).to(x.dtype)


class RMSNorm(nn.RMSNorm):  # nn.RMSNorm's weight and name, rms_norm's arithmetic
    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg, sp_group, kind):
        super().__init__()
        self.kind = kind  # "a" or "d"
        self.norm1 = RMSNorm(cfg.n_embd)
        self.attn = Attention(cfg, sp_group) if kind == "a" else GatedDeltaNet(cfg, sp_group)
        self.norm2, self.mlp = RMSNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x, cos, sin, attend):
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm and language-model head. With labels, returns (sum of token losses, correct predictions)
    over the valid (label != -100) tokens, never a mean: the caller divides by the global valid-token count."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tiles = cfg.tiles

    def logits(self, x, norm_weight, lm_head_weight):
        # bf16 under autocast, widened to float32 for the loss and its logsumexp
        return at_least_float32(F.linear(rms_norm(x, norm_weight, self.norm.eps), lm_head_weight))

    def forward(self, x, labels=None):
        weights = (self.norm.weight, self.lm_head.weight)
        if labels is None:
            return self.logits(x, *weights)  # (B, S_local, vocab)
        if self.tiles > 1:  # never holds more than one tile's logits
            return tiled_lm_loss(self.logits, x, labels, weights, self.tiles)
        logits = self.logits(x, *weights)  # (B, S_local, vocab)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        correct = (logits.argmax(-1) == labels).sum()  # a label of -100 never matches
        return loss_sum, correct


class GPT(nn.Module):
    """sp_group: the Ulysses group whose all-to-alls carry attention; ring_group (Ulysses x Ring): the ring over
    which softmax attention then runs (ring.py). None: no such group."""

    def __init__(self, cfg, sp_group=None, ring_group=None):
        super().__init__()
        self.ring_group = ring_group if size_and_rank(ring_group)[0] > 1 else None
        if self.ring_group and "d" in cfg.layer_pattern:
            raise ValueError("Gated DeltaNet layers carry a state through the tokens in order, which a ring does not "
                             "see; use layer_pattern 'a' with a ring, or no ring")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, sp_group, cfg.layer_pattern[i % len(cfg.layer_pattern)])
                                    for i in range(cfg.n_layer))
        self.sp_group = sp_group
        self.head = Head(cfg)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # the output projections into the residual stream scaled down with depth, as in GPT-2
                std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name.endswith(".proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def units(self):
        """The pieces that ZeRO-3 gathers one at a time, in forward order."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx, position_ids, labels=None, packed=False):
        """idx, position_ids, labels: [B, S_local], this rank's tokens. position_ids are positions in the full
        sequence, or, with packed=True, in each document (0 where a document starts, and only there)."""
        for group in (self.sp_group, self.ring_group):  # one tiny collective each, before a mismatch could hang
            check_shards(idx, group)
        if packed and self.ring_group:
            raise ValueError("packed documents are not supported with a ring: use one document a row")
        window = self.cfg.window
        # the kernels run on the full sequence, so with packing they need the document starts of the full sequence
        full_positions = gather_sequence(position_ids, self.sp_group) if packed else None
        attend = {"a": partial(document_attention, position_ids=full_positions, window=window) if packed else
                  partial(ring_attention, group=self.ring_group, window=window or None) if self.ring_group else
                  partial(sliding_window_attention, window=window) if window else causal_attention,
                  "d": partial(gated_delta_net, starts=full_positions == 0 if packed else None)}
        x = at_least_float32(self.embed(idx))  # (B, S_local, h); the residual stream stays float32 under bf16
        cos, sin = rope_cos_sin(position_ids, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_base)
        offload = self.cfg.offload and x.is_cuda  # ALST's trick: block inputs wait for backward in CPU memory
        for block in self.blocks:
            if self.cfg.recompute:
                with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else nullcontext():
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, attend[block.kind], use_reentrant=False)
            else:
                x = block(x, cos, sin, attend[block.kind])
        return self.head(x, labels)


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet, the linear-attention layer of hybrid models.
#
# Gated DeltaNet is not softmax attention, and Ulysses carries it all the same: everything that needs the whole
# sequence runs between its two all-to-alls, on this rank's heads, and everything per token stays outside.
#
#     local tokens, all heads          all tokens, my heads                    local tokens, all heads
#     x -> q, k, v, z, b, a  --a2a-->  q, k, v, b, a:                 --a2a--> o -> RMSNorm(o) * silu(z) -> out
#          (z stays here)              conv over the sequence (my heads'
#                                      channels of its weight), silu, L2
#                                      norm of q and k, gates from b and a
#                                      (my heads' A_log and dt_bias), the
#                                      gated delta rule -> o
#
# Per batch row and value head, a state M_t [Dk, Dv] (M_0 = 0) is decayed and corrected token by token:
#     M_t = exp(g_t) (I - beta_t k_t k_t^T) M_{t-1} + beta_t k_t v_t^T,      o_t = M_t^T q_t / sqrt(Dk)
# g_t <= 0 (the log of the decay) and beta_t in (0, 1) are per token and head; q and k are L2-normalised. A
# document start resets the state: exp(g_t) = 0 there. Like grouped-query attention in reverse, there may be fewer
# key heads (q, k) than value heads (v, b, a, the state): key head j serves value heads j*G .. j*G + G-1. The
# kernels take the softmax kernels' layout, q and k [B, S, H, Dk] and v [B, S, H, Dv] with one head per value head
# (gated_delta_net repeats q and k for them), and `starts`, a bool [B, S] marking where documents start (None: one
# document per row).
# `python bench.py deltanet` times the chunked form against the recurrence.


def gated_delta_rule(q, k, v, g, beta, starts=None):
    """The recurrence, one token at a time: the obvious reference the chunked form must equal."""
    decay = g.exp() if starts is None else g.exp().masked_fill(starts[:, :, None], 0.0)  # (B, S, H)
    M = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])  # (B, H, Dk, Dv)
    outputs = []
    for t in range(q.shape[1]):
        M = decay[:, t, :, None, None] * M
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", M, k[:, t])  # (B, H, Dv): what M predicts for k, wrongly
        M = M + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", M, q[:, t]) * q.shape[-1] ** -0.5)
    return torch.stack(outputs, dim=1)  # (B, S, H, Dv)


def _masked_exp(log_decay, keep):
    """exp(log_decay) where keep, else 0, masked before exp so that nothing overflows."""
    return torch.where(keep, log_decay, 0.0).exp() * keep


def chunk_gated_delta_rule(q, k, v, g, beta, starts=None, chunk_size=64):
    """The same result, chunk by chunk: matrix products inside a chunk of C tokens, a loop only across chunks.

    In a chunk entered with state M0, let G_t = g_1 + ... + g_t and Dec[t, s] = exp(G_t - G_s) for s <= t in
    the same document (else 0). The corrected values U (u_t = beta_t (v_t - M_{t-1}^T k_t)) solve a triangular
    system, (I + A) U = beta V - beta exp(G) K M0 with A[t, s] = beta_t Dec[t, s] k_t.k_s for s < t, so
        U = U~ - W M0,   U~ = (I + A)^-1 beta V,   W = (I + A)^-1 beta exp(G) K       (the UT transform)
        O = (exp(G) Q M0 + (Q K^T * Dec) U) / sqrt(Dk)                    (the carried state, then the chunk)
        M_next = exp(G_C) M0 + (K * exp(G_C - G))^T U                      (the state handed on)
    A document start zeroes every decay that crosses it, exp(G) and exp(G_C - G) included.
    """
    B, S, H, Dk = q.shape
    Dv = v.shape[-1]
    C, n = chunk_size, -(-S // chunk_size)  # n chunks; the last is padded with tokens that change nothing

    def chunked(x):  # (B, S, H, ...) -> (B, H, n, C, ...)
        x = F.pad(x.transpose(1, 2), (0, 0) * (x.dim() - 3) + (0, n * C - S))
        return x.reshape(B, H, n, C, *x.shape[3:])

    q, k, v, g, beta = map(chunked, (q * Dk ** -0.5, k, v, g, beta))  # (B, H, n, C, Dk or Dv); g, beta (B, H, n, C)
    starts = torch.zeros(B, S, dtype=torch.bool, device=q.device) if starts is None else starts
    document = F.pad(starts, (0, n * C - S)).reshape(B, 1, n, C).cumsum(-1)  # (B, 1, n, C): 0 = the one entered
    G = g.cumsum(-1)  # (B, H, n, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    same_document = (document[..., :, None] == document[..., None, :]) & causal  # (B, 1, n, C, C)
    Dec = _masked_exp(G[..., :, None] - G[..., None, :], same_document)  # (B, H, n, C, C)
    from_start = _masked_exp(G, document == 0)  # (B, H, n, C): decay from M0 to token t
    to_end = _masked_exp(G[..., -1:] - G, document == document[..., -1:])  # (B, H, n, C): token t to chunk end
    # the UT transform, for every chunk at once: one triangular solve gives U~ and W
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * Dec).tril(-1)  # (B, H, n, C, C)
    right = torch.cat([beta[..., None] * v, (beta * from_start)[..., None] * k], dim=-1)  # (B, H, n, C, Dv + Dk)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    U_tilde, W = torch.linalg.solve_triangular(eye + A, right, upper=False, unitriangular=True).split([Dv, Dk], -1)
    # the one sequential part: the state, carried across chunks
    M, states, values = q.new_zeros(B, H, Dk, Dv), [], []
    k_to_end = (k * to_end[..., None]).transpose(-1, -2)  # (B, H, n, Dk, C)
    for i in range(n):
        u = U_tilde[:, :, i] - W[:, :, i] @ M  # (B, H, C, Dv)
        states.append(M)
        values.append(u)
        M = from_start[:, :, i, -1, None, None] * M + k_to_end[:, :, i] @ u  # (B, H, Dk, Dv)
    states, U = torch.stack(states, dim=2), torch.stack(values, dim=2)  # (B, H, n, Dk, Dv), (B, H, n, C, Dv)
    o = (q * from_start[..., None]) @ states + ((q @ k.transpose(-1, -2)) * Dec) @ U  # (B, H, n, C, Dv)
    return o.reshape(B, H, n * C, Dv)[:, :, :S].transpose(1, 2)  # (B, S, H, Dv)


def causal_conv1d(x, weight, starts=None):
    """Depthwise causal convolution over the sequence, restarting at every document: x [B, S, channels], weight
    [channels, W] -> [B, S, channels], out_t = sum_i weight[:, W-1-i] * x_{t-i} over the tokens of t's document."""
    B, S, C = x.shape
    if starts is None:
        return _causal_conv(x, weight)  # (B, S, C)
    bounds = document_bounds(starts).tolist()
    stream = x.reshape(1, B * S, C)  # the batch as one stream of documents
    documents = [_causal_conv(stream[:, s:e], weight) for s, e in zip(bounds[:-1], bounds[1:])]  # (1, n, C) each
    return torch.cat(documents, dim=1).view(B, S, C)


def _causal_conv(x, weight):
    """x [B, n, C] -> [B, n, C]: the convolution over n tokens, zero before the first."""
    x = F.pad(x.transpose(1, 2), (weight.shape[1] - 1, 0))  # (B, C, W-1 + n)
    return F.conv1d(x, weight[:, None], groups=x.shape[1]).transpose(1, 2)  # (B, C, n) -> (B, n, C)


def gated_delta_net(q, k, v, b, a, conv_weight, A_log, dt_bias, key_of_value=None, starts=None):
    """What a Gated DeltaNet layer computes over the full sequence, for some of its heads: q and k [B, S, hk, Dk]
    and v [B, S, hv, Dv] before the convolution, b and a [B, S, hv, 1] (the inputs of beta and of the decay), the
    slices of the per-head parameters for those heads, and key_of_value, for each value head the index of its key
    head among the hk (None: hk = hv, one each) -> o [B, S, hv, Dv]. It computes in float32 with autocast off,
    whatever the dtype of its inputs: cumulative decays and a state carried over the whole sequence would drift in
    bf16's 8 significant bits. o comes back in the inputs' dtype, for the all-to-all."""
    B, S, hk, Dk = q.shape
    hv, Dv = v.shape[2:]
    dtype = q.dtype
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, b, a, conv_weight, A_log, dt_bias = map(at_least_float32, (q, k, v, b, a, conv_weight, A_log, dt_bias))
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2)  # (B, S, 2*hk*Dk + hv*Dv): the channels
        q, k, v = F.silu(causal_conv1d(qkv, conv_weight, starts)).split([hk * Dk, hk * Dk, hv * Dv], dim=2)
        q, k = (F.normalize(t.view(B, S, hk, Dk), dim=-1) for t in (q, k))  # (B, S, hk, Dk)
        if key_of_value is not None:  # each value head gets its key head's q and k
            q, k = q[:, :, key_of_value], k[:, :, key_of_value]  # (B, S, hk, Dk) -> (B, S, hv, Dk)
        beta = b.squeeze(-1).sigmoid()  # (B, S, hv)
        g = -A_log.exp() * F.softplus(a.squeeze(-1) + dt_bias)  # (B, S, hv): the log of the decay, <= 0
        o = chunk_gated_delta_rule(q, k, v.view(B, S, hv, Dv), g, beta, starts)  # (B, S, hv, Dv)
    return o.to(dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule, in place of softmax attention. Called like Attention;
    `attend` is gated_delta_net with this forward's document starts. It uses no RoPE: the recurrence knows
    the order of the tokens."""

    def __init__(self, cfg, sp_group):
        super().__init__()
        Hk, Hv, Dk, Dv = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
        self.dims, self.sp_group = (Hk, Hv, Dk, Dv), sp_group
        # q, k (Hk*Dk each), v, z (Hv*Dv each), b, a (Hv each)
        self.in_proj = nn.Linear(cfg.n_embd, 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv, bias=False)
        W = cfg.conv_width
        self.conv_qk = nn.Parameter(torch.empty(2, Hk, Dk, W).uniform_(-1, 1) / W ** 0.5)  # q's and k's channels
        self.conv_v = nn.Parameter(torch.empty(Hv, Dv, W).uniform_(-1, 1) / W ** 0.5)  # v's
        self.A_log = nn.Parameter(torch.empty(Hv).uniform_(1, 16).log())  # decay rates, as in Mamba2
        dt = torch.empty(Hv).uniform_(math.log(1e-3), math.log(0.1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.norm = RMSNorm(Dv, eps=1e-6)
        self.proj = nn.Linear(Hv * Dv, cfg.n_embd, bias=False)

    def heads(self):
        """(value heads, key heads) of each rank between the all-to-alls: head_layout with value heads in the role
        of query heads, since value head h uses key head h // (Hv / Hk)."""
        Hk, Hv, _, _ = self.dims
        return head_layout(Hv, Hk, size_and_rank(self.sp_group)[0])

    def forward(self, x, cos, sin, attend):
        B, S_local, _ = x.shape
        Hk, Hv, Dk, Dv = self.dims
        q, k, v, z, b, a = self.in_proj(x).split([Hk * Dk, Hk * Dk, Hv * Dv, Hv * Dv, Hv, Hv], dim=-1)
        q, k = (t.view(B, S_local, Hk, Dk) for t in (q, k))  # (B, S_local, Hk, Dk)
        v, z = (t.view(B, S_local, Hv, Dv) for t in (v, z))  # (B, S_local, Hv, Dv)
        value_heads, key_heads = self.heads()
        rank = size_and_rank(self.sp_group)[1]
        mine_v, mine_k = value_heads[rank], key_heads[rank]
        q, k, v, b, a = seq_to_heads((q, k, v, b[..., None], a[..., None]), self.sp_group,
                                     (key_heads, key_heads, value_heads, value_heads, value_heads))  # (B, S, h, *)
        key_of_value = [h // (Hv // Hk) - mine_k.start for h in mine_v] if Hk < Hv else None
        conv = torch.cat([self.conv_qk[:, mine_k.start:mine_k.stop].flatten(0, 2),
                          self.conv_v[mine_v.start:mine_v.stop].flatten(0, 1)])  # (2*hk*Dk + hv*Dv, W): my channels
        o = attend(q, k, v, b, a, conv, self.A_log[mine_v.start:mine_v.stop], self.dt_bias[mine_v.start:mine_v.stop],
                   key_of_value)  # (B, S, hv, Dv)
        o = heads_to_seq(o, self.sp_group, value_heads)  # (B, S_local, Hv, Dv)
        return self.proj((self.norm(o) * F.silu(z)).flatten(2))  # the gate z is per token: it never left

    def all_to_all_bytes(self, tokens, element_bytes):
        """(forward, backward) bytes this rank sends per call: q and k (Dk each) to the other ranks' key heads, v
        (Dv), b and a (one each) to their value heads, and the output (Dv) back; backward the reverse."""
        _, _, Dk, Dv = self.dims
        value_heads, key_heads = self.heads()
        rank = size_and_rank(self.sp_group)[1]
        (k_there, k_back), (v_there, v_back), (o_there, o_back) = (
            all_to_all_bytes(heads, rank, tokens * width * element_bytes)
            for heads, width in ((key_heads, 2 * Dk), (value_heads, Dv + 2), (value_heads, Dv)))
        return k_there + v_there + o_back, o_there + k_back + v_back
