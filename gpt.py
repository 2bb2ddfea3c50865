"""
A small decoder-only transformer (nanoGPT-style, with RoPE, RMSNorm and grouped-query attention) that trains
under Ulysses sequence parallelism, with softmax attention or Gated DeltaNet (linear attention) in each layer.

The model sees only its rank's S/P tokens. All but the token mixing is per token and runs on them unchanged; tokens
of different ranks meet only inside a layer's attention: Ulysses' all-to-alls (ulysses.py), a ring (ring.py), or
Gated DeltaNet's passed state and convolution context (deltanet.py). RoPE turns each token by its position id.

A layer is softmax attention or, in hybrid models (Qwen3-Next: three Gated DeltaNet layers to one softmax layer),
Gated DeltaNet, a linear attention with a recurrent state (deltanet.py). The MLP is GPT-2's (GELU) or Llama's
(SwiGLU); `PRESETS` names real shapes. The file reads config, RoPE, attention, MLP, norm, block, head, kernels, GPT.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from deltanet import DeltaNetConfig, GatedDeltaNet, gated_delta_net, zigzag_only
from documents import document_attention, gather_sequence
from ring import check_layout, ring_attention
from tiled import at_least_float32, kept_on, tiled_lm_loss, tiled_mlp
from ulysses import (causal_attention, check_shards, head_layout, size_and_rank, sliding_window_attention,
                     ulysses_attention)


@dataclass
class GPTConfig(DeltaNetConfig):  # Gated DeltaNet's settings, from deltanet.py, come first
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 4  # < n_head: grouped-query attention; 1: multi-query attention
    n_embd: int = 128
    window: int = 0  # > 0: sliding-window attention over the last `window` tokens; 0: full causal attention
    sinks: bool = False  # attention sinks (gpt-oss): a learned logit per query head joins each query's softmax
    rope_base: float = 10000.0  # RoPE's theta (Llama-3: 500,000)
    mlp: str = "gelu"  # "gelu": proj(gelu(fc x)), GPT-2's; "swiglu": proj(silu(gate x) * up x), Llama's
    intermediate_size: int = 0  # the MLP's hidden size; 0: 4 x n_embd
    layer_pattern: str = "a"  # layer i is layer_pattern[i % len]: a = softmax attention, d = Gated DeltaNet
    # How to compute, not what: these change memory and time, never the result (beyond rounding).
    tiles: int = 1  # > 1: the MLP (and the loss, unless loss_tiles) runs over this many sequence tiles (tiled.py)
    loss_tiles: int = 0  # the loss's own tile count (a token's logits are vocab wide, the MLP's I); 0: tiles
    recompute: bool = False  # keep only each block's input; recompute the block in backward
    offload: bool = False  # with recompute, on a GPU: keep those block inputs (x, cos, sin) on the host till backward

    def __post_init__(self):
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            heads = ", ".join(str(n) for n in range(1, self.n_embd // 2 + 1) if self.n_embd % (2 * n) == 0)
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size; " +
                             (f"choose n_head in {{{heads}}}" if heads else "no n_head does for an odd n_embd"))
        head_layout(self.n_head, self.n_kv_head, 1)  # a ValueError unless n_kv_head divides n_head
        self.resolve_deltanet(self.n_head, self.n_embd // self.n_head)
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        self.loss_tiles = self.loss_tiles or self.tiles
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp={self.mlp!r}: choose 'gelu' or 'swiglu'")
        if not self.layer_pattern or set(self.layer_pattern) - set("ad"):
            raise ValueError(f"layer_pattern={self.layer_pattern!r}: use the letters a (softmax attention) and "
                             f"d (Gated DeltaNet), e.g. 'ddda'")
        if len(self.layer_pattern) > self.n_layer:  # letters past n_layer would build no layer
            raise ValueError(f"layer_pattern={self.layer_pattern!r} has more letters than n_layer={self.n_layer}; "
                             f"choose n_layer >= {len(self.layer_pattern)}, or a pattern no longer than {self.n_layer}")


# Real models' shapes, by name (train.py --model NAME; flags beside it change them). Llama-3-8B: 32 layers of 4,096,
# 32 query and 8 kv heads of 128, a SwiGLU MLP of 14,336, its own embedding and head over 128,256 tokens: 8.03B.
PRESETS = {"llama3-8b": dict(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, vocab_size=128256, mlp="swiglu",
                             intermediate_size=14336, rope_base=500000.0)}


def rope_cos_sin(position_ids, head_dim, base):  # position ids [B, S] -> cos, sin [B, S, 1, head_dim], float32
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float64) / head_dim)
    angles = position_ids.double()[..., None] * inv_freq  # (B, S, D/2); float32 would merge positions past 2^24
    halves = angles.cos().float(), angles.sin().float()  # (B, S, D/2) each
    return tuple(torch.cat([t, t], dim=-1)[:, :, None, :] for t in halves)  # (B, S, 1, D) each


def apply_rope(x, cos, sin):  # x [B, S, H, D]: each pair (x_i, x_{i+D/2}) turned by position times the pair's frequency
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        # a score with no value in every query's softmax, one per head (ring.py says how it stays exact under SP)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_head)) if cfg.sinks else None
        self.sp_group = sp_group

    def forward(self, x, cos, sin, attend):
        B, S_local, _ = x.shape  # S_local = S/P: this rank's tokens
        qkv = self.qkv(x).view(B, S_local, -1, self.head_dim)  # (B, S/P, n_head + 2 n_kv_head, D)
        q, k, v = qkv.split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)  # (B, S/P, heads, D) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # rotated by their position ids
        # GPT.forward checks the shards' [B, S/P] once; heads and dtype agree on every rank by construction
        y = ulysses_attention(q, k, v, self.sp_group, attend, check=False, sinks=self.sinks)  # (B, S/P, n_head, D)
        return self.proj(y.flatten(2))  # (B, S/P, n_embd)


def gelu_mlp(x, fc_weight, proj_weight):  # s: the tokens (a tile's under tiled.py); I: the hidden size
    return F.linear(F.gelu(F.linear(x, fc_weight)), proj_weight)  # (B, s, h) -> (B, s, I) -> (B, s, h)


def swiglu_mlp(x, gate_weight, up_weight, proj_weight):
    gated = F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight)  # (B, s, h) -> (B, s, I), twice
    return F.linear(gated, proj_weight)  # (B, s, I) -> (B, s, h)


class MLP(nn.Module):
    """GPT-2's MLP, or Llama's SwiGLU (a gate beside the up projection); either of them tiled (tiled.py)."""

    def __init__(self, cfg):
        super().__init__()
        h, I = cfg.n_embd, cfg.intermediate_size
        if cfg.mlp == "swiglu":
            self.gate, self.up = nn.Linear(h, I, bias=False), nn.Linear(h, I, bias=False)
        else:
            self.fc = nn.Linear(h, I, bias=False)
        self.proj = nn.Linear(I, h, bias=False)
        self.fn = swiglu_mlp if cfg.mlp == "swiglu" else gelu_mlp
        self.linears = [self.gate, self.up, self.proj] if cfg.mlp == "swiglu" else [self.fc, self.proj]  # fn's order
        self.tiles = cfg.tiles

    def forward(self, x):
        weights = [linear.weight for linear in self.linears]  # read each call: ZeRO-3 puts its gathered views there
        return tiled_mlp(self.fn, x, weights, self.tiles) if self.tiles > 1 else self.fn(x, *weights)


def rms_norm(x, weight, eps=None):
    """RMSNorm over the last dim, its statistics in at least float32 whatever the dtypes of x and of the weight
    (bf16 when ZeRO-3 or FSDP2 gathers it so); the result in x's dtype."""
    return F.rms_norm(at_least_float32(x), x.shape[-1:], at_least_float32(weight), eps).to(x.dtype)


