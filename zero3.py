"""
ZeRO-3: each of the N ranks of a process group owns 1/N of the model state (parameters, gradients and AdamW
state), and the full parameters of a unit (the embedding, one block, the head) exist only around its compute.

Each unit's parameters are flattened into one float32 vector (float64 for a float64 model), padded with zeros to
a multiple of N and cut into N equal shards. Rank r keeps shard r as an nn.Parameter: the optimizer sees only these
shards, so its state is 1/N of the model's too. Here N = 2:

                     embed          block 0        block 1        head
    rank 0 owns     [#####.....]   [#####.....]   [#####.....]   [#####.....]
    rank 1 owns     [.....#####]   [.....#####]   [.....#####]   [.....#####]

    forward    all-gather embed | embed | free
                        all-gather block 0 | block 0 | free
                                    all-gather block 1 | block 1 | free  ...
    backward   all-gather head | head's backward | reduce-scatter grad of head (SUM) into shard.grad | free
                        all-gather block 1 | block 1's backward | reduce-scatter | free
                                    all-gather block 0 | block 0's backward | reduce-scatter | free  ...

The all-gathers overlap: the one for the unit that runs next (forward: i+1, backward: i-1) starts once unit i's own
gather is done, just before unit i computes, and runs while it does. The reduce-scatter is not overlapped: it is
issued inside the unit's gradient hook, and what computes next waits for it.

Per forward and backward every parameter is all-gathered twice and its gradient reduce-scattered once: 3*(N-1)/N of
the model's elements sent per rank, 1.5x the all-reduce of plain data parallelism (in bytes too when all is
float32; bf16 gathers make it as many bytes as a float32 all-reduce), for model state cut to 1/N. Besides its
shards a rank holds the gathered copies of at most two units (the one computing, the one prefetched) and, during a
unit's backward, that unit's full gradient (in the compute dtype, then in float32 or wider for the reduce).

How: the module's parameters become views into one flat tensor `full` per unit, a leaf that requires grad.
Freeing resizes its storage to 0 bytes; gathering resizes it back and all-gathers into it, so the views autograd
saved for backward see the data again as they are (the trick of FSDP1); each forward sets fresh ones too.
Autograd sums the views' gradients into `full.grad`; a post-accumulate-grad hook on `full` fires once per backward,
when the unit's gradient is complete, and reduce-scatters it. Gradients are SUMMED over ranks, never averaged:
the loss is already divided by the valid-token count of the whole global batch, so the sum is the gradient.

Offloaded (ZeRO3(..., offload_to=torch.device("cpu")), ALST's single-GPU setting): the float32 shards, their
gradients and with them AdamW's state live in CPU memory, 16 bytes a parameter / N (plus the compute-dtype buffer
below), and AdamW steps there. The GPU keeps no model state between steps, and in a step only the gathered units:
a gather copies the shard in the compute dtype from a host buffer (pinned on CUDA, so the copy does not wait),
refilled when the shard has changed since the last refill; each reduced gradient goes to host memory at once.

    host      shard fp32 -> bf16 buffer          shard.grad fp32 <-+         AdamW (moments, step)
                                 | copy                             | copy
    GPU                          +-> all-gather -> full | compute | reduce-scatter
"""

from collections import namedtuple
from functools import reduce

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves

# torch 2.13 names the two collectives of ZeRO *_single and deprecates the old names; older torch (2.11) has only
# the old ones. NCCL implements both; gloo too, its reduce-scatter being an all-reduce of which each rank keeps
# its own slice (twice the traffic of a real one, fine for CPU tests).
if hasattr(dist, "all_gather_single"):
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single
else:
    all_gather, reduce_scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

# where one parameter of a unit lives: module.<attr> in the model, named <name> in its state dict
Slot = namedtuple("Slot", "module attr name shape")


def _grad_outputs(output):
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them, as Hugging Face models return)
    that gradients will flow back through."""
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def master_dtype(parameters):
    """What the shards, the gradients' sums and so the optimizer hold: float32, or float64 where a parameter is."""
    return reduce(torch.promote_types, (p.dtype for p in parameters), torch.float32)


