"""
A small decoder-only transformer (nanoGPT-style, with RoPE, RMSNorm and grouped-query attention) that trains
under Ulysses sequence parallelism.

The model sees only its rank's S/P tokens. Everything except attention is per-token, so it runs on the local
tokens unchanged; attention goes through ulysses.ulysses_attention, the one place where tokens of different
ranks meet. The model knows nothing else about SP: it gets the SP group to pass to attention, and the GLOBAL
position of each token (RoPE must rotate token i by i, not by its index inside the shard).
"""

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from tiled import tiled_lm_loss, tiled_mlp
from ulysses import causal_attention, document_attention, gather_sequence, local_attention, ulysses_attention


@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 4  # < n_head: grouped-query attention; 1: multi-query attention
    n_embd: int = 128
    window: int = 0  # > 0: sliding-window attention over the last `window` tokens; 0: full causal attention
    rope_base: float = 10000.0
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


class Block(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(cfg.n_embd), Attention(cfg, sp_group)
        self.norm2, self.mlp = nn.RMSNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x, cos, sin, attend):
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm and language-model head. With labels, returns (sum of token losses, correct predictions)
    over the valid (label != -100) tokens, never a mean: the caller divides by the global valid-token count."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tiles = cfg.tiles

    def logits(self, x, norm_weight, lm_head_weight):
        return F.linear(F.rms_norm(x, x.shape[-1:], norm_weight, self.norm.eps), lm_head_weight).float()

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
    def __init__(self, cfg, sp_group=None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, sp_group) for _ in range(cfg.n_layer))
        self.sp_group = sp_group
        self.head = Head(cfg)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # residual projections scaled down with depth, as in GPT-2
                std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def units(self):
        """The pieces that ZeRO-3 gathers one at a time, in forward order."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx, position_ids, labels=None, packed=False):
        """idx, position_ids, labels: [B, S_local], this rank's tokens. position_ids are positions in the full
        sequence, or, with packed=True, in each document (0 where a document starts, and only there)."""
        window = self.cfg.window
        if packed:  # attention runs on the full sequence, so it needs the document starts of the full sequence
            attend = partial(document_attention, position_ids=gather_sequence(position_ids, self.sp_group),
                             window=window)
        else:
            attend = partial(local_attention, window=window) if window else causal_attention
        x = self.embed(idx)  # (B, S_local, h)
        cos, sin = rope_cos_sin(position_ids, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_base)
        offload = self.cfg.offload and x.is_cuda  # ALST's trick: block inputs wait for backward in CPU memory
        for block in self.blocks:
            if self.cfg.recompute:
                with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else nullcontext():
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, attend, use_reentrant=False)
            else:
                x = block(x, cos, sin, attend)
        return self.head(x, labels)
