"""The `fast` rollout engine: a decode loop of our own around the model's forward, for CPUs and small GPUs.

    engine = FastEngine(model, tokenizer)                      # rollout.engine=fast
    comps = engine.generate(prompt_ids, n=8, sampling=SamplingParams(max_tokens=16))
    python benchmarks/rollout_engines.py                       # tokens/s against transformers' generate

Same model, same distribution as `generate` (tests/test_rollout_fast.py: identical greedy tokens,
first-token frequencies against the exact processed distribution); what it does differently:

- the KV cache is preallocated ([B, H, prompt width + max_tokens, D] per layer, written in place)
  instead of growing by torch.cat every step, which copies the whole cache once per token;
- each prompt is prefilled once and its cache repeated to its n samples (generate prefills
  every prompt n times);
- rows that hit EOS leave the batch (cache rows, mask rows, positions), where generate keeps
  decoding padding for them until the last row of the batch stops. They leave in bulk, once they
  are more than COMPACT_FRACTION of the batch: each compaction copies the whole cache, and doing
  it at every EOS measured slower (benchmarks/rollout_engines.py); so at most 1/8 of a step's rows
  are finished rows still riding along, their tokens discarded;
- sampling is temperature -> top-k -> top-p -> softmax -> a categorical draw (inverse CDF), the order and the
  tie rules of transformers' TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper
  (min_tokens_to_keep=1); top_k=0 and top_p=1 are off (generate would silently fill a None top_k with its
  default 50);
- it returns log-probs of the chosen tokens and, with SamplingParams.record_kept, the set each was drawn from
  (see below).

Not here: beam search, repetition penalties, stop strings, min_p; architectures whose cache is not
transformers' Cache API (the cache is transformers' DynamicCache with preallocated full-attention
layers; sliding-window and linear-attention layers keep transformers' own classes).

Log-probs: those of the distribution each token was drawn from, log_softmax of the processed logits
(temperature, then top-k / top-p: renormalized over the kept tokens). With SamplingParams.record_kept and a
filter on, Completions.kept holds each token's kept set (grpokit/algo/truncation.py's form: at most V / 2 ids
a token, the dropped ones when more than half is kept), with which grpokit.policy.completion_logprobs computes
the same log-probs for pi_old (rollout.replay_truncation); without it, completion_logprobs' full-distribution
log-probs differ from these by the log of the kept mass. Greedy decoding reports temperature-1 log-probs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from grpokit.algo.truncation import NO_RECORD, encode_kept
from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams, cache_kwarg
from grpokit.rollout.hf import eos_token_ids, left_pad

#: Finished rows leave the batch once they are more than this fraction of it (0: at every EOS).
#: 0, 1/8 and 1/4 measured within noise of each other, 0 a little slower; never compacting is much
#: slower for long completions.
COMPACT_FRACTION = 0.125


class PreallocatedLayer(DynamicLayer):
    """One full-attention layer's cache in fixed buffers [B, H, capacity, D], filled left to right.

    `update` writes the new keys / values in place and returns views of the filled part, so the
    model's attention sees what a DynamicLayer would give it, without DynamicLayer's per-token
    torch.cat of the whole cache. Subclassing DynamicLayer keeps transformers' mask code treating
    it as a plain growing cache (kv length = seq length + query length, offset 0).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, Dk = key_states.shape
        self.device = key_states.device
        self._k = key_states.new_empty(B, H, self.capacity, Dk)  # [B, H, capacity, Dk]
        self._v = value_states.new_empty(B, H, self.capacity, value_states.shape[-1])  # [B, H, capacity, Dv]
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> tuple[Tensor, Tensor]:
        keys, values = self._k[:, :, : self.length], self._v[:, :, : self.length]
        self.keys, self.values = keys, values
        return keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens in a cache preallocated for {self.capacity}")
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        return self._refresh()

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._refresh()

    def _gather_rows(self, index: Tensor) -> None:
        # index_select of whole contiguous rows (unfilled tail included) is one memcpy per row; copying
        # only the filled part means indexing a strided view, which measured 2x slower on CPU.
        self._k = self._k.index_select(0, index)  # [B', H, capacity, Dk]
        self._v = self._v.index_select(0, index)  # [B', H, capacity, Dv]
        self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._gather_rows(torch.arange(self._k.shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._gather_rows(indices)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)


def make_cache(config, capacity: int) -> DynamicCache:
    """transformers' DynamicCache for `config`, with every plain full-attention layer preallocated.

    Other layer kinds (sliding window, linear attention) keep transformers' own classes, which
    already implement batch_repeat_interleave / batch_select_indices.
    """
    cache = DynamicCache(config=config)
    if not cache.layers:  # no per-layer types known: layers would be created lazily as DynamicLayer
        n = config.get_text_config(decoder=True).num_hidden_layers
        cache.layers = [PreallocatedLayer(capacity) for _ in range(n)]
        cache.layer_class_to_replicate = None
    else:
        cache.layers = [
            PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
        ]
    return cache


def process_logits(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p, as transformers' logits warpers do: [B, V] -> [B, V] (-inf =
    removed)."""
    scores = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    if sampling.top_k > 0:
        k = min(sampling.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[
            ..., -1:
        ]  # ties with the k-th value are kept, as in TopKLogitsWarper
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # TopPLogitsWarper: drop the tokens whose ascending cumulative prob is <= 1 - top_p, i.e. keep the
        # smallest set whose prob reaches top_p; the most likely token is always kept (min_tokens_to_keep=1).
        sorted_scores, order = torch.sort(scores, descending=False)
        drop = sorted_scores.softmax(-1).cumsum(-1) <= (1 - sampling.top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


class FastEngine(RolloutEngine):
    """Generates with the training model (no copy); `batch_size` caps the sequences per batch, like
    HFEngine."""

    caps = EngineCaps(sampling_logprobs=True, stop_sequences=True, compiles=True, kept_sets=True)

    @classmethod
    def from_config(cls, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None):
        """The engine of a run (grpokit/rollout/engines.py: make_engine)."""
        return cls(model, tokenizer, batch_size=batch_size, compile=compile)

    def __init__(self, model, tokenizer, *, batch_size: int = 0, compile: bool = False):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.compile = (
            compile  # model.compile: prefill and decode steps through torch.compile (dynamic shapes)
        )
        self.model: Any = None  # the training model, from sync_weights
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        )
        self.sync_weights(model)

    def sync_weights(self, model, version: int | None = None) -> None:
        if model is not self.model:  # same module: nothing to copy, nothing to recompile
            # dynamic=True: the cache length grows every token and the batch shrinks as rows finish;
            # one graph with symbolic sizes instead of a recompile per shape.
            self._step_fn = torch.compile(model, dynamic=True) if self.compile else model
        self.model = model
        self._cache_arg = cache_kwarg(model)

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling pi_old
        # no_grad rather than inference_mode: a module that creates a buffer during the forward (some RoPE
        # variants do) would otherwise keep an inference tensor that the next backward pass refuses.
        per_call = max(1, (self.batch_size or len(prompt_token_ids) * n) // n)
        token_ids, logprobs, reasons, kept = [], [], [], []
        try:
            with torch.no_grad():
                for start in range(0, len(prompt_token_ids), per_call):
                    ids, lps, ks = self._generate_batch(
                        prompt_token_ids[start : start + per_call], n, sampling
                    )
                    for row, lp in zip(ids, lps, strict=True):
                        stopped = bool(row) and row[-1] in self.eos_ids
                        token_ids.append(row)
                        logprobs.append(lp)
                        reasons.append("stop" if stopped else "length")
                    kept += ks or []
        finally:
            model.train(was_training)
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        comps = Completions(token_ids=token_ids, texts=texts, finish_reasons=reasons, logprobs=logprobs)
        comps.kept = kept if records_kept(sampling) else None
        return comps

    def _forward(self, cache, **inputs) -> Tensor:
        out = self._step_fn(**inputs, **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()  # [B, V]

    def _generate_batch(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]], list[Tensor] | None]:
        """Completions for `prompts` x n, prompt-major: (token ids [B*n][len_i], log-probs [B*n][len_i], kept
        sets [B*n] of [len_i, W_i] or None)."""
        T = sampling.max_tokens
        B = len(prompts) * n
        if T <= 0:
            return [[] for _ in range(B)], [[] for _ in range(B)], None
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)  # [b, P]
        ids, mask = ids.to(device), mask.to(device)
        P = ids.shape[1]
        cache = make_cache(self.model.config, P + T)

        # Prefill each prompt once; position = cumsum(mask) - 1, so left padding shifts nothing.
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [b, P]
        logits = self._forward(cache, input_ids=ids, attention_mask=mask, position_ids=positions)  # [b, V]
        if n > 1:  # share the prompt's cache with its n samples: rows i*n .. i*n+n-1 belong to prompt i
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
        full_mask = torch.ones(
            B, P + T, dtype=mask.dtype, device=device
        )  # [B, P + T]: generated tokens are all real
        full_mask[:, :P] = mask.repeat_interleave(n, dim=0)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1  # [B, 1]

        eos = torch.tensor(sorted(self.eos_ids), device=device)
        out_tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=device)  # [B, T]
        out_logp = torch.zeros((B, T), dtype=torch.float32, device=device)  # [B, T]
        rows = torch.arange(B, device=device)  # [B_active]: the output row of each batch row
        alive = torch.ones(B, dtype=torch.bool, device=device)  # [B_active]: no EOS yet
        stops = [torch.tensor(seq, device=device) for seq in sampling.stop_token_ids if seq]
        stop_at = torch.full(
            (B,), T, dtype=torch.long, device=device
        )  # [B] length of a row a stop sequence ended
        steps_kept: list[tuple[Tensor, Tensor]] = []  # per step (rows, their kept sets [B_active, W_t])
        for t in range(T):
            tok, logp, kept = self._sample(logits, sampling)  # [B_active], [B_active], [B_active, W_t] | None
            out_tokens[rows, t] = tok  # rows past EOS write junk after their EOS; the cut below ignores it
            out_logp[rows, t] = logp
            if kept is not None:
                steps_kept.append((rows, kept))
            if t == T - 1:
                break
            alive &= ~torch.isin(tok, eos)
            for seq in stops:  # a stop sequence completed at t: the row ends as at EOS, the sequence kept
                if t + 1 >= len(seq):
                    hit = alive & (out_tokens[rows, t + 1 - len(seq) : t + 1] == seq).all(-1)  # [B_active]
                    stop_at[rows[hit]] = t + 1
                    alive &= ~hit
            n_alive = int(
                alive.sum()
            )  # a CPU-GPU sync point, once per step: it decides whether the batch shrinks
            if n_alive == 0:
                break
            if len(rows) - n_alive > COMPACT_FRACTION * len(rows):
                # Drop finished rows everywhere they live: cache, mask, positions, the token to feed.
                keep = alive.nonzero().squeeze(-1)  # [B_active']
                cache.batch_select_indices(keep)
                rows, tok, full_mask, next_pos, alive = (
                    rows[keep],
                    tok[keep],
                    full_mask[keep],
                    next_pos[keep],
                    alive[keep],
                )
            logits = self._forward(
                cache,
                input_ids=tok[:, None],
                attention_mask=full_mask[:, : P + t + 1],
                position_ids=next_pos,
            )
            next_pos = next_pos + 1

        # Cut each row after its first EOS; a row that stops at step T - 1 has length T and ends with EOS.
        is_eos = torch.isin(out_tokens, eos)  # [B, T]
        lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, T)  # argmax: the first EOS
        cut = torch.minimum(lengths, stop_at).tolist()
        tokens, lps = out_tokens.tolist(), out_logp.tolist()
        sets = gather_kept(steps_kept, B, cut) if records_kept(sampling) else None
        return [tokens[i][: cut[i]] for i in range(B)], [lps[i][: cut[i]] for i in range(B)], sets

    def _sample(self, logits: Tensor, sampling: SamplingParams) -> tuple[Tensor, Tensor, Tensor | None]:
        """Next token per row, its log-prob under the distribution it was drawn from (log_softmax of the
        processed logits: temperature, top-k, top-p) and, with records_kept(sampling), the kept sets
        [B, W] (grpokit/algo/truncation.py's form)."""
        if sampling.greedy:
            tok = logits.argmax(-1)
            return tok, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1), None
        scores = process_logits(logits, sampling)
        tok = sample_categorical(scores.softmax(-1), sampling.generator)
        kept = encode_kept(scores.isfinite()).cpu() if records_kept(sampling) else None
        return tok, scores.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1), kept


