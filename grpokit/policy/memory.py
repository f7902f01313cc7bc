"""model.gradient_checkpointing=auto: recompute activations only when a micro-batch would not fit without.

    plan = checkpointing_plan(model, rows=32, tokens=296)   # None: it fits; else which layers to checkpoint
    if plan is not None:
        enable_checkpointing(model, plan.every_n_layers)

The training pass keeps every decoder layer's activations for the backward: about 12 x hidden + 5 x
intermediate values a token a layer (the norms' inputs and outputs, q / k / v and the rotated q / k, the
attention output, the MLP's gate, up, activation and product). For SmolLM2-135M in fp32 that is 1.7 MB a
token, so a micro-batch of 32 completions of 256 tokens keeps about 14 GB (docs/performance.md). A
checkpointed layer keeps its input only and runs its forward again in the backward. The plan checkpoints
every n-th layer, with the largest n whose activations fit SHARE of the memory left (n = 1: every layer),
so the recompute costs no more than the memory asks. The memory left is read once the run is built
(weights, pi_ref and the engine in place), less the gradients and AdamW's two moments that the first step
allocates.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.policy.logprobs import FUSED_MIN_LOGITS

#: checkpoint when the activations would take more than this share of the memory left: the backward's own
#: temporaries (activation gradients, a recomputed layer, the logits' chunks) and the allocator need the rest
SHARE = 0.5

GIB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """Checkpoint every `every_n_layers`-th decoder layer: a micro-batch of `rows` x `tokens` would keep
    `whole` bytes of activations without, `kept` with, against `left` bytes left."""

    every_n_layers: int
    rows: int
    tokens: int
    whole: int
    kept: int
    left: int

    def __str__(self) -> str:
        which = (
            "every decoder layer" if self.every_n_layers == 1 else f"1 decoder layer in {self.every_n_layers}"
        )
        return (
            f"checkpointing {which}: a micro-batch of {self.rows} sequences x {self.tokens} tokens would "
            f"keep about {self.whole / GIB:.1f} GiB of activations, more than {SHARE:.0%} of the "
            f"{self.left / GIB:.1f} GiB left; now about {self.kept / GIB:.1f} GiB"
        )


@dataclass(frozen=True)
class Sizes:
    """What one token keeps in one decoder layer (bytes): all of it, or its input only (checkpointed)."""

    layers: int
    layer: int
    layer_input: int
    logits: int  # the logits, their log-softmax and its gradient of the whole micro-batch (below the fused
    # path's threshold; above it the head runs in chunks)

    def kept(self, rows: int, tokens: int, checkpointed: int) -> int:
        per_token = (self.layers - checkpointed) * self.layer + checkpointed * self.layer_input
        return rows * tokens * per_token + self.logits


def sizes(model, rows: int, tokens: int) -> Sizes | None:
    """The model's activation sizes from its config; None when the config does not say them."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return None
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    vocab = getattr(config, "vocab_size", 0) or 0
    size = next(model.parameters()).element_size()
    return layer_sizes(hidden, intermediate, layers, vocab, size, rows * tokens)


def layer_sizes(hidden: int, intermediate: int, layers: int, vocab: int, size: int, tokens: int) -> Sizes:
    """Sizes of a decoder of `layers` layers of width `hidden` (MLP `intermediate`) in `size`-byte elements,
    for a micro-batch of `tokens` tokens in all (the logits' part: below the fused head's threshold)."""
    logits = 3 * min(tokens * vocab, FUSED_MIN_LOGITS) * 4
    return Sizes(layers, (12 * hidden + 5 * intermediate) * size, hidden * size, logits)


def memory_left(model) -> int:
    """Bytes the training pass can still take on the model's device: CUDA's free memory plus the blocks its
    allocator holds free; on the CPU the machine's available memory, shared by the ranks on it; less the
    gradients and AdamW's two moments of the trainable parameters, which the first step allocates."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        left = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        left = cpu_memory_available() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainable = sum(_local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(left - 3 * trainable, 0)


def cpu_memory_available() -> int:
    """Bytes the machine can still give this process: Linux's MemAvailable, within a cgroup (v2) limit where
    one is set; elsewhere the physical memory (an upper bound)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if "MemAvailable" in line)
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own elements (FSDP2: this rank's shard)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def checkpointing_plan(model, rows: int, tokens: int, left: int | None = None) -> Plan | None:
    """None when a micro-batch of `rows` sequences of `tokens` tokens keeps at most SHARE of the memory left
    (`left`, default memory_left(model)) in activations, or when the model's sizes are unknown; else the
    Plan with the fewest checkpointed layers that fits (every layer when none does, or when the installed
    transformers checkpoints every layer only)."""
    s = sizes(model, rows, tokens)
    if s is None:
        return None
    left = memory_left(model) if left is None else left
    whole = s.kept(rows, tokens, 0)
    if whole <= SHARE * left:
        return None

    def kept(n: int) -> int:  # checkpointing 1 layer in n: layers 0, n, 2n, ...
        return s.kept(rows, tokens, math.ceil(s.layers / n))

    widest = s.layers if _every_n_layers_supported(model) else 1
    n = next((n for n in range(widest, 0, -1) if kept(n) <= SHARE * left), 1)
    return Plan(n, rows, tokens, whole, kept(n), left)


def _every_n_layers_supported(model) -> bool:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    return enable is not None and "every_n_layers" in inspect.signature(enable).parameters
