"""
A small decoder-only transformer (nanoGPT-style, with RoPE, RMSNorm and grouped-query attention) that trains
under Ulysses sequence parallelism, with softmax attention or Gated DeltaNet (linear attention) in each layer.

The model sees only its rank's S/P tokens. Everything except attention is per-token, so it runs on the local
tokens unchanged; attention goes through ulysses.py, the one place where tokens of different ranks meet. The
model knows nothing else about SP: it gets the SP group to pass to the all-to-alls, and the GLOBAL position of
each token (RoPE must rotate token i by i, not by its index inside the shard).

A layer is softmax attention or, in hybrid models (Qwen3-Next: three Gated DeltaNet layers to one softmax layer),
Gated DeltaNet, a linear attention with a recurrent state, which deltanet.py teaches. The MLP is GPT-2's (GELU) or
Llama's (SwiGLU); `PRESETS` names real shapes (`llama3-8b`: Llama-3-8B's 8.03B parameters, its 128,256-token vocabulary
and untied head). The file reads config, RoPE, attention, MLP, block, GPT.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from deltanet import GatedDeltaNet, gated_delta_net
from ring import gather_ring, ring_attention, ring_bytes, token_index as ring_index
from tiled import at_least_float32, tiled_lm_loss, tiled_mlp
from ulysses import (all_to_all_bytes, attention_layer, causal_attention, check_shards, document_attention,
                     gather_sequence, head_layout, kernel_kv_heads, rope_cos_sin, sliding_window_attention,
                     size_and_rank)


@dataclass
class GPTConfig:
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
    conv_width: int = 4  # Gated DeltaNet's causal convolution over the sequence
    # Gated DeltaNet's heads: key heads (q and k), value heads (v, the state, the output; a multiple of the key
    # heads, each key head serving n_v / n_k of them), and their dims. 0: n_head heads of n_embd / n_head.
    # Qwen3-Next: 16 key heads and 32 value heads, both of dim 128.
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    # How Gated DeltaNet layers run under SP (deltanet.py): "ulysses", whole value heads of the whole sequence on
    # each rank (at most one rank a value head, no ring); "context", each rank its tokens, the state's summaries
    # gathered and folded (any number of ranks, beside a ring). The same result either way.
    gdn_parallel: str = "ulysses"
    # How to compute, not what: these change memory and time, never the result.
    tiles: int = 1  # > 1: MLP and loss run over this many sequence tiles (tiled.py), never the full activation
    loss_tiles: int = 0  # the loss's own tile count (its logits are vocab/h times the MLP's input a token); 0: tiles
    recompute: bool = False  # keep only each block's input; recompute the block in backward
    offload: bool = False  # with recompute, on a GPU: keep those block inputs in host memory until backward

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
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        self.loss_tiles = self.loss_tiles or self.tiles
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp={self.mlp!r}: choose 'gelu' or 'swiglu'")
        if self.gdn_parallel not in ("ulysses", "context"):
            raise ValueError(f"gdn_parallel={self.gdn_parallel!r}: choose 'ulysses' or 'context'")
        if not self.layer_pattern or set(self.layer_pattern) - set("ad"):
            raise ValueError(f"layer_pattern={self.layer_pattern!r}: use the letters a (softmax attention) and "
                             f"d (Gated DeltaNet), e.g. 'ddda'")
        if len(self.layer_pattern) > self.n_layer:  # what the model holds is read off the pattern's letters
            raise ValueError(f"layer_pattern={self.layer_pattern!r} has more letters than n_layer={self.n_layer}: "
                             f"layer i takes letter i % {len(self.layer_pattern)}, so the letters past the first "
                             f"{self.n_layer} would build no layer")


# Real models' shapes, by name (train.py --model NAME; flags given beside it change them). Llama-3-8B: 32 layers of
# 4,096 with 32 query heads and 8 kv heads of 128, a SwiGLU MLP of 14,336, an embedding and a head of its own over
# 128,256 tokens: 8,030,261,248 parameters, as Meta's.
PRESETS = {"llama3-8b": dict(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, vocab_size=128256, mlp="swiglu",
                             intermediate_size=14336, rope_base=500000.0)}


class Attention(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        # a score with no value in every query's softmax, one per head (ring.py says how it stays exact under SP)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_head)) if cfg.sinks else None
        self.sp_group = sp_group

    def forward(self, x, cos, sin, attend):  # (B, S_local, h) -> (B, S_local, h); q and k rotated by global position
        return attention_layer(x, self.qkv.weight, self.proj.weight, self.n_head, self.n_kv_head, self.sp_group,
                               attend, cos, sin, check=False, sinks=self.sinks)  # GPT.forward checks the shards

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
        self.fn = swiglu_mlp if cfg.mlp == "swiglu" else mlp
        self.layers = [self.gate, self.up, self.proj] if cfg.mlp == "swiglu" else [self.fc, self.proj]  # fn's order
        self.tiles = cfg.tiles

    def forward(self, x):
        weights = [layer.weight for layer in self.layers]  # read now: ZeRO-3 puts its gathered views there
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
        self.kind = kind  # "a" or "d"
        self.norm1 = RMSNorm(cfg.n_embd)
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


def kept_on(host):
    """What autograd saves for backward waits there on `host` (torch.autograd.graph.save_on_cpu, for any host device):
    copied out as it is saved, into pinned memory when it comes from a GPU, and copied back when backward needs it."""
    def pack(t):
        return t.device, torch.empty(t.shape, dtype=t.dtype, device=host, pin_memory=t.is_cuda).copy_(t)
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1].to(packed[0], non_blocking=True))


class GPT(nn.Module):
    """sp_group: the Ulysses group whose all-to-alls carry attention; ring_group (Ulysses x Ring): the ring over
    which softmax attention then runs (ring.py). None: no such group. host: where cfg.offload keeps the block inputs
    when the model computes elsewhere (on a GPU)."""

    def __init__(self, cfg, sp_group=None, ring_group=None, host=torch.device("cpu")):
        super().__init__()
        self.host = host
        self.ring_group = ring_group if size_and_rank(ring_group)[0] > 1 else None
        if self.ring_group and "d" in cfg.layer_pattern and cfg.gdn_parallel == "ulysses":
            raise ValueError("gdn_parallel='ulysses' runs a Gated DeltaNet layer on its Ulysses group alone, which "
                             "a ring splits; use gdn_parallel='context' with a ring, or no ring")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, sp_group, cfg.layer_pattern[i % len(cfg.layer_pattern)],
                                          self.ring_group) for i in range(cfg.n_layer))
        self.sp_group = sp_group
        self.head = Head(cfg)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # the output projections into the residual stream scaled down with depth, as in GPT-2
                std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name.endswith(".proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def units(self):
        """The pieces that ZeRO-3 gathers one at a time, in forward order."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx, position_ids, labels=None, packed=False, token_index=None):
        """idx, position_ids, labels: [B, S_local], this rank's tokens. position_ids are positions in the full
        sequence, or, with packed=True, in each document (0 where a document starts, and only there).
        token_index [B, S_local]: where each token sits in the full sequence, as shard_for_sp returns it; with
        packed documents the ring takes it as its layout (zigzag, or per document where no layer is Gated DeltaNet,
        which one more all-gather of the ring's positions a forward makes sure of), else zigzag is assumed."""
        if position_ids.shape != idx.shape:  # RoPE would broadcast one against the other, or fail far from here
            raise ValueError(f"GPT.forward: idx {tuple(idx.shape)}, position_ids {tuple(position_ids.shape)}: want "
                             f"position_ids of idx's shape, [B, S_local]")
        for group in (self.sp_group, self.ring_group):  # one tiny collective each, before a mismatch could hang
            check_shards(idx, group)
        window = self.cfg.window
        # the kernels run on the full sequence, so with packing they need the document starts of the full sequence
        full_positions = gather_sequence(position_ids, self.sp_group) if packed else None
        given = packed and token_index is not None and self.ring_group is not None  # shard_for_sp's layout
        layout = gather_sequence(token_index, self.sp_group) if given else "zigzag"  # of my ring rank's tokens
        if given and any(block.kind == "d" for block in self.blocks):  # their context-parallel state runs in zigzag
            every = gather_ring(layout, self.ring_group)  # (R, B, U L): every ring rank's, so all decide alike
            zigzag = torch.stack([ring_index("zigzag", r, len(every), every.shape[2]) for r in range(len(every))])
            if not torch.equal(every, zigzag[:, None].expand_as(every)):  # (R, U L) -> (R, B, U L)
                raise ValueError("GPT.forward: token_index lays the tokens out in another order than zigzag (as "
                                 "ring.document_layout does), which Gated DeltaNet layers do not take under a ring: "
                                 "their state passes from rank to rank in the zigzag order; shard with the default "
                                 "layout")
        ring = partial(ring_attention, group=self.ring_group, layout=layout, window=window or None,  # shard_for_sp's
                       position_ids=full_positions)  # with a ring: the positions of my ring rank's tokens
        # the ring's kernel takes attention sinks, SDPA's and flash-attn's do not: with sinks, a ring of one rank
        attend = {"a": ring if self.ring_group or self.cfg.sinks else
                  partial(document_attention, position_ids=full_positions, window=window) if packed else
                  partial(sliding_window_attention, window=window) if window else causal_attention,
                  "d": partial(gated_delta_net, starts=None if not packed else  # context: its own tokens' starts
                               position_ids == 0 if self.cfg.gdn_parallel == "context" else full_positions == 0)}
        x = at_least_float32(self.embed(idx))  # (B, S_local, h); the residual stream stays float32 under bf16
        cos, sin = rope_cos_sin(position_ids, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_base)
        offload = self.cfg.offload and x.device != self.host  # ALST's trick: block inputs wait in host memory
        for block in self.blocks:
            if self.cfg.recompute:
                with kept_on(self.host) if offload else nullcontext():
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, attend[block.kind], use_reentrant=False)
            else:
                x = block(x, cos, sin, attend[block.kind])
        return self.head(x, labels)
