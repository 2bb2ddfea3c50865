"""
Tests of gpt.py, the whole model, against one device: loss and every gradient under SP 2, 3 and 4 with padding,
GQA and uneven heads; packed documents under SP, no document seeing another; a packed batch against each
document alone; position ids of the wrong shape named; RoPE's angles at long positions; tiles and recomputation
against the plain model.
"""

import re

import pytest
import torch
import torch.distributed as dist

import data
import documents
import ring
import ulysses
from conftest import (DOC_LENGTHS, assert_all_close, grads, packed_batch, run_ranks, summed, usp_groups, whole_sequence,
                      zero_batch)
from gpt import GPT, GPTConfig, apply_rope, rope_cos_sin


GPT_CASES = [(16, 4, 4), (13, 4, 2), (13, 4, 1)]  # (seq_len, n_head, n_kv_head); 13 is not divisible by 2, 3, 4


def _gpt_loss_and_grads(cases, group):
    results = []
    for seq_len, n_head, n_kv_head in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=n_head, n_kv_head=n_kv_head, n_embd=32), sp_group=group)
        samples = (data.make_sample(i, seq_len, seed=3) for i in range(2))
        full = [torch.stack(column) for column in zip(*samples)]
        inputs, labels, position_ids, _ = ulysses.shard_for_sp(*full, group)  # (B, S_pad/sp) each
        valid = ulysses.global_valid_tokens(labels, group)
        loss_sum, _ = model(inputs, position_ids, labels)
        (loss_sum / valid).backward()
        results.append((loss_sum.detach() / valid, grads(model)))
    return results


def _gpt_rank(rank, world_size):
    return _gpt_loss_and_grads(GPT_CASES, dist.group.WORLD)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gpt_with_sp_matches_one_device(world_size):
    """Loss and every parameter gradient, with lengths that need padding, GQA and (sp 3) uneven head layouts."""
    per_rank = run_ranks(world_size, _gpt_rank)
    for i, (reference_loss, reference_grads) in enumerate(_gpt_loss_and_grads(GPT_CASES, None)):
        # each rank holds the loss of its own tokens, and the gradient of it; summed they are the whole batch's
        torch.testing.assert_close(sum(r[i][0] for r in per_rank), reference_loss, rtol=1e-5, atol=1e-6)
        assert_all_close(summed([r[i][1] for r in per_rank]), reference_grads, rtol=1e-4, atol=1e-6,
                         where=str(GPT_CASES[i]))


def _packed_model(group, pattern, window=0):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, window=window, layer_pattern=pattern),
               sp_group=group)


def _packed_run(group, pattern, window=0, changed_document=None):
    """Logits and (grads of the mean loss) of this rank's shard of the packed batch."""
    model = _packed_model(group, pattern, window)
    inputs, labels, position_ids, _ = ulysses.shard_for_sp(*packed_batch(changed_document), group)
    logits = model(inputs, position_ids, packed=True)  # (B, S_pad/sp, vocab)
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    (loss_sum / ulysses.global_valid_tokens(labels, group)).backward()
    return logits.detach(), grads(model)


def _packed_rank(rank, world_size, pattern):
    return [_packed_run(dist.group.WORLD, pattern, window) for window in (0, 5)] + \
           [_packed_run(dist.group.WORLD, pattern, 0, changed_document=1)]


@pytest.mark.parametrize("pattern", ["a", "da"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_packed_documents_under_sp(world_size, pattern):
    """SP boundaries are not document boundaries: sp 2, 3 (uneven heads) and 4 equal one device on a packed
    batch, for causal and sliding-window attention and for Gated DeltaNet (da: a DeltaNet layer, then softmax
    attention), and no document sees another."""
    per_rank = run_ranks(world_size, _packed_rank, pattern)
    sp_results = [(whole_sequence([r[i][0] for r in per_rank])[:, :32], summed([r[i][1] for r in per_rank]))
                  for i in range(3)]
    for (logits, grads_summed), window in zip(sp_results, (0, 5)):
        reference_logits, reference_grads = _packed_run(None, pattern, window)
        torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)
        assert_all_close(grads_summed, reference_grads, rtol=1e-4, atol=1e-6, where=f"window {window}")
    # no leakage: new tokens in document 1 change its own logits and nothing else
    logits, changed = sp_results[0][0], sp_results[2][0]
    for row, order in ((0, [0, 1, 2, 3]), (1, [3, 2, 1, 0])):
        offset = 0
        for d in order:
            span = slice(offset, offset + DOC_LENGTHS[d])
            if d == 1:
                assert not torch.allclose(logits[row, span], changed[row, span], atol=1e-3)
            else:
                torch.testing.assert_close(changed[row, span], logits[row, span], rtol=0, atol=1e-5)
            offset += DOC_LENGTHS[d]


def _document_layout_rank(rank, world_size):
    """A packed batch over a ring of 2 in the per-document layout, into a model with a Gated DeltaNet layer (the
    context way, which runs beside a ring) and into one without: the error, and the logits."""
    documents.MIN_CHUNK = 1  # documents of a few tokens are shared out too
    groups = usp_groups(1, 2)
    inputs, _, position_ids, index = ring.shard_for_ring(*packed_batch(), *groups, documents.document_layout)
    results = []
    for pattern in ("da", "a"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, layer_pattern=pattern,
                              gdn_parallel="context"), *groups)
        try:
            results.append((index, model(inputs, position_ids, packed=True, token_index=index).detach()))
        except ValueError as e:
            results.append(str(e))
    try:  # falling token indices, refused where a batch's kernels are made: compiled blocks skip ring_attention's check
        model.make_kernels(position_ids, True, index.flip(1))
    except ValueError as e:
        results.append(str(e))
    return results


