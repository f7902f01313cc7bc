"""The `fast` engine in a process of its own: the sampler of asynchronous rollouts on a CPU
(rollout.async_sampler).

    engine = ProcessEngine(model, tokenizer, batch_size=0, threads=1)   # spawns the child; it copies the
                                                                        # model
    comps = engine.generate(prompt_ids, n=8, sampling=sampling)         # the child generates; texts decoded
                                                                        # here
    engine.sync_weights(model, version=3)                               # the weights cross in shared memory

Why: a sampler thread overlaps training only when torch's ops are large enough to run without Python's GIL; a
small model on a CPU is thousands of tiny ops, and a thread then mostly takes turns with the trainer
(docs/rollout.md has the numbers). A process has its own interpreter, so generation and training really run
side by side, as with a `grpokit serve` server for vLLM.

What crosses the pipe: requests (prompt ids, n, sampling parameters, a seed) and replies (token ids,
log-probs, finish reasons) as plain lists, the kept sets (top-k / top-p) as tensors; weights as tensors, which
torch.multiprocessing moves through shared memory (each push is one copy of the state dict). Seeds: each
generate call draws one seed from sampling.generator (or torch's global generator) and the child samples with
a generator seeded with it, so the run's seed decides the samples. The child is started with spawn, holds its
own copy of the model, runs `threads` torch threads, and stops when this object is closed or garbage-collected
(its end of the pipe closes) or the parent dies (daemon).
"""

from __future__ import annotations

import copy
import traceback
import weakref
from dataclasses import replace
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.hf import eos_token_ids
from grpokit.rollout.vllm import draw_seed


def _attention(model) -> tuple[str, Any, Any] | None:
    """(name, attention function, mask function) of the model's attention implementation, as transformers'
    registries hold them in this process. A run-time registration (grpokit_sdpa, where padding-free rows are
    on) lives only in the process that made it: the child registers the same functions under the same name
    (they cross the pipe by reference, so unpickling them imports the module that defines them)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if isinstance(impl, str) and impl in ALL_ATTENTION_FUNCTIONS and impl in ALL_MASK_ATTENTION_FUNCTIONS:
        return impl, ALL_ATTENTION_FUNCTIONS[impl], ALL_MASK_ATTENTION_FUNCTIONS[impl]
    return None


def _child(conn, model, tokenizer, batch_size: int, threads: int, attention=None) -> None:
    """The child's loop: ("sync", state) | ("generate", prompt_ids, n, sampling, seed) | ("stop",) ->
    replies."""
    from grpokit.rollout.fast import FastEngine

    if attention is not None:
        name, forward, mask = attention
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, mask)
    torch.set_num_threads(threads)
    model = copy.deepcopy(model)  # storage of its own: nothing the parent writes later reaches it
    engine = FastEngine(model, tokenizer, batch_size=batch_size)
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent closed its end or died
            return
        if msg[0] == "stop":
            return
        try:
            if msg[0] == "sync":
                with torch.no_grad():
                    model.load_state_dict(msg[1])
                conn.send(("ok", None))
            else:
                _, prompt_ids, n, sampling, seed = msg
                gen = torch.Generator().manual_seed(seed)
                comps = engine.generate(prompt_ids, n, replace(sampling, generator=gen))
                conn.send(("ok", (comps.token_ids, comps.logprobs, comps.finish_reasons, comps.kept)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class ProcessEngine(RolloutEngine):
    """A FastEngine in a child process, behind the engine interface (generate, sync_weights)."""

    caps = EngineCaps(sampling_logprobs=True, stop_sequences=True, own_process=True, kept_sets=True)

    @classmethod
    def from_config(cls, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None):
        """The engine of a run (grpokit/rollout/engines.py: make_engine)."""
        return cls(model, tokenizer, batch_size=batch_size, threads=torch.get_num_threads())

    def __init__(self, model, tokenizer, *, batch_size: int = 0, threads: int = 1):
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(model, tokenizer)  # what a ToolRollout around this engine stops turns at
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        model = copy.deepcopy(model).cpu().eval()
        self._proc = ctx.Process(
            target=_child,
            args=(child, model, tokenizer, batch_size, threads, _attention(model)),
            daemon=True,
            name="grpokit-sampler-process",
        )
        self._proc.start()
        child.close()
        self._closer = weakref.finalize(self, _stop, self._conn, self._proc)

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        seed = draw_seed(sampling)
        token_ids, logprobs, reasons, kept = self._ask(
            ("generate", [list(p) for p in prompt_token_ids], n, replace(sampling, generator=None), seed)
        )
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        return Completions(
            token_ids=token_ids, texts=texts, finish_reasons=reasons, logprobs=logprobs, kept=kept
        )

    def sync_weights(self, model, version: int | None = None) -> None:
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self._ask(("sync", state))

    def close(self) -> None:
        """Stop the child process (also done when the engine is garbage-collected)."""
        self._closer()

    def _ask(self, msg):
        if not self._proc.is_alive():
            raise RuntimeError(f"the rollout sampler process stopped (exit code {self._proc.exitcode})")
        self._conn.send(msg)
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the rollout sampler process stopped (exit code {self._proc.exitcode})"
            ) from None
        if status == "error":
            raise RuntimeError(f"the rollout sampler process failed:\n{payload}")
        return payload


def _stop(conn, proc) -> None:
    try:
        conn.send(("stop",))
    except (OSError, ValueError):
        pass
    conn.close()
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
