"""model.release_freed_memory: what a checkpointed CPU pass frees goes back to the OS between decoder layers.

glibc's malloc serves a block below its mmap threshold from its heaps, and the threshold rises with each free
of a larger mmapped block, up to 32 MiB: soon every activation of a layer comes from a heap. What is freed
there stays resident. A checkpointed pass allocates and frees each layer's activations with the layer's
output (the next checkpoint) left among the holes, so the heap fragments and grows by a layer's worth at a
time. On SmolLM2-135M's training pass over one row of 4,160 tokens the process held 2,194 MiB above its
weights for 636 MiB of tensors at their peak; calling malloc_trim(0) after each checkpointed layer's forward
and before its backward, 759 MiB (benchmarks/results/long_pass.md).

Within a layer too: where a layer's tensors are below the threshold (two sequence ranks at 16k tokens: half a
row's hidden states, 19 MB), the recomputation and backward of one layer left 350-420 MiB of freed heap
resident a rank. So the layer's attention and MLP (its children that hold modules) trim as well: after their
forward and before their backward. The backward's recomputation of a layer stops at the last tensor it needs
(torch's early stop), after its attention's forward and before the MLP's and the layer's ends.

What it costs is the pages' faults when the heap reuses them (the same benchmark, on against off): 5% of the
pass at 4k tokens on one process and 12% on two sequence ranks, 26-34% at 1k tokens, nothing measured at 16k
tokens on two sequence ranks against trimming between layers only. It acts only where the memory is the
constraint: on the CPU, in passes with a gradient, on layers that checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import torch


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is another (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = malloc_trim()

#: glibc's largest mmap threshold on 64-bit: a block this large or larger is always mapped on its own, and
#: goes back to the OS when freed; a smaller one may come from a heap, where it stays resident once freed
MMAP_THRESHOLD_MAX = 32 << 20

#: set on a decoder layer whose hooks are registered
HOOKED = "_grpokit_releases_freed_memory"


def release_between_layers(model) -> bool:
    """Return the freed heap to the OS after the forward and before the backward of each checkpointed decoder
    layer (the model's transformers decoder layers: GradientCheckpointingLayer) and of its attention and MLP.
    Whether it could: a CPU model under glibc. Registered once a layer; a layer that does not checkpoint is
    left alone."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.54: no common class for its decoder layers
        return False
    param = next(model.parameters(), None)
    if _TRIM is None or param is None or param.device.type != "cpu":
        return False
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and not getattr(layer, HOOKED, False):
            setattr(layer, HOOKED, True)
            parts = [child for child in layer.children() if next(child.children(), None) is not None]
            for part in [*parts, layer]:  # attention and MLP (not the norms), then the layer
                part.register_forward_hook(functools.partial(_after_forward, layer))
    return True


def _after_forward(layer, module, args, output) -> None:
    if not (layer.training and torch.is_grad_enabled() and getattr(layer, "gradient_checkpointing", False)):
        return  # pi_old / pi_ref passes, generation, layers that keep their activations
    trim()
    out = output[0] if isinstance(output, tuple) else output
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(_before_backward)


def _before_backward(grad: torch.Tensor) -> None:
    trim()


def trim() -> None:
    if _TRIM is not None:
        _TRIM(0)
