"""The `hf` rollout engine: transformers' `generate` on the policy itself (colocated, no copy)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams, cut_at_eos


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B][len] -> input_ids, attention_mask [B, max_len], padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


class HFEngine(RolloutEngine):
    """Generates with the training model; `batch_size` caps the sequences per generate call."""

    caps = EngineCaps()  # transformers' generate: no sampling log-probs, no stop sequences

    @classmethod
    def from_config(cls, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None):
        """The engine of a run (grpokit/rollout/engines.py: make_engine)."""
        return cls(model, tokenizer, batch_size=batch_size)

    def __init__(self, model, tokenizer, *, batch_size: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = batch_size
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        )

    def sync_weights(self, model, version: int | None = None) -> None:
        self.model = model  # same module: nothing to copy

    def _gen_config(self, n: int, sampling: SamplingParams) -> GenerationConfig:
        common = dict(
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=n,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            use_cache=True,
        )
        if sampling.greedy:
            return GenerationConfig(do_sample=False, **common)
        # top_k=0 spelled out: None would let transformers fill in its default of 50, and the
        # sampled distribution would no longer be the one the trainer computes log-probs for.
        return GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            **common,
        )

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling pi_old
        device = next(model.parameters()).device
        if sampling.greedy and n > 1:  # generate refuses num_return_sequences > 1 without sampling
            prompt_token_ids, n = [p for p in prompt_token_ids for _ in range(n)], 1
        per_call = max(1, (self.batch_size or len(prompt_token_ids) * n) // n)
        token_ids, reasons = [], []
        try:
            for start in range(0, len(prompt_token_ids), per_call):
                chunk = prompt_token_ids[start : start + per_call]
                ids, mask = left_pad(chunk, self.pad_id)
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=self._gen_config(n, sampling),
                )
                new = out[:, ids.shape[1] :].tolist()  # [len(chunk) * n, <= max_tokens], prompt-major
                for row in new:
                    kept, why = cut_at_eos(row, self.eos_ids, sampling.max_tokens)
                    token_ids.append(kept)
                    reasons.append(why)
        finally:
            model.train(was_training)
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        return Completions(token_ids=token_ids, texts=texts, finish_reasons=reasons, logprobs=None)
