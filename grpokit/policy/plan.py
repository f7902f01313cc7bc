"""The memory plan: what each rank holds in each phase of a run, from the config and the model's shapes,
before the model loads (`grpokit plan`, and the block `grpokit train` prints; docs/memory.md).

    shapes = model_shapes(cfg.model)                    # AutoConfig + a model on the meta device
    plan = memory_plan(cfg, shapes, Setup(ranks=2, memory=16 * GIB))
    print(plan.table())                                 # bytes per rank per phase, the peak, the advice
    plan.refusal()                                      # None when it fits, else one line: what to change

Per rank, with P parameters of b bytes, T of them trained, W ranks (FSDP2 divides the first four by W):
- weights P b; pi_ref P b when beta > 0 without LoRA (LoRA's pi_ref is the adapter off); AdamW's two
  moments 2 T b once the first step ran; gradients T b in the update only (set to None after each step).
- rollout: the engine's whole copy (FSDP2 with fast / hf: P x the engine_copy dtype), its KV cache
  2 x layers x kv heads x head dim x rows x (prompt + completion) b, and the pi_old / pi_ref passes'
  temporaries; the larger of the two where the cache's memory is free by then (_cache_stays).
- update: the activations a micro-batch keeps for the backward (memory.py's per-token sizes: all of each
  layer without checkpointing; with it each layer's input), the attention masks of padded rows (sdpa keeps
  one [rows, 1, T, T] a layer), and without checkpointing a layer's worth of the backward's temporaries and
  the LM head's fp32 logits: chunks with the fused head, else the whole logits (_head says which
  temporaries come with them); with checkpointing the larger of the backward's two peaks: the last layer
  recomputed with its gradients, or the LM head with its weight's gradient. A sequence-parallel degree
  divides a rank's tokens (benchmarks/long_pass.py measures the training pass at SP = 2).
The prompt is counted at data.max_prompt_length: the plan bounds the longest rows the run allows.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from grpokit.algo.fused import chunk_rows
from grpokit.config import Config, ConfigError
from grpokit.config.sections import LoraConfig
from grpokit.policy.heap import MMAP_THRESHOLD_MAX
from grpokit.policy.loading import DTYPES, ModelLoadError, model_folder
from grpokit.policy.logprobs import FUSED_MIN_LOGITS
from grpokit.policy.memory import GIB, SHARE, cpu_memory_available, layer_sizes
from grpokit.policy.padding_free import packs

ROLLOUT, UPDATE = "rollout", "update"


@dataclass(frozen=True)
class Shapes:
    """What the plan needs of a model: its parameter counts and the sizes of its layers."""

    params: int  # every parameter (tied embeddings once), LoRA adapters included
    trained: int  # what AdamW steps: every parameter, or the LoRA adapters
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    element_size: int  # bytes of model.dtype
    max_positions: int | None = None
    heads: int = 0  # query heads (0: hidden // head_dim)


@dataclass(frozen=True)
class Setup:
    """Where the run goes: `ranks` processes under torchrun, a sequence-parallel degree `sp` (a prediction:
    each rank keeps 1/sp of a sequence's activations), `memory` bytes per rank."""

    ranks: int = 1
    sp: int = 1
    memory: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class Line:
    phase: str  # ROLLOUT or UPDATE
    name: str
    bytes: int
    counted: bool = True  # False: shown beside the counted line for comparison (checkpointing on / off)


@dataclass(frozen=True)
class MemoryPlan:
    lines: tuple[Line, ...]
    setup: Setup
    tokens: int  # the longest row: data.max_prompt_length + rollout.max_completion_length
    rows: int  # sequences in the largest micro-batch of a rank
    checkpointing: bool
    longest: int  # the longest rollout.max_completion_length whose plan fits (0: none does)
    advice: tuple[str, ...]  # settings that would make it fit, or leave more room

    def total(self, phase: str) -> int:
        return sum(line.bytes for line in self.lines if line.phase == phase and line.counted)

    @property
    def peak(self) -> int:
        return max(self.total(ROLLOUT), self.total(UPDATE))

    @property
    def peak_phase(self) -> str:
        return ROLLOUT if self.total(ROLLOUT) >= self.total(UPDATE) else UPDATE

    @property
    def fits(self) -> bool:
        return self.setup.memory <= 0 or self.peak <= self.setup.memory

    def table(self) -> str:
        return format_plan(self)

    def refusal(self) -> str | None:
        """None when the plan fits; else the one line that says by how much and what to change."""
        if self.fits:
            return None
        change = self.advice[0] if self.advice else "use a machine with more memory"
        return (
            f"memory plan: the {self.peak_phase} needs {_gib(self.peak)} per rank, more than the "
            f"{_gib(self.setup.memory)} available; {change} (`grpokit plan` shows the table; "
            "model.memory_check=false runs anyway)"
        )


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def memory_plan(cfg: Config, shapes: Shapes, setup: Setup | None = None) -> MemoryPlan:
    """The plan of `cfg` for a model of `shapes` on `setup` (default: one rank, memory unknown)."""
    setup = setup or Setup()
    lines, rows, tokens, checkpointing = plan_lines(cfg, shapes, setup)
    plan = MemoryPlan(tuple(lines), setup, tokens, rows, checkpointing, 0, ())
    return replace(plan, longest=longest_completion(cfg, shapes, setup), advice=advice(cfg, shapes, setup))


def plan_lines(cfg: Config, s: Shapes, setup: Setup) -> tuple[list[Line], int, int, bool]:
    """(the lines of both phases, micro-batch rows, tokens a row, whether the update checkpoints)."""
    shard = setup.ranks if setup.ranks > 1 and cfg.distributed.strategy == "fsdp2" else 1
    b = s.element_size
    beta = cfg.algorithm.beta > 0 and cfg.algorithm.ref_policy != "none"
    weights = s.params * b // shard
    state = [
        ("weights", weights),
        ("pi_ref (beta > 0)", weights if beta and cfg.model.lora is None else 0),
        ("AdamW moments", 2 * s.trained * b // shard),
    ]
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    rows = micro_rows(cfg, setup.ranks)
    rollout = [Line(ROLLOUT, name, n) for name, n in [*state, *engine_lines(cfg, s, setup, tokens, shard)]]
    update = [Line(UPDATE, name, n) for name, n in state]
    update.append(Line(UPDATE, "gradients", s.trained * b // shard))
    if shard > 1:  # FSDP2 gathers one decoder layer at a time, and the root's own parameters
        update.append(Line(UPDATE, "FSDP2 buffers (the root and 2 layers whole)", _fsdp_buffers(s)))
    # auto decides as policy/memory.py does: on rows x the longest row, against the memory left
    whole = activations(s, rows * -(-tokens // setup.sp))[0]
    left = setup.memory - sum(line.bytes for line in update)
    on = cfg.model.gradient_checkpointing is True or (
        cfg.model.gradient_checkpointing == "auto" and setup.memory > 0 and whole > SHARE * left
    )
    update += _activation_lines(cfg, s, setup, rows, shard, on)
    # pi_ref's (and under FSDP2 pi_old's) pass; with FSDP2 or checkpointing a plain one: logits sliced, copied
    # padded rows' mask, unless the pass runs one padding-free row (not when shared prompts are cheaper)
    shared = not on and shard == 1 and cfg.rollout.num_generations > 1
    mask = 0 if packs(cfg.model) and not shared else rows * tokens * -(-tokens // setup.sp) * b
    completions = rows * cfg.rollout.max_completion_length  # the positions that reach the LM head
    head = _head(s, completions, shard, backward=False, copied=(shard > 1 or on) and rows > 1)
    passes = head + rows * tokens * _layer_bytes(s) + mask if beta or shard > 1 else 0
    kv = next(line for line in rollout if line.name == "KV cache")
    if cfg.rollout.engine == "vllm" or _cache_stays(cfg, s, setup, tokens):
        rollout.append(Line(ROLLOUT, "log-prob passes (pi_old, pi_ref)", passes))
    else:  # the cache is freed when generate returns, before the passes run: the larger of the two
        rollout[rollout.index(kv)] = replace(kv, counted=kv.bytes >= passes)
        rollout.append(Line(ROLLOUT, "log-prob passes (pi_old, pi_ref)", passes, counted=passes > kv.bytes))
    return [*rollout, *update], rows, tokens, on


def _cache_stays(cfg: Config, s: Shapes, setup: Setup, tokens: int) -> bool:
    """Whether the fast / hf engine's KV cache still holds memory while the log-prob passes run. The engines
    free it when generate returns. A GPU's caching allocator hands those blocks to the passes; on the CPU,
    glibc returns a block to the OS only when it was mapped on its own (heap.MMAP_THRESHOLD_MAX and larger),
    so a cache whose per-layer buffers [rows, KV heads, tokens, head dim] are smaller stays resident
    (measured: SmolLM2 at 1k and 4k tokens, 4 rows, 3.3 and 12.8 MB buffers, the rollout held the cache
    and the passes together; a Llama's at 16k tokens, 67 MB buffers, the larger of the two)."""
    if setup.device != "cpu":
        return False
    rows = generation_rows(cfg, setup)
    return rows * s.kv_heads * tokens * s.head_dim * s.element_size < MMAP_THRESHOLD_MAX


def _activation_lines(cfg: Config, s: Shapes, setup: Setup, rows: int, shard: int, on: bool) -> list[Line]:
    """What the update's micro-batch adds: its activations (both choices, one counted), the attention masks,
    the backward's temporaries and the LM head's logits. Without checkpointing, in one process, each
    distinct prompt runs once and its G completions on its KV cache (logprobs.shared_prompt_logits): the
    activations of rows x completion + prompts x prompt tokens, the logits of the completions only."""
    prompt, completion = cfg.data.max_prompt_length, cfg.rollout.max_completion_length
    shared = not on and shard == 1 and cfg.rollout.num_generations > 1
    queries = completion if shared else prompt + completion  # positions a row runs (and predicts from)
    prompts = -(-rows // cfg.rollout.num_generations) if shared else 0
    n = -(-(rows * queries + prompts * prompt) // setup.sp)  # tokens a rank runs through the layers
    whole, kept = activations(s, n)
    logits = rows * completion  # only the positions that predict a completion token reach the LM head
    copied = not shared and rows > 1  # the plain pass's logits [N, T + 1, V], sliced to T and copied whole
    b = s.element_size
    # sdpa keeps the padded rows' mask [rows, 1, queries, keys] once a layer for the backward, built once;
    # padding-free rows have none (at the longest rows, shared prompts cost less: those run padded)
    mask = (
        0 if packs(cfg.model) and not shared else rows * -(-queries // setup.sp) * (prompt + completion) * b
    )
    head = _head(s, -(-logits // setup.sp), shard, backward=True, copied=copied)
    lines = [
        Line(UPDATE, "activations, checkpointing off", whole, counted=not on),
        Line(UPDATE, "activations, checkpointing every layer", kept, counted=on),
        Line(UPDATE, "attention masks (padded rows)", (2 if on else s.layers + 1) * mask),
        Line(
            UPDATE, "LoRA adapters' outputs", n * _adapter_outputs(s) * b if cfg.model.lora is not None else 0
        ),
    ]
    if not on:
        return [
            *lines,
            Line(UPDATE, "backward's temporaries (a layer)", n * _layer_bytes(s)),
            Line(UPDATE, "LM head (logits)", head),
        ]
    # With checkpointing the backward's peak is one of two moments that do not coexist: the LM head's (its
    # logits' chunks, and its weight's gradient where it trains), or the last layer recomputed, what it
    # saves, with its backward's gradients (_layer_backward_bytes)
    head += s.vocab * s.hidden * b if s.trained == s.params else 0
    layer = n * _layer_backward_bytes(s, setup.sp)
    return [
        *lines,
        Line(UPDATE, "a layer recomputed, and its gradients", layer, counted=layer >= head),
        Line(UPDATE, "LM head (logits)", head, counted=head > layer),
    ]


def micro_rows(cfg: Config, ranks: int) -> int:
    """Sequences in a rank's largest micro-batch: micro_batch_size, within the rank's share of a minibatch;
    with optim.max_tokens_per_micro_batch, as many sequences of the longest length as the budget holds (at
    least one: a longer sequence runs alone)."""
    share = -(-cfg.minibatch_size // ranks)
    if budget := cfg.optim.max_tokens_per_micro_batch:
        return max(1, min(share, budget // (cfg.data.max_prompt_length + cfg.rollout.max_completion_length)))
    return max(1, min(cfg.micro_batch_size, share))


def automatic_budget(cfg: Config, shapes: Shapes, setup: Setup) -> int:
    """The token budget a run that sets neither micro-batch key gets (optim.max_tokens_per_micro_batch, 0
    = none): none while the whole minibatch fits setup.memory, else the largest budget of k longest
    sequences whose plan fits (the same gradient, in more forwards), or none when not even one fits (the
    plan's refusal then says what to change)."""
    if cfg.optim.micro_batch_size or cfg.optim.max_tokens_per_micro_batch or _fits(cfg, shapes, setup):
        return 0
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    for k in range(micro_rows(cfg, setup.ranks) - 1, 0, -1):
        if _fits(_with(cfg, "optim", max_tokens_per_micro_batch=k * tokens), shapes, setup):
            return k * tokens
    return 0


def engine_lines(cfg: Config, s: Shapes, setup: Setup, tokens: int, shard: int) -> list[tuple[str, int]]:
    """The rollout engine's own memory: its whole copy of the weights and its KV cache."""
    r = cfg.rollout
    if r.engine == "vllm":
        if setup.device == "cuda":
            return [("vLLM's share of the GPU", int(r.vllm_gpu_memory_utilization * setup.memory))]
        rows = -(-cfg.rollout_batch_size // setup.ranks)
        kv = r.vllm_kv_cache_mb << 20 or max(rows * tokens, 256) * _kv_bytes_per_token(s)
        return [("vLLM's weights", s.params * s.element_size), ("KV cache", kv)]
    copy = s.params * (2 if cfg.distributed.engine_copy == "bf16" else 4) if shard > 1 else 0
    rows = generation_rows(cfg, setup)
    return [("engine's whole copy (FSDP2)", copy), ("KV cache", rows * tokens * _kv_bytes_per_token(s))]


def generation_rows(cfg: Config, setup: Setup) -> int:
    """Sequences a rank's fast / hf engine generates at once: rollout.generation_batch_size, else its whole
    share of the rollout batch."""
    return cfg.rollout.generation_batch_size or -(-cfg.rollout_batch_size // setup.ranks)


def _kv_bytes_per_token(s: Shapes) -> int:
    return 2 * s.layers * s.kv_heads * s.head_dim * s.element_size  # keys and values of every layer


def _layer_bytes(s: Shapes) -> int:
    return layer_sizes(s.hidden, s.intermediate, s.layers, s.vocab, s.element_size, 1).layer


def activations(s: Shapes, tokens: int) -> tuple[int, int]:
    """(bytes a micro-batch of `tokens` tokens in all keeps for the backward without checkpointing, with it
    on every layer: each layer's input, and the final norm's input and output; the layer the backward
    recomputes is counted with its gradients, in _activation_lines)."""
    sizes = layer_sizes(s.hidden, s.intermediate, s.layers, s.vocab, s.element_size, tokens)
    embeddings = 2 * s.hidden * s.element_size  # the embeddings' output and the final norm's input
    return (
        tokens * (s.layers * sizes.layer + embeddings),
        tokens * (s.layers * sizes.layer_input + embeddings),
    )


def _recomputed_layer_bytes(s: Shapes) -> int:
    """What a decoder layer saves for its backward, a token, beyond its input: measured on SmolLM2's layer
    with torch's saved-tensor hooks (42,796 B a token, parameters left out): 7 hidden-sized tensors (the
    norms' outputs, the second norm's input, the rotated queries, the keys and values repeated to every
    head, the attention's output), the keys and values before their repetition, the rotary cos and sin,
    and 4 MLP-sized ones (gate, up, the activation, the product)."""
    kv = s.kv_heads * s.head_dim
    return (7 * s.hidden + 2 * kv + 2 * s.head_dim + 4 * s.intermediate) * s.element_size


def _layer_backward_bytes(s: Shapes, sp: int = 1) -> int:
    """A token's bytes at the peak of a checkpointed decoder layer's recomputation and backward: what it
    saves, and at the MLP's backward the gradients of 2 MLP-sized and 2 hidden-sized tensors (measured alone,
    torch's profiler over one layer, benchmarks/layer_backward.py: 36,117 and 35,928 B a token on a Llama of
    hidden 256 and MLP 1,024 at 4,160 and 16,448 tokens, this formula 36,352; 60,032 and 59,395 B on
    SmolLM2's layer, this 59,648). Over sp > 1 sequence ranks the attention's backward also holds the
    all-to-all's send and receive buffers of the query, key and value gradients (heads padded to a multiple
    of sp, keys and values repeated as distributed/sequence.py does: SmolLM2's 9 heads become 10 over 2
    ranks)."""
    own = _recomputed_layer_bytes(s) + 2 * (s.intermediate + s.hidden) * s.element_size
    if sp <= 1:
        return own
    heads = s.heads or s.hidden // s.head_dim
    if heads % sp:
        q = kv = heads + -heads % sp
    else:
        q, kv = heads, s.kv_heads * (sp // math.gcd(s.kv_heads, sp))
    return own + 2 * (q + 2 * kv) * s.head_dim * s.element_size


def _head(s: Shapes, tokens: int, shard: int, *, backward: bool, copied: bool = False) -> int:
    """The LM head's fp32 logits for `tokens` positions at their peak. The fused head (one process, or DDP,
    from FUSED_MIN_LOGITS on) holds 4 chunks' worth in the training forward (a chunk's logits, logsumexp's
    temporary, the entropy's log-softmax and exp: measured 4.1 chunks, 2.1 without the entropy, 2.9 in the
    backward), 2 in a pass without gradient. Else the whole logits (twice when `copied`: the
    plain pass slices them, and reshaping the slice copies it) and the same 4 temporaries per chunk of
    ops.token_logprobs' 1,024 rows; in the backward the saved logits, the gradient they accumulate and a
    chunk's zero-filled gradient, each whole, and a chunk. No gradient: logsumexp's 2 temporaries."""
    logits = tokens * s.vocab * 4
    if shard == 1 and tokens * s.vocab >= FUSED_MIN_LOGITS:
        return (4 if backward else 2) * chunk_rows(s.vocab) * s.vocab * 4
    chunk = min(tokens, 1024) * s.vocab * 4
    whole = (2 if copied else 1) * logits
    if not backward:
        return whole + 2 * chunk
    return max(whole + 4 * chunk, whole + 2 * logits + chunk)


def _adapter_outputs(s: Shapes) -> int:
    """Values a token's LoRA adapters output in a forward (all-linear: q, k, v, o, gate, up and down of every
    layer), each a [tokens, out] tensor beside the base layer's: freed in the forward, but in blocks below
    glibc's mmap threshold that its heap keeps (measured: 90 MiB more than the full model's forward at 1,280
    tokens on the benchmark's tiny Llama, against 68 MiB here)."""
    return s.layers * (3 * s.hidden + 2 * s.kv_heads * s.head_dim + 2 * s.intermediate)


def _fsdp_buffers(s: Shapes) -> int:
    """FSDP2's unsharded buffers in the update: the root's own parameters (embeddings, final norm, an untied
    head) and two decoder layers (one computing, the next prefetched), each all-gathered whole (1x) from a
    copied-in shard (1/2x, at 2 ranks), and where they train their whole gradients (1x) and the flat copy
    the reduce-scatter sends (1x)."""
    layer = 2 * s.hidden * s.hidden + 2 * s.hidden * s.kv_heads * s.head_dim + 3 * s.hidden * s.intermediate
    whole = (s.params - s.layers * layer + 2 * layer) * s.element_size
    trained = 2.0 if s.trained == s.params else 0.0
    return int(whole * (1.5 + trained))


def _peak(cfg: Config, shapes: Shapes, setup: Setup) -> int:
    lines = plan_lines(cfg, shapes, setup)[0]
    return max(sum(x.bytes for x in lines if x.phase == phase and x.counted) for phase in (ROLLOUT, UPDATE))


def _with(cfg: Config, section: str, **values) -> Config:
    """cfg with `section`.key=value for each of `values` (no validation: a plan's what-if)."""
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})


def longest_completion(cfg: Config, shapes: Shapes, setup: Setup) -> int:
    """The longest rollout.max_completion_length whose plan fits setup.memory (0: none; with no memory
    given, the model's positions less the prompt)."""
    prompt = cfg.data.max_prompt_length
    top = (shapes.max_positions or 1 << 20) - prompt
    if top < 1:
        return 0
    if setup.memory <= 0:
        return top

    def fits(t: int) -> bool:
        return _peak(_with(cfg, "rollout", max_completion_length=t), shapes, setup) <= setup.memory

    if not fits(1):
        return 0
    lo, hi = 1, top  # fits(lo); the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def advice(cfg: Config, shapes: Shapes, setup: Setup) -> tuple[str, ...]:
    """Settings that fit setup.memory when the config does not, the cheapest first (each with its peak);
    when it fits, the settings that leave the most room for longer completions."""
    fits = setup.memory <= 0 or _peak(cfg, shapes, setup) <= setup.memory
    out = []
    for change, peak in _candidates(cfg, shapes, setup):
        if fits or setup.memory <= 0 or peak <= setup.memory:
            out.append(f"{change} (peak {_gib(peak)})")
    if not fits and not out:
        longest = longest_completion(cfg, shapes, setup)
        if longest:
            out.append(f"rollout.max_completion_length={longest} (the longest that fits)")
    return tuple(out)


def _candidates(cfg: Config, shapes: Shapes, setup: Setup) -> list[tuple[str, int]]:
    """(a change, the peak it gives) for each setting that lowers the peak: checkpointing, a smaller
    micro-batch (the token budget), a smaller generation batch, LoRA, more ranks, sequence parallelism."""
    out = []
    if cfg.model.gradient_checkpointing is not True:
        on = _with(cfg, "model", gradient_checkpointing=True)
        out.append(("model.gradient_checkpointing=true", _peak(on, shapes, setup)))
    if not packs(cfg.model):  # no padded rows, no [rows, 1, T, T] masks
        free = _with(cfg, "model", padding_free=True)
        out.append(("model.padding_free=true", _peak(free, shapes, setup)))
    rows = micro_rows(cfg, setup.ranks)
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    budget = cfg.optim.max_tokens_per_micro_batch  # set: a smaller budget; else fewer rows
    for k in sorted((k for k in range(1, rows) if budget or cfg.minibatch_size % k == 0), reverse=True):
        smaller = _with(
            cfg,
            "optim",
            **({"max_tokens_per_micro_batch": k * tokens} if budget else {"micro_batch_size": k}),
        )
        if setup.memory <= 0 or _peak(smaller, shapes, setup) <= setup.memory or k == 1:
            change = (
                f"optim.max_tokens_per_micro_batch={k * tokens}"
                if budget
                else f"optim.micro_batch_size={k} (a token budget of {k * tokens} tokens a micro-batch)"
            )
            out.append((change, _peak(smaller, shapes, setup)))
            break
    gen = generation_rows(cfg, setup)
    if gen > cfg.rollout.num_generations and cfg.rollout.engine != "vllm":
        fewer = _with(cfg, "rollout", generation_batch_size=cfg.rollout.num_generations)
        out.append(
            (f"rollout.generation_batch_size={cfg.rollout.num_generations}", _peak(fewer, shapes, setup))
        )
    if cfg.model.lora is None:
        lora = replace(shapes, trained=lora_parameters_estimate(shapes, 16))
        lora_cfg = _with(cfg, "model", lora=LoraConfig(r=16))
        out.append(("model.lora.r=16 (LoRA adapters instead of every weight)", _peak(lora_cfg, lora, setup)))
    for ranks in (2, 4, 8):
        if ranks > setup.ranks and cfg.distributed.strategy == "fsdp2":
            out.append((f"{ranks} ranks (torchrun, FSDP2)", _peak(cfg, shapes, replace(setup, ranks=ranks))))
            break
    for sp in (2, 4, 8):
        if sp > setup.sp:  # on a multiple of sp ranks: torchrun's world is data x sequence ranks
            ranks = sp * -(-setup.ranks // sp)
            split = replace(setup, sp=sp, ranks=ranks)
            change = f"distributed.sequence_parallel={sp} (each sequence split over {sp} of {ranks} ranks)"
            out.append((change, _peak(cfg, shapes, split)))
            break
    out.append(_together(cfg, shapes, setup))
    return [(change, peak) for change, peak in out if peak < _peak(cfg, shapes, setup)]


def _together(cfg: Config, shapes: Shapes, setup: Setup) -> tuple[str, int]:
    """The settings that cost no quality together: checkpointing, padding-free rows, one prompt's group a
    generate call, and the largest micro-batch that fits with them (1 when none does)."""
    keys = {
        ("model", "gradient_checkpointing"): True,
        ("model", "padding_free"): True,
        ("rollout", "generation_batch_size"): cfg.rollout.num_generations,
    }
    for (section, key), value in keys.items():
        cfg = _with(cfg, section, **{key: value})
    rows = micro_rows(cfg, setup.ranks)
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    # the micro-batch in the key the config sizes it by: tokens (a budget of k longest sequences) or rows
    by = "max_tokens_per_micro_batch" if cfg.optim.max_tokens_per_micro_batch else "micro_batch_size"
    sizes = [k * tokens if by != "micro_batch_size" else k for k in range(rows, 0, -1)]
    sizes = [n for n in sizes if by != "micro_batch_size" or cfg.minibatch_size % n == 0]
    size = next((n for n in sizes if _fits(_with(cfg, "optim", **{by: n}), shapes, setup)), sizes[-1])
    cfg = _with(cfg, "optim", **{by: size})
    change = " ".join(f"{section}.{key}={str(v).lower()}" for (section, key), v in keys.items())
    return f"{change} optim.{by}={size}", _peak(cfg, shapes, setup)


def _fits(cfg: Config, shapes: Shapes, setup: Setup) -> bool:
    return setup.memory <= 0 or _peak(cfg, shapes, setup) <= setup.memory


def lora_parameters_estimate(s: Shapes, r: int) -> int:
    """LoRA's adapters on every linear of every decoder layer (all-linear): r x (in + out) each."""
    attention = 2 * (s.hidden + s.hidden) + 2 * (s.hidden + s.kv_heads * s.head_dim)  # q, o; k, v
    mlp = 3 * (s.hidden + s.intermediate)  # gate, up, down
    return r * s.layers * (attention + mlp)


def model_shapes(model_cfg) -> Shapes:
    """The Shapes of model.name_or_path, from its config and a copy of the model on the meta device (no
    weights read, no memory taken); LoRA adapters counted as peft adds them (r x (in + out) a targeted
    linear). A GGUF file is converted once first (policy/gguf.py), as loading it would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not model_cfg.name_or_path:
        raise ModelLoadError(
            "model.name_or_path is empty: set it to a Hugging Face model id or a local folder"
        )
    folder = model_folder(model_cfg.name_or_path, "model.name_or_path")
    remote = model_cfg.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=remote)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=remote, dtype=DTYPES[model_cfg.dtype]
            )
    except (OSError, ValueError, KeyError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"model.name_or_path={model_cfg.name_or_path!r}: its config does not say its shapes ({line})"
        ) from None
    params = sum(p.numel() for p in model.parameters())  # a tied head is the embeddings' parameter: once
    adapters = 0 if model_cfg.lora is None else lora_parameters(model, model_cfg.lora)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if not hasattr(text, k)]
    if missing:  # a recurrent model (Mamba): no attention to plan for
        raise ModelLoadError(
            f"model.name_or_path={model_cfg.name_or_path!r}: its config has no {missing[0]}, which the "
            "memory plan needs (it plans attention models)"
        )
    hidden = text.hidden_size
    heads = text.num_attention_heads
    return Shapes(
        params=params + adapters,
        trained=adapters or params,
        hidden=hidden,
        intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
        layers=text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        vocab=text.vocab_size,
        element_size=torch.empty((), dtype=DTYPES[model_cfg.dtype]).element_size(),
        max_positions=getattr(text, "max_position_embeddings", None),
        heads=heads,
    )


def lora_parameters(model: torch.nn.Module, lora_cfg) -> int:
    """The parameters peft's LoRA adds to `model` (on any device): r x (in + out) for each Linear that
    lora.target_modules names (all-linear: every Linear but the output embeddings)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    targets = lora_cfg.target_modules
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if targets == "all-linear" or any(name == t or name.endswith(f".{t}") for t in targets):
            total += lora_cfg.r * (module.in_features + module.out_features)
    return total


def format_plan(plan: MemoryPlan) -> str:
    """The plan as text: one line per item and phase (MiB), the totals, the peak, the longest completion that
    fits and the advice."""
    s = plan.setup
    where = f"{s.ranks} rank{'s' if s.ranks > 1 else ''}" + (
        f", sequence parallel {s.sp}" if s.sp > 1 else ""
    )
    memory = _gib(s.memory) if s.memory > 0 else "unknown"
    out = [
        f"memory plan per rank ({where}; {plan.rows} sequences x {plan.tokens} tokens a micro-batch; "
        f"{memory} available)",
        f"  {'':46}{'rollout':>12}{'update':>12}",
    ]
    names = list(dict.fromkeys(line.name for line in plan.lines))
    for name in names:
        cells = []
        for phase in (ROLLOUT, UPDATE):
            line = next((x for x in plan.lines if x.name == name and x.phase == phase), None)
            cells.append("" if line is None else _mib(line.bytes) + ("" if line.counted else "*"))
        if any(c not in ("", "0 MiB") for c in cells):
            out.append(f"  {name:46}{cells[0]:>12}{cells[1]:>12}")
    out.append(f"  {'total':46}{_mib(plan.total(ROLLOUT)):>12}{_mib(plan.total(UPDATE)):>12}")
    out.append(
        "  (* not counted: the other checkpointing choice; the smaller of two peaks that do not coexist)"
    )
    verdict = "fits" if plan.fits else "does NOT fit"
    out.append(f"peak {_gib(plan.peak)} in the {plan.peak_phase}: {verdict}")
    if s.memory > 0:
        out.append(f"longest completion that fits: {plan.longest} tokens (rollout.max_completion_length)")
    if plan.advice:
        out.append("to fit or leave more room: " + "; ".join(plan.advice))
    return "\n".join(out)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def available_memory(ranks: int) -> tuple[int, str]:
    """(bytes each rank may take, the device): a CUDA device's free memory, or this machine's available
    memory shared by the `ranks` processes on it (memory.cpu_memory_available)."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0], "cuda"
    return cpu_memory_available() // ranks, "cpu"


def summary(plan: MemoryPlan) -> str:
    """The compact block `grpokit train` prints: totals per phase, the peak against the memory, the longest
    completion that fits."""
    memory = f" of {_gib(plan.setup.memory)} available" if plan.setup.memory > 0 else ""
    lines = [
        f"memory plan per rank: rollout {_gib(plan.total(ROLLOUT))}, update {_gib(plan.total(UPDATE))} "
        f"({plan.rows} sequences x {plan.tokens} tokens a micro-batch, checkpointing "
        f"{'on' if plan.checkpointing else 'off'}); peak {_gib(plan.peak)}{memory}",
    ]
    if plan.setup.memory > 0:
        lines.append(f"  longest completion that fits: {plan.longest} tokens; `grpokit plan` shows each item")
    return "\n".join(lines)


def machine_setup(cfg: Config, ranks: int) -> Setup:
    """The run's Setup on this machine: its ranks, the config's sequence-parallel degree, the memory each
    of torchrun's local ranks (LOCAL_WORLD_SIZE) may take."""
    memory, device = available_memory(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return Setup(ranks=ranks, sp=cfg.distributed.sequence_parallel, memory=memory, device=device)


def with_automatic_budget(cfg: Config, ranks: int) -> tuple[Config, str | None]:
    """cfg with the automatic token budget (automatic_budget) on this machine, and the line that says so;
    (cfg, None) when it needs none, sets a micro-batch key itself, turned model.memory_check off, or has a
    model whose config cannot be read."""
    if not cfg.model.memory_check or cfg.optim.micro_batch_size or cfg.optim.max_tokens_per_micro_batch:
        return cfg, None
    try:
        shapes = model_shapes(cfg.model)
    except ModelLoadError:
        return cfg, None
    setup = machine_setup(cfg, ranks)
    budget = automatic_budget(cfg, shapes, setup)
    if not budget:
        return cfg, None
    whole, rows = _peak(cfg, shapes, setup), micro_rows(cfg, ranks)
    cfg = _with(cfg, "optim", max_tokens_per_micro_batch=budget)
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    return cfg, (
        f"optim.max_tokens_per_micro_batch: {budget} tokens a micro-batch ({budget // tokens} sequences of "
        f"up to {tokens} tokens), chosen by the memory plan: the whole minibatch ({rows} sequences a "
        f"rank) would need {_gib(whole)} of the {_gib(setup.memory)} available; the same gradient in "
        "more forwards (set optim.micro_batch_size or max_tokens_per_micro_batch to choose)"
    )


def check_memory(cfg: Config, ranks: int, *, echo: bool = True) -> MemoryPlan | None:
    """The run's plan on this machine (its ranks: torchrun's LOCAL_WORLD_SIZE), before its model loads:
    printed (`echo`), and a ConfigError naming what to change when it does not fit and model.memory_check is
    on. None when the model's config cannot be read (loading it then says why)."""
    try:
        shapes = model_shapes(cfg.model)
    except ModelLoadError:  # a model that cannot be read: the loader's own line says why, next
        return None
    plan = memory_plan(cfg, shapes, machine_setup(cfg, ranks))
    if echo:
        print(summary(plan), flush=True)
    line = plan.refusal()
    if line is not None and cfg.model.memory_check:
        raise ConfigError(line)
    return plan