class RMSNorm(nn.RMSNorm):  # nn.RMSNorm's weight and name, rms_norm's arithmetic
    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg, sp_group, kind, ring_group=None):
        super().__init__()
        self.kind, self.norm1 = kind, RMSNorm(cfg.n_embd)  # kind: "a" softmax attention, "d" Gated DeltaNet
        self.attn = Attention(cfg, sp_group) if kind == "a" else GatedDeltaNet(cfg, sp_group, ring_group)
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
        self.tiles = cfg.loss_tiles

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


def layer_kernels(cfg, sp_group=None, ring_group=None):
    """What each kind of layer computes, its ring, window and sinks fixed here where the model is built. Returns
    make_kernels(position_ids, packed, token_index), which picks a batch's: {"a": softmax layers' attn_fn, "d": Gated
    DeltaNet's}; packed documents need the gathered position ids (where documents start), a ring its token_index."""
    ring, window = size_and_rank(ring_group)[0] > 1, cfg.window or None  # ring: whether there is one
    if ring and "d" in cfg.layer_pattern and cfg.gdn_parallel == "ulysses":
        raise ValueError("gdn_parallel='ulysses' runs a Gated DeltaNet layer on its Ulysses group alone, which a ring "
                         "splits; use gdn_parallel='context' with a ring, or no ring")

    def make_kernels(position_ids, packed, token_index):
        gathered = gather_sequence(position_ids, sp_group) if packed else None  # (B, S_local x Ulysses ranks)
        if ring or cfg.sinks:  # the ring's kernel takes sinks: with sinks and no ring, a ring of one rank
            layout = gather_sequence(token_index, sp_group) if packed and ring and token_index is not None else "zigzag"
            if torch.is_tensor(layout):  # checked here, eagerly, for compiled blocks too; DeltaNet chains in zigzag
                (zigzag_only if "d" in cfg.layer_pattern else check_layout)(layout, ring_group)
            attend = partial(ring_attention, group=ring_group, layout=layout, window=window, position_ids=gathered)
        elif packed:
            attend = partial(document_attention, position_ids=gathered, window=window)
        else:
            attend = partial(sliding_window_attention, window=window) if window else causal_attention
        starts = (position_ids if cfg.gdn_parallel == "context" else gathered) == 0 if packed else None  # [B, S/P | S]
        return {"a": attend, "d": partial(gated_delta_net, starts=starts)}
    return make_kernels