def test_gated_deltanet_refuses_the_per_document_layout():
    """Under a ring, Gated DeltaNet's context-parallel runs are chained in the zigzag order, so a
    model with such a layer refuses tokens laid out per document on every rank (it computed wrong logits before,
    0.12 off); softmax attention alone takes them and equals one device, and refuses falling token indices."""
    per_rank = run_ranks(2, _document_layout_rank)
    for refused, _, falling in per_rank:
        assert refused.startswith("the tokens are laid out in another order than zigzag"), refused
        assert falling == "layout: each ring rank must hold rising token indices, each token once", falling
    logits = whole_sequence([r[1][1] for r in per_rank], [r[1][0] for r in per_rank])
    inputs, _, position_ids = packed_batch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, layer_pattern="a", gdn_parallel="context"))
    torch.testing.assert_close(logits, model(inputs, position_ids, packed=True).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["a", "da"])
def test_packed_batch_equals_documents_alone(pattern):
    """Each document of a packed batch, in both rows (the second has the documents in another order, and opens
    with one continued from an earlier sample), gets exactly the logits it gets when run alone, at its positions."""
    model = _packed_model(None, pattern)
    inputs, _, position_ids = packed_batch()
    packed_logits = model(inputs, position_ids, packed=True)  # (2, 32, vocab)
    for row, lengths in ((0, DOC_LENGTHS), (1, DOC_LENGTHS[::-1])):
        offset = 0
        for n in lengths:
            span = slice(offset, offset + n)
            alone = model(inputs[row:row + 1, span], position_ids[row:row + 1, span])  # (1, n, vocab), plain causal
            torch.testing.assert_close(packed_logits[row:row + 1, span], alone, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"row {row}, tokens {span}: {m}")
            offset += n


@pytest.mark.parametrize("wrong", ["position_ids", "labels"])
@pytest.mark.parametrize("shape", [(2, 5), (4,), (2, 3)], ids=["one-too-long", "1d", "one-too-short"])
def test_position_ids_or_labels_of_the_wrong_shape_are_named(wrong, shape):
    """GPT.forward with position ids or labels of another shape than the tokens' (or no position ids): one line naming
    each with its shape and the shape they want, before RoPE could broadcast them or the loss fail elsewhere."""
    model = _packed_model(None, "a")
    idx = torch.zeros(2, 4, dtype=torch.long)
    given = {"position_ids": idx, "labels": idx if wrong == "labels" else None, wrong: torch.zeros(shape).long()}
    shapes = [None if t is None else tuple(t.shape) for t in given.values()]
    with pytest.raises(ValueError, match=rf"^GPT.forward: idx \(2, 4\), position_ids {re.escape(str(shapes[0]))}, "
                                         rf"labels {re.escape(str(shapes[1]))}: want both of idx's, \[B, S_local\]$"):
        model(idx, **given)
    with pytest.raises(ValueError, match=r"^GPT.forward: idx \(2, 4\), position_ids None, labels None: "):
        model(idx, None)  # no position ids at all: named too


def _assert_the_ways_agree(cfg, ways, labels_ignored=False):
    """The same model made each of `ways` (GPTConfig fields: tiles, recompute, ...), one step on zero_batch: the
    loss, the correct count and every gradient as the first way's."""
    idx, position_ids, labels = zero_batch()
    if labels_ignored:
        labels[:, 4:8] = -100
    results = []
    for way in ways:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**vars(cfg), **way}))
        loss_sum, correct = model(idx, position_ids, labels)
        loss_sum.backward()
        results.append((loss_sum.detach(), correct, grads(model)))
    for result in results[1:]:
        assert_all_close(result, results[0], rtol=1e-5, atol=1e-6)


