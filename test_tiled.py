"""
Tests of tiled.py against the untiled computation: the tiled MLP and the tiled loss give the same outputs and
gradients; tiles keep only their input, send each gradient once, recompute under the forward's autocast, and
keep float64.
"""

import pytest
import torch
import torch.nn.functional as F

import gpt
import tiled
from conftest import assert_all_close
from gpt import GPT, GPTConfig


def _labels_with_gaps(shape):
    labels = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(3))
    labels[:, 4:7] = -100  # with 13 tokens in 4 tiles, tile 1 (tokens 4-6) has no label at all
    labels[0, 0] = -100
    return labels


def _mlp_and_grads(run, x, weights, grad_out):
    out = run()
    out.backward(grad_out)
    result = [out.detach()] + [t.grad.clone() for t in (x, *weights)]
    for t in (x, *weights):
        t.grad = None
    return result


@pytest.mark.parametrize("S, n_tiles", [(13, 4), (13, 13), (3, 8)])
def test_tiled_mlp_matches_untiled(S, n_tiles):
    torch.manual_seed(0)
    x = torch.randn(2, S, 16, requires_grad=True)
    weights = [torch.randn(64, 16, requires_grad=True), torch.randn(16, 64, requires_grad=True)]
    grad_out = torch.randn(2, S, 16)
    assert_all_close(_mlp_and_grads(lambda: tiled.tiled_mlp(gpt.gelu_mlp, x, weights, n_tiles), x, weights, grad_out),
                     _mlp_and_grads(lambda: gpt.gelu_mlp(x, *weights), x, weights, grad_out))


@pytest.mark.parametrize("all_ignored", [False, True])
def test_tiled_loss_matches_untiled(all_ignored):
    torch.manual_seed(0)
    head = GPT(GPTConfig(vocab_size=64, n_embd=16, n_head=2, n_kv_head=2)).head
    torch.nn.init.normal_(head.norm.weight, 1.0, 0.2)  # a norm weight of ones would hide a wrong norm gradient
    x = torch.randn(2, 13, 16, requires_grad=True)
    labels = torch.full((2, 13), -100) if all_ignored else _labels_with_gaps((2, 13))
    results = []
    for tiles in (1, 4):
        head.tiles = tiles
        loss_sum, correct = head(x, labels)
        loss_sum.backward()
        results.append([loss_sum.detach(), correct, x.grad.clone(), head.norm.weight.grad.clone(),
                        head.lm_head.weight.grad.clone()])
        x.grad, head.norm.weight.grad, head.lm_head.weight.grad = None, None, None
    assert_all_close(results[1], results[0])
    if all_ignored:
        assert results[1][0].item() == 0 and all(torch.all(g == 0) for g in results[1][2:])  # 0, never NaN


@pytest.mark.parametrize("S_labels", [12, 14])
def test_tiles_refuse_inputs_of_other_lengths(S_labels):
    """Every input is cut at the same tokens: labels one token short, or one too many (whose last label the tiles
    would drop unseen), are refused in one line that names the shapes."""
    x, weight = torch.randn(2, 13, 16), torch.randn(64, 16)
    with pytest.raises(ValueError, match=rf"^sequence_tiled_compute: inputs \[\(2, 13, 16\), \(2, {S_labels}\)\]; "):
        tiled.tiled_lm_loss(F.linear, x, _labels_with_gaps((2, S_labels)), [weight], 4)


def test_tiled_keeps_only_its_input_and_sends_each_gradient_once():
    """A ZeRO-3 post-accumulate-grad hook must fire once per backward, not once per tile."""
    x = torch.randn(2, 13, 16, requires_grad=True)
    weights = [torch.randn(64, 16, requires_grad=True), torch.randn(16, 64, requires_grad=True)]
    arrivals = [0, 0]
    for i, w in enumerate(weights):
        w.register_post_accumulate_grad_hook(lambda w, i=i: arrivals.__setitem__(i, arrivals[i] + 1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = tiled.tiled_mlp(gpt.gelu_mlp, x, weights, 4)
    assert len(saved) == 1 and saved[0] is x  # not the [B, S, 4h] hidden layer
    out.sum().backward()
    assert arrivals == [1, 1]


def test_tiles_recompute_under_the_forward_autocast():
    """Backward runs outside autocast, so the tiles must re-enter the forward's autocast to recompute what forward
    computed. With bf16 weights (ZeRO-3's gathered copy under --dtype bfloat16) and a float32 input it would not
    even run."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 16, requires_grad=True)
    weights = [(torch.randn(64, 16) / 4).bfloat16().requires_grad_(),
               (torch.randn(16, 64) / 8).bfloat16().requires_grad_()]
    results = []
    for run in (lambda: gpt.gelu_mlp(x, *weights), lambda: tiled.tiled_mlp(gpt.gelu_mlp, x, weights, 4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run()  # (B, S, h) bf16
        out.float().pow(2).sum().backward()
        results.append([out.detach().float()] + [t.grad.float() for t in (x, *weights)])
        for t in (x, *weights):
            t.grad = None
    for got, want in zip(*reversed(results)):  # bf16 arithmetic: per-tile sums round differently from one sum
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_tiles_sum_a_bf16_parameter_gradient_in_float32():
    """A bf16 weight's gradient, summed over tiles in float32 and rounded once: its 9 tiles give 1 and eight times
    2^-9, which bf16 (8 bits of mantissa) would round back to 1 at every step of its own sum."""
    x = torch.full((1, 9, 1), 2.0**-9)  # (B, S, h)
    x[0, 0] = 1.0
    w = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    tiled.tiled_mlp(lambda t, w: t * w, x, [w], 9).sum().backward()
    assert w.grad.item() == 1 + 2**-6  # 1 + 8 * 2^-9, exact in bf16


def test_tiles_keep_float64():
    """A float64 layer stays float64 tiled: the parameter gradients summed over tiles, and the loss, are never
    rounded to float32 on the way (half precision is widened to float32, nothing is ever narrowed)."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 13))
    linear = lambda t, w: t @ w.T
    for tiled_run, plain_run in (
            (lambda: tiled.tiled_mlp(linear, x, (w,), 1), lambda: linear(x, w)),
            (lambda: tiled.tiled_mlp(linear, x, (w,), 4), lambda: linear(x, w)),
            (lambda: tiled.tiled_lm_loss(linear, x, labels, (w,), 4)[0],
             lambda: F.cross_entropy(linear(x, w).flatten(0, 1), labels.flatten(), reduction="sum"))):
        results = []
        for run in (tiled_run, plain_run):
            out = run()
            results.append([out.detach(), *torch.autograd.grad(out.sum(), (x, w))])
        assert results[0][0].dtype == torch.float64
        assert_all_close(results[0], results[1], rtol=1e-13, atol=1e-13)