def records_kept(sampling: SamplingParams) -> bool:
    """Whether the engine records kept sets: asked for, and a sampler that truncates (top-k or top-p)."""
    return sampling.record_kept and not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1.0)


def gather_kept(steps: list[tuple[Tensor, Tensor]], B: int, lengths: list[int]) -> list[Tensor]:
    """Per output row its kept sets [len_i, W_i] (-1 padded), from each step's (rows [B_t], sets
    [B_t, W_t])."""
    W = max(k.shape[1] for _, k in steps)
    out = torch.full((B, len(steps), W), -1, dtype=torch.int32)  # [B, steps, W]
    for t, (rows, k) in enumerate(steps):
        out[rows.cpu(), t, : k.shape[1]] = k
    rows_kept = [out[i, : lengths[i]] for i in range(B)]
    return [k[:, : _width(k)].clone() for k in rows_kept]


def _width(kept: Tensor) -> int:
    """The widest row of a completion's kept sets [len, W] (each row's entries come first)."""
    return max(1, int((kept != NO_RECORD).sum(-1).max())) if kept.numel() else 1


def sample_categorical(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of probs [B, V] (rows sum to 1; zero entries are never drawn), by inverse CDF: a
    uniform per row against the running sum (float64). The distribution of torch.multinomial(probs, 1),
    without its cost on CPU at real vocabularies (8 rows of 151,936: 26 ms for multinomial, 1.3 ms here)."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator) * total
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # the first index whose running sum exceeds u
    if (idx >= probs.shape[-1]).any():  # u rounded up to the total: the last index with mass
        idx = torch.minimum(idx, (cdf < total).sum(-1))
    return idx