class GPT(nn.Module):
    """sp_group: the Ulysses group of the all-to-alls; ring_group: the ring beside it (Ulysses x Ring) that ring
    attention and context-parallel DeltaNet use; None: none. host: where cfg.offload keeps block inputs off a GPU."""

    def __init__(self, cfg, sp_group=None, ring_group=None, host=torch.device("cpu")):
        super().__init__()
        self.cfg, self.sp_group, self.host = cfg, sp_group, host
        self.ring_group = ring_group if size_and_rank(ring_group)[0] > 1 else None
        self.make_kernels = layer_kernels(cfg, sp_group, self.ring_group)  # which kernels a layer may run
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, sp_group, cfg.layer_pattern[i % len(cfg.layer_pattern)],
                                          self.ring_group) for i in range(cfg.n_layer))
        self.head = Head(cfg)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # every matrix; those into the residual stream (.proj) scaled down with depth, as GPT-2
                std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name.endswith(".proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def units(self):
        """The pieces that ZeRO-3 gathers unit by unit (the next one prefetched), in forward order."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx, position_ids, labels=None, packed=False, token_index=None):
        """idx, position_ids, labels: [B, S_local], this rank's tokens; position_ids in the full sequence, or with
        packed=True in each document (0 where one starts); token_index: shard_for_ring's, a ring's layout over packed
        documents (else zigzag). Returns logits [B, S_local, vocab], or with labels (loss sum, correct tokens)."""
        x, p, y = (None if t is None else tuple(t.shape) for t in (idx, position_ids, labels))
        if p != x or y not in (None, x):  # else fails far from here
            raise ValueError(f"GPT.forward: idx {x}, position_ids {p}, labels {y}: want both of idx's, [B, S_local]")
        check_shards(idx, self.sp_group), check_shards(idx, self.ring_group)  # before a mismatch could hang
        kernels = self.make_kernels(position_ids, packed, token_index)  # {"a": softmax's kernel, "d": DeltaNet's}
        x = at_least_float32(self.embed(idx))  # (B, S_local, h); the residual stream stays float32 under bf16
        cos, sin = rope_cos_sin(position_ids, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_base)
        offload = self.cfg.offload and x.device != self.host  # ALST's trick: block inputs wait in host memory
        for block in self.blocks:
            if self.cfg.recompute:  # keep only the block's input; run the block again in backward
                with kept_on(self.host) if offload else nullcontext():
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, kernels[block.kind], use_reentrant=False)
            else:
                x = block(x, cos, sin, kernels[block.kind])
        return self.head(x, labels)