def test_rope_turns_by_the_exact_angle_at_long_positions():
    """RoPE's cos and sin at positions up to 2^25 (Llama-3's base) equal float64 math to float32 rounding, so positions
    2^24 and 2^24 + 1 stay apart: angles formed in float32 would merge them and be off by up to a radian."""
    positions = torch.tensor([[5, 1_048_577, 2**24, 2**24 + 1, 2**25 - 1]])  # (1, 5)
    cos, sin = rope_cos_sin(positions, 128, 500000.0)  # (1, 5, 1, 128) each
    angles = positions.double()[..., None] * 500000.0 ** -(torch.arange(0, 128, 2).double() / 128)  # (1, 5, 64)
    for got, want in ((cos, angles.cos()), (sin, angles.sin())):
        torch.testing.assert_close(got[:, :, 0], torch.cat([want, want], -1).float(), rtol=0, atol=1e-7)
    assert not torch.equal(cos[0, 2], cos[0, 3])


def test_rope_is_llamas_rotation_and_sees_only_relative_positions():
    """apply_rope turns each pair (x_i, x_{i+D/2}) as Llama's rotate_half does: x = e_0 at position 1, whose pair has
    frequency 1, turns by one radian toward e_2. Rotating q and k alike, a model's logits depend only on how far
    apart tokens are: positions 0..7 and 100..107 give the same."""
    x = torch.zeros(1, 1, 1, 4, dtype=torch.float64)  # (B, S, H, D)
    x[..., 0] = 1.0
    cos, sin = rope_cos_sin(torch.tensor([[1]]), 4, 10000.0)  # (1, 1, 1, 4) each
    one = torch.tensor(1.0, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin)[0, 0, 0], torch.stack([one.cos(), 0 * one, one.sin(), 0 * one]),
                               rtol=0, atol=1e-7)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, vocab_size=32))
    idx = torch.randint(0, 32, (2, 8))  # (B, S)
    near, far = (model(idx, torch.arange(start, start + 8).expand(2, 8)) for start in (0, 100))  # (B, S, vocab) each
    torch.testing.assert_close(near, far, rtol=0, atol=1e-5)


def test_the_window_is_the_last_window_tokens():
    """GPTConfig(window=w): token i sees tokens i-w+1 .. i. A window of S tokens is no window; with a window of 1
    the last token's logits ignore every other token, with 2 they see the one before."""
    idx = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(0))  # (B, S)
    other = torch.cat([(idx[:, :5] + 1) % 32, idx[:, 5:]], dim=1)  # the first 5 tokens changed

    def logits(window, idx):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, vocab_size=32, window=window))
        return model(idx, torch.arange(6)[None]).detach()  # (1, 6, vocab)
    torch.testing.assert_close(logits(6, idx), logits(0, idx), rtol=0, atol=0)
    assert torch.equal(logits(1, idx)[:, 5], logits(1, other)[:, 5])
    assert not torch.equal(logits(2, idx)[:, 5], logits(2, other)[:, 5])


def test_gpt_tiled_and_recomputed_equals_plain():
    _assert_the_ways_agree(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
                           [dict(tiles=tiles, recompute=recompute)
                            for tiles, recompute in ((1, False), (3, False), (3, True), (1, True))],
                           labels_ignored=True)


def test_swiglu_mlp_is_llamas_and_tiles_exactly():
    """--mlp swiglu computes Llama's MLP, proj(silu(gate x) * up x), written out here in float64 for one block's
    MLP; the whole model with it, its loss in its own tile count, gives the plain model's loss and every gradient
    tiled and recomputed."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu", intermediate_size=48, vocab_size=300)
    mlp = GPT(cfg).blocks[0].mlp.double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    gate, up, down = (layer.weight for layer in (mlp.gate, mlp.up, mlp.proj))
    expected = (x @ gate.T * torch.sigmoid(x @ gate.T) * (x @ up.T)) @ down.T  # silu(a) = a * sigmoid(a)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-12, atol=1e-12)
    _assert_the_ways_agree(cfg, [dict(tiles=tiles, loss_tiles=loss_tiles, recompute=recompute)
                                 for tiles, loss_tiles, recompute in ((1, 1, False), (3, 5, False), (2, 4, True))])


def test_the_llama3_8b_preset_is_llama_3_8b():
    """--model llama3-8b is Llama-3-8B's shape: 8,030,261,248 parameters, Meta's count (32 layers of 4,096, 32 query
    and 8 kv heads, SwiGLU of 14,336, its own embedding and head over 128,256 tokens, RoPE theta 500,000); a model
    flag given beside it changes that alone."""
    from harness import launch
    args = launch.parse_args(["--model", "llama3-8b"])
    launch.check_args(args, 8)
    cfg = launch.model_config(args)
    with torch.device("meta"):
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.embed.weight is not model.head.lm_head.weight  # untied
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.vocab_size, cfg.mlp, cfg.intermediate_size,
            cfg.rope_base) == (32, 4096, 32, 8, 128256, "swiglu", 14336, 500000.0)
    args = launch.parse_args(["--model", "llama3-8b", "--n-layer", "2", "--n-kv-head", "4"])
    launch.check_args(args, 8)
    assert (args.n_layer, args.n_kv_head, args.n_embd, args.vocab_size) == (2, 4, 4096, 128256)