class ShardedUnit:
    """One unit: its parameters as one flat vector, this rank's shard of it (in `dtype`: float32, or float64 if a
    parameter is) and the gathered copy `full`. offload_to: the device (CPU memory) that keeps the shard and its
    gradient; None: the unit's own."""

    def __init__(self, module, prefix, group, compute_dtype, offload_to=None):
        self.module, self.group = module, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        params = list(module.named_parameters())
        if not params:
            raise ValueError(f"unit {prefix or type(module).__name__} has no parameters; leave it out of the units")
        self.slots = [Slot(module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2],
                           f"{prefix}.{name}" if prefix else name, p.shape) for name, p in params]
        self.numel = sum(p.numel() for _, p in params)
        padded = -(-self.numel // self.world) * self.world  # the next multiple of N
        self.sizes = [p.numel() for _, p in params] + [padded - self.numel]  # how `full` splits into parameters
        self.device = params[0][1].device
        self.dtype = master_dtype(p for _, p in params)
        shard = self.my_shard_of(p for _, p in params).to(offload_to or self.device)
        self.shard = nn.Parameter(shard)  # (padded/N,) the master copy
        for slot in self.slots:
            delattr(slot.module, slot.attr)  # the module keeps no parameter of its own from now on
        self.full = torch.empty(padded, dtype=compute_dtype or self.dtype, device=self.device, requires_grad=True)
        # offloaded only: `staging`, the shard in the compute dtype in host memory, which gathers copy from; and
        # `staged_version`, the shard's version (its count of in-place changes) that staging holds
        self.staging = self.staged_version = None
        if offload_to is not None:
            self.staging = torch.empty(shard.shape, dtype=self.full.dtype, device=offload_to,
                                       pin_memory=self.device.type == "cuda")
        # Collectives write into `full.data`, an alias autograd does not track: writing into `full` itself would be
        # an in-place change of the tensor whose views autograd saved for backward, and autograd refuses that.
        self.full_data = self.full.data
        self.handle, self.send = None, None  # the all-gather in flight and the shard copy it reads from
        self.gathered_version = None  # the shard's version (count of in-place changes) that `full` was gathered from
        self.in_backward = False
        self.free()

    def my_shard_of(self, tensors):
        """This rank's piece of the unit's parameters, given whole: flattened, padded with zeros and cut."""
        flat = torch.cat([t.detach().to(self.device, self.dtype).flatten() for t in tensors]
                         + [torch.zeros(self.sizes[-1], dtype=self.dtype, device=self.device)])  # (padded,)
        return flat.view(self.world, -1)[self.rank].clone()  # (padded/N,)

    def gather(self, async_op=False):
        """All-gather the shards into `full`. A no-op when it is gathered already, from the shard as it is: a prefetch
        that its unit never used (skipped, as LayerDrop skips layers) before the optimizer stepped is gathered
        anew. Waits unless async_op."""
        if self.gathered_version not in (None, self.shard._version):  # stale: the shard changed since
            self.wait()
            self.free()
        storage = self.full_data.untyped_storage()
        if self.handle is None and storage.size() == 0:
            storage.resize_(self.full_data.numel() * self.full_data.element_size())
            self.send, self.gathered_version = self.local_copy(), self.shard._version  # send: live till it is done
            self.handle = all_gather(self.full_data, self.send, group=self.group, async_op=True)  # -> (padded,)
        if not async_op:
            self.wait()

    def wait(self):
        if self.handle is not None:
            self.handle.wait()
            self.handle, self.send = None, None

    def local_copy(self):
        """This rank's shard in the compute dtype on the device, what it sends to the all-gather (the shard itself if
        it is so already). Offloaded, a copy of the host buffer, refilled first if the shard has changed since (the
        optimizer, a checkpoint)."""
        if self.staging is None:
            return self.shard.detach().to(self.full.dtype)
        # refill only if the shard changed. No copy out of staging can still be running then: the optimizer
        # stepped after backward's gradient copies to the host, and those waited for the GPU
        if self.staged_version != self.shard._version:
            self.staging.copy_(self.shard.detach())
            self.staged_version = self.shard._version
        return self.staging.to(self.device, non_blocking=True)

    def free(self):
        self.full_data.untyped_storage().resize_(0)  # the views stay, over 0 bytes, until the next gather
        self.gathered_version = None

    def set_views(self):
        """Point the module's parameters at their pieces of `full`. One split, so that backward builds the
        gradient of `full` in one buffer; the last piece is the padding, whose gradient stays zero."""
        for slot, piece in zip(self.slots, self.full.split(self.sizes)):
            setattr(slot.module, slot.attr, piece.view(slot.shape))

    def reduce_grad(self):
        """Sum this unit's gradient over the ranks; each rank adds its slice to its shard.grad."""
        grad = self.full.grad.to(self.dtype)  # (padded,); at least float32: summing N low-precision ones loses bits
        self.full.grad = None
        reduced = torch.empty(self.shard.shape, dtype=self.dtype, device=self.device)  # (padded/N,)
        reduce_scatter(reduced, grad, op=dist.ReduceOp.SUM, group=self.group)
        reduced = reduced.to(self.shard.device)  # offloaded: to host memory, beside the shard
        if self.shard.grad is None:
            self.shard.grad = reduced
        else:
            self.shard.grad += reduced  # gradient accumulation over micro-steps


class ZeRO3:
    """Shard `model` over `group` (every rank of it, e.g. the flattened DP x SP group) unit by unit.

    units: submodules in forward order that together hold every parameter exactly once (GPT.units()), none frozen.
    compute_dtype: dtype of the gathered parameters forward and backward run with (e.g. torch.bfloat16);
    the shards, their gradients (summed over ranks) and hence the optimizer stay float32 (a float64 unit's: float64).
    offload_to: a device (CPU memory) that keeps the shards, their gradients and so the optimizer's state and step.
    Call the model as before; give the optimizer `zero.parameters()`. The group must be initialized; a group of one
    rank works too; group=None is WORLD, as torch.distributed reads it. The model then holds no parameter of its
    own, and its state_dict() none (its buffers stay): what a rank holds is checkpoint.py's `held` (harness/)."""

    def __init__(self, model, units, group=None, compute_dtype=None, offload_to=None):
        owned = [id(p) for unit in units for _, p in unit.named_parameters(remove_duplicate=False)]
        distinct = set(owned)
        unowned = [name for name, p in model.named_parameters() if id(p) not in distinct]
        if unowned or len(owned) != len(distinct):
            raise ValueError(f"every parameter must belong to exactly one unit; in none: {unowned}, "
                             f"in more than one place: {len(owned) - len(distinct)} (tied weights are not supported)")
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        if frozen:  # its shard would be a new leaf that requires grad, and the optimizer would train it
            raise ValueError(f"ZeRO3 trains every parameter, and these are frozen (requires_grad=False): {frozen}; "
                             f"unfreeze them or leave ZeRO3 out")
        self.group = group
        prefixes = {module: name for name, module in model.named_modules()}
        self.units = [ShardedUnit(unit, prefixes[unit], group, compute_dtype, offload_to) for unit in units]
        for i, unit in enumerate(self.units):
            unit.module.register_forward_pre_hook(lambda module, args, i=i: self._before_forward(i))
            unit.module.register_forward_hook(lambda module, args, output, i=i: self._after_forward(i, output))
            unit.full.register_post_accumulate_grad_hook(lambda full, i=i: self._after_backward(i))

    # Prefetch: the next unit's all-gather is started before the current unit computes and waited for only
    # when that unit runs. With NCCL it runs on its own stream while the GPU computes; with gloo on a background
    # thread while the CPU computes. Either way its time hides behind compute instead of adding to it.
    def _before_forward(self, i):
        unit = self.units[i]
        unit.gather()
        unit.set_views()
        if not unit.in_backward and i + 1 < len(self.units):  # in backward this forward is a recomputation
            self.units[i + 1].gather(async_op=True)

    def _after_forward(self, i, output):
        unit = self.units[i]
        if unit.in_backward:
            return  # activation checkpointing recomputed this unit inside its backward, which still needs it
        unit.free()
        for t in _grad_outputs(output):  # fires when the gradient of the output is ready: the unit's backward is next
            t.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i):
        self.units[i].in_backward = True
        self.units[i].gather()
        if i > 0:  # backward runs the units in reverse order
            self.units[i - 1].gather(async_op=True)

    def _after_backward(self, i):
        unit = self.units[i]
        unit.reduce_grad()
        unit.free()
        unit.in_backward = False

    def parameters(self):
        """This rank's shards, one per unit: the tensors the optimizer updates (float32, or float64)."""
        return [unit.shard for unit in self.units]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Scale the gradients so that the L2 norm of the whole model's gradient is at most max_norm and return
        that norm before clipping, like torch.nn.utils.clip_grad_norm_. Each rank sums the squares of its shard
        gradients (padding holds zero gradient) and one all-reduce of that number adds up the ranks."""
        grads = [shard.grad for shard in self.parameters() if shard.grad is not None]
        sum_of_squares = torch.zeros((), device=self.units[0].device)  # where the collective runs, offloaded or not
        for grad in grads:
            sum_of_squares += grad.pow(2).sum().to(sum_of_squares.device)
        dist.all_reduce(sum_of_squares, group=self.group)
        norm = sum_of_squares.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for grad in grads:
            grad.mul_(scale.to(grad.device))
        return norm


def fsdp2_shard(model, units, group, compute_dtype=None):
    """The same scheme (gather, free, reduce-scatter a unit at a time) by PyTorch's FSDP2, which shards each parameter
    by rows, for comparison: one FSDP unit per unit, then the root, with gradients summed over the ranks like ZeRO3's.
    Give the optimizer model.parameters() (DTensor shards)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: DTensor takes 0.7 s to import
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, next(model.parameters()).device.type)
    # compute_dtype for the gathered parameters alone, like ZeRO3: the inputs of a unit (the float32 residual
    # stream, RoPE's tables) keep their dtype; the sums as ZeRO3's
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=master_dtype(model.parameters()),
                                  cast_forward_inputs=False)
    for module in [*units, model]:  # the root last: it picks up what no unit holds (nothing, here)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)  # sum, do not average over ranks
        module.set_force_sum_reduction_for_comms(True)  # as a plain SUM collective: gloo has no PREMUL_SUM
    return model
