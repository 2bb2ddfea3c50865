"""
Sequence-tiled compute with recomputation (ALST): run a per-token layer over a long sequence without ever
holding its full-sequence intermediate activations.

An MLP on S tokens makes [B, S, I] tensors (I: its hidden size, 4h in GPT-2; two of them with GELU, four with
SwiGLU) and autograd keeps them for backward; a language-model head makes [B, S, vocab] float32 logits, and
cross-entropy keeps their log-softmax, as large. With Ulysses, S is the local S/P tokens, but at long context these
are still the largest tensors of the step. Every token is computed independently in these layers, so we cut the
sequence into T tiles and run the layer one tile at a time:

    x [B, S, h]    | tile 0 | tile 1 | tile 2 | tile 3 |      T = 4 tiles along dim 1
    forward        each tile under no_grad -> its output is kept, its [B, S/T, I] is freed at once; then the
                   tiles' outputs are joined into one [B, S, h]
    between        only x is kept (the untiled layer keeps it too, or under bf16 autocast a bf16 copy of it)
    backward       tile i is recomputed with grad, differentiated, and freed before tile i+1 starts

                      untiled                          tiled
    kept for backward  x and the [B, S, I]s             x alone
    largest transient  [B, S, I]                        [B, S/T, I], one tile at a time
    cost                                                one more forward of every tile (the recomputation)

Parameters are handed in explicitly: they are inputs of the autograd Function, and fn gets them as arguments.
Backward takes each tile's parameter gradient with torch.autograd.grad (which writes nothing into .grad), sums the
T of them in at least float32, and returns the sum in the parameter's dtype. So autograd accumulates each parameter's
gradient ONCE per backward, as without tiling, and a post-accumulate-grad hook (where a ZeRO-3 sharder
reduce-scatters the gradient) fires once, not T times. (A hook added with register_hook, by contrast, also sees
every tile's partial gradient.) torch.compile cannot trace torch.autograd.grad inside a backward, so it breaks its
graph here: the tiles run eagerly.

Every rank must run the same number of tiles: fn may run collectives (were fn a module a sharder hooks, it would
gather once per tile, in forward and again in backward), and a rank that makes one call fewer hangs the group. The
tile count therefore depends only on n_tiles and S_local = x.shape[1], as min(n_tiles, S_local): every rank holds
the same padded length S/P, so every rank computes the same count. ALST picks tiles of about h tokens (n_tiles =
ceil(S_local/h)), so that a tile's [B, h, I] is B times the size of the MLP's weight [I, h] at any sequence length.

This file depends on torch alone: copy it into your own project.
"""

import torch
import torch.nn.functional as F


