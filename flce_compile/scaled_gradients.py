"""Backward's gradient scale into new tensors, as a custom op: the form a graph replayed by CUDA-graph trees needs.

The fused op forms dX, dW and db in forward; backward returns them times grad_scale * grad_output
(``op._scaled_forward_grads``). Run eagerly, that product is taken in place: no second dW-sized buffer, and
autograd adopts the result as ``weight.grad``. Traced by AOT autograd it is a ``mul`` of saved tensors that nothing
else reads, which Inductor writes into those same buffers (donated buffers). Under Inductor's CUDA-graph trees
(``mode="reduce-overhead"``) an output that aliases an earlier graph's output cannot be handed back as a cached
tensor: the forward's dX and dW and the backward's are all rebuilt from metadata at every replay
(``CUDAGraphNode.reconstruct_outputs``), host time compiled torch does not spend (4 tensors a step against its 1,
issue #13). So when backward is traced for Inductor with CUDA graphs on (``traced_for_cuda_graphs``) it calls
``flce::scaled_gradients``, which Inductor cannot write into its inputs: its outputs are new buffers of the
graph's pool, and the saved ones go back to it when backward's graph ends. The price is a second buffer of each
gradient's size while backward scales; in the default config forward held more at its own peak (dW summed in fp32
over the chunks, then its copy in the weight's dtype).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .strategies.chunked import output_factor


#: What AOT autograd traces a backward with.
_TRACED_TYPES = (FakeTensor, FunctionalTensor)
#: Device types whose compiled graphs CUDA-graph trees may replay.
GRAPHED_DEVICES = ("cuda",)


def kernel_scales(tensors: list[Tensor], *factors: Tensor) -> bool:
    """Whether ``tensors * g`` goes through the Triton kernel (``kernels/scale_grads.py``): real CUDA bf16/fp16
    tensors of one dtype, contiguous, and 0-dim fp32 factors (g, or the grad_output and grad_scale it forms g from)
    on their GPU. On the CPU ``mul`` reads a 0-dim tensor as an fp32 scalar; PyTorch's CUDA kernels first cast a
    0-dim CUDA tensor to the tensor's dtype, which would round a bf16/fp16 gradient twice when grad_output is not a
    power of two, so there the kernel does it (no host sync)."""
    # Only real tensors: AOT autograd traces the backward with fake/functional tensors (where torch 2.11's
    # torch.compiler.is_compiling() is False), and an ATen ``mul`` is what belongs in that graph.
    if not tensors or not all(type(g) is Tensor and g.dim() == 0 and g.dtype == torch.float32 for g in factors):
        return False
    dtype, index = tensors[0].dtype, factors[0].get_device()  # the kernel reads the factors: on the tensors' GPU
    return dtype in (torch.bfloat16, torch.float16) and all(g.get_device() == index for g in factors) and all(
        type(t) is Tensor and t.device.type == "cuda" and t.get_device() == index and t.dtype == dtype
        and t.is_contiguous() for t in tensors)


def traced_for_cuda_graphs(grad_scale: Tensor) -> bool:
    """Whether backward is being traced (``grad_scale``, a forward output beside the gradients, is a fake or
    functional tensor, as AOT autograd traces a backward) on a GPU (``GRAPHED_DEVICES``) for an Inductor compile
    with CUDA graphs on (``mode="reduce-overhead"`` or ``"max-autotune"``, or ``triton.cudagraphs`` in its options,
    which Inductor's config holds while it traces). Elsewhere no CUDA graph runs, and the in-place product costs no
    second buffer. One tensor asked: every eager backward asks too."""
    if not (isinstance(grad_scale, _TRACED_TYPES) and grad_scale.device.type in GRAPHED_DEVICES):
        return False
    config = sys.modules.get("torch._inductor.config")
    return config is not None and bool(config.triton.cudagraphs)


def scaled_gradients_body(grads: list[Tensor], grad_loss: Tensor, grad_scale: Tensor) -> list[Tensor]:
    """Each of ``grads`` times ``chunked.output_factor(grad_loss, grad_scale)``, each element rounded once, into new
    tensors (``grads`` are only read)."""
    if kernel_scales(grads, grad_loss, grad_scale):
        from .kernels.scale_grads import scale_all_into

        return scale_all_into(grads, grad_loss, post=grad_scale)
    g = output_factor(grad_loss, grad_scale)
    return [t * g for t in grads]  # fp32 on a GPU, or the CPU's fp32 read of g: one rounding


scaled_gradients_op = torch.library.custom_op("flce::scaled_gradients", mutates_args=())(scaled_gradients_body)


@scaled_gradients_op.register_fake
def _scaled_gradients_fake(grads, grad_loss, grad_scale):
    return [torch.empty_like(t) for t in grads]