def _split(tensors, n_tiles):
    """Split each [B, S, ...] tensor into n_tiles views along dim 1 (the first S % n_tiles are one token longer).
    Returns one tuple per tile. The views are detached, so a tile's graph starts at the tile; forward and
    backward split the same way, so their tiles line up."""
    return list(zip(*(t.detach().tensor_split(n_tiles, dim=1) for t in tensors)))


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def at_least_float32(t):
    """Floating tensors: bf16 and fp16 widened to float32, for sums and losses that must not round; float64 as it is."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _SequenceTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, n_tiles, n_inputs, *inputs_and_params):
        inputs, params = inputs_and_params[:n_inputs], inputs_and_params[n_inputs:]
        ctx.fn, ctx.n_tiles, ctx.params = fn, n_tiles, params
        device = inputs[0].device.type  # backward runs outside any autocast: recompute under the forward's
        ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                            dtype=torch.get_autocast_dtype(device))
        ctx.save_for_backward(*inputs)  # inputs alone: params stay on ctx, where no saved-tensor hook copies them
        with torch.no_grad():  # nothing computed inside a tile outlives the tile
            tile_outputs = [fn(*tile, *params) for tile in _split(inputs, n_tiles)]
        outputs = tuple(torch.cat(pieces, dim=1) for pieces in zip(*map(_as_tuple, tile_outputs)))  # each (B, S, ...)
        ctx.mark_non_differentiable(*(out for out in outputs if not out.is_floating_point()))
        return outputs if isinstance(tile_outputs[0], tuple) else outputs[0]

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs, params, n_tiles = ctx.saved_tensors, ctx.params, ctx.n_tiles
        needs_grad = ctx.needs_input_grad[3:]  # past fn, n_tiles, n_inputs: one flag per input, then per parameter
        wanted = [j for j, need in enumerate(needs_grad) if need]  # indices into [*inputs, *params]
        input_grads = [torch.zeros_like(x) if need else None for x, need in zip(inputs, needs_grad)]
        input_grad_tiles = [g.tensor_split(n_tiles, dim=1) if g is not None else None for g in input_grads]  # views
        param_grads = [None] * len(params)
        for i, (tile, tile_grad_outputs) in enumerate(zip(_split(inputs, n_tiles), _split(grad_outputs, n_tiles))):
            # Step 1: recompute the tile with grad; its graph starts at the tile's (detached) inputs.
            tile = [x.requires_grad_(need) for x, need in zip(tile, needs_grad)]
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                outputs = _as_tuple(ctx.fn(*tile, *params))
            # Step 2: differentiate it w.r.t. the tile's inputs and the parameters that need a gradient.
            pairs = [(out, grad) for out, grad in zip(outputs, tile_grad_outputs) if out.requires_grad]
            tensors = [*tile, *params]
            grads = torch.autograd.grad([out for out, _ in pairs], [tensors[j] for j in wanted],
                                        [grad for _, grad in pairs], allow_unused=True)
            # Step 3: an input's tile gradient fills the tile's slice; a parameter's gradients add up over the
            # tiles, in at least float32 so that bf16 parameters are not rounded once per tile.
            for j, grad in zip(wanted, grads):
                if grad is None:
                    continue
                if j < len(inputs):
                    input_grad_tiles[j][i].copy_(grad)  # (B, s, ...) into (B, S, ...)
                else:
                    k = j - len(inputs)  # j is parameter k
                    param_grads[k] = at_least_float32(grad) if param_grads[k] is None else param_grads[k].add_(grad)
        unused = [k for k, need in enumerate(needs_grad[len(inputs):]) if need and param_grads[k] is None]
        if unused:
            raise ValueError(f"fn's output does not depend on params {unused}: fn must compute with the params it "
                             f"is given (its last arguments), not with tensors it finds elsewhere")
        param_grads = [None if g is None else g.to(p.dtype) for g, p in zip(param_grads, params)]
        return None, None, None, *input_grads, *param_grads


def sequence_tiled_compute(fn, inputs, params, n_tiles):
    """Run fn over n_tiles tiles of the sequence and keep only its inputs for backward, none of its activations.

    inputs: tensors [B, S, ...], all cut along dim 1 (the sequence). fn(*input_tiles, *params) must treat every
    token on its own and return a tensor [B, s, ...] or a tuple of them, s being the tile's length; the tiles'
    outputs are concatenated along dim 1 into the structure fn returns. Outputs that are not floating point
    (masks, counts) carry no gradient. Tiles need not divide S: their lengths differ by at most one.

    params: the tensors that need a gradient besides the inputs, handed to fn as its last arguments. fn must
    compute with these, not with module attributes it reads itself: a ZeRO-3 sharder or a checkpoint's
    recomputation may have put other tensor objects there by the time backward runs (ValueError if so).
    """
    if any(t.dim() < 2 or t.shape[:2] != inputs[0].shape[:2] for t in inputs):
        raise ValueError(f"sequence_tiled_compute: inputs {[tuple(t.shape) for t in inputs]}; want [B, S, ...] each, "
                         f"of one B and one S, as each tile cuts them all at the same tokens")
    params = tuple(params)
    n_tiles = max(1, min(n_tiles, inputs[0].shape[1]))  # same S on every rank -> same count on every rank
    return _SequenceTiled.apply(fn, n_tiles, len(inputs), *inputs, *params)


def tiled_mlp(mlp_fn, x, params, n_tiles):
    """mlp_fn(x_tile, *params) over x [B, S, h] tile by tile -> [B, S, h], e.g.
    tiled_mlp(lambda t, fc, proj: F.linear(F.gelu(F.linear(t, fc)), proj), x, (fc_weight, proj_weight), 4).
    Keeps x for backward instead of the MLP's [B, S, I] intermediates."""
    return sequence_tiled_compute(mlp_fn, (x,), params, n_tiles)


def tiled_lm_loss(head_fn, x, labels, params, n_tiles):
    """Cross-entropy of the language-model head without the full [B, S, vocab] logits.

    head_fn(x_tile, *params) -> logits [B, s, vocab] (e.g. final norm then lm_head, params their two weights).
    x [B, S, h], labels [B, S] with -100 for tokens without a label. Returns (loss_sum, correct): the sum of
    token cross-entropies (float32, or float64 for float64 logits) and the number of tokens whose argmax is the
    label, both over the labelled tokens only (a tile, or a rank, without labels adds 0). Kept for backward: x and
    labels, nothing of size vocab; the largest transients are one tile's [B, S/T, vocab] tensors (its logits, in
    float32 too, their log-softmax, their gradient). Tiles of about h tokens make each B times the lm_head weight's
    elements.
    """
    def loss_and_correct(x_tile, labels_tile, *params):  # (B, s, h), (B, s)
        logits = at_least_float32(head_fn(x_tile, *params))  # (B, s, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), labels_tile.flatten(), ignore_index=-100, reduction="none")
        correct = logits.argmax(-1) == labels_tile  # (B, s); a label of -100 never matches
        return loss.view_as(labels_tile), correct  # (B, s), (B, s)

    token_loss, correct = sequence_tiled_compute(loss_and_correct, (x, labels), params, n_tiles)  # (B, S), (B, S)
    return token_loss.sum(), correct.sum()


def kept_on(host):
    """ALST's offload: what autograd saves for backward waits on `host` (torch.autograd.graph.save_on_cpu, for any
    host device), copied out as it is saved (waiting; into pinned memory from a GPU) and back, without waiting,
    when backward needs it."""
    def pack(t):
        return t.device, torch.empty(t.shape, dtype=t.dtype, device=host, pin_memory=t.is_cuda).copy_(t)
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1].to(packed[0], non_blocking=True))
