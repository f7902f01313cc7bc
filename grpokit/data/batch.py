"""The step's data: packed token sequences, groups of scored completions, and the rollout batch.

    tokens = pack_sequences(prompt_ids, completion_ids, pad_id)    # [N, P + T]: left-padded prompts,
                                                                   # right-padded completions
    groups = Groups(rows, completions, scored)                     # B prompts x G completions, scored
    groups = Groups.take([(groups, 0), (more, 3)], G)              # DAPO dynamic sampling keeps some groups
    step_rewards, step_ends = process_rewards(scored, texts, token_ids, tokenizer)  # DeepSeekMath §4.1.3
    row = one_row(tokens)     # model.padding_free: the N sequences back to back in one row [1, L], no padding

N = prompts x G completions, groups contiguous (prompt-major), everywhere in this file.
Position ids follow the attention mask (cumsum - 1), so left padding never shifts a position: a
padded row gets exactly the log-probs it would get alone (tests/test_policy.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpokit.types import Completions, PromptRow, RewardOutput


@dataclass
class PackedBatch:
    input_ids: Tensor  # [N, P + T]  left-padded prompt, then right-padded completion
    attention_mask: Tensor  # [N, P + T]
    position_ids: Tensor  # [N, P + T]  cumsum(attention_mask) - 1: padding never shifts a position
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T]  1 on completion tokens (EOS included), 0 on padding
    # [N, T, W] the sampler's kept set of each completion token (top-k / top-p: grpokit/algo/truncation.py's
    # form, -1 rows where nothing was recorded), which every log-prob pass replays; None: the full
    # distribution
    kept: Tensor | None = None

    @property
    def completion_width(self) -> int:
        return self.completion_ids.shape[1]

    def rows(self, idx: Tensor | slice) -> PackedBatch:
        b = PackedBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.position_ids[idx],
            self.completion_ids[idx],
            self.completion_mask[idx],
            None if self.kept is None else self.kept[idx],
        )
        return b.trimmed()

    def trimmed(self) -> PackedBatch:
        """Drop columns that are padding in every row (left of the prompts, right of the completions)."""
        left = int(self.attention_mask.sum(0).nonzero()[0]) if self.attention_mask.any() else 0
        T = int(self.completion_mask.sum(1).max()) if self.completion_mask.numel() else 0
        T = max(T, 1)
        P = self.input_ids.shape[1] - self.completion_width
        stop = P + T
        return PackedBatch(
            self.input_ids[:, left:stop],
            self.attention_mask[:, left:stop],
            self.position_ids[:, left:stop],
            self.completion_ids[:, :T],
            self.completion_mask[:, :T],
            None if self.kept is None else self.kept[:, :T],
        )


def pack_sequences(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    kept: list[Tensor] | None = None,
) -> PackedBatch:
    """kept: the engine's kept sets of each completion's tokens [len_i, W_i] (Completions.kept), or None."""
    N = len(prompt_ids)
    if N != len(completion_ids):
        raise ValueError(f"{N} prompts but {len(completion_ids)} completions")
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    input_ids = torch.full((N, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((N, P + T), dtype=torch.long)
    cmask = torch.zeros((N, T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p) : P] = 1
        if c:
            input_ids[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, P : P + len(c)] = 1
            cmask[i, : len(c)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    return PackedBatch(input_ids, attn, position_ids, input_ids[:, P:], cmask, pad_kept(kept, T))


def pad_kept(kept: list[Tensor] | None, T: int) -> Tensor | None:
    """Completions' kept sets [len_i, W_i] as one [N, T, W] int32 tensor, -1 (no record) around them."""
    if kept is None:
        return None
    W = max([1] + [k.shape[1] for k in kept if k.numel()])
    out = torch.full((len(kept), T, W), -1, dtype=torch.int32)
    for i, k in enumerate(kept):
        out[i, : k.shape[0], : k.shape[1]] = k
    return out


@dataclass
class OneRow:
    """A batch's sequences back to back in one row (model.padding_free), position ids restarting at each.

    transformers (masking_utils.find_packed_sequence_indices) reads position ids that restart, passed with no
    attention mask and no KV cache, as sequences packed in a row: sdpa, eager and flex attention then mask
    attention to each sequence, flash-attention takes its varlen path (one row only). So every sequence gets
    the log-probs it gets alone, and the model computes L positions instead of N x (P + T):

        logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False,
                       logits_to_keep=row.predicts).logits      # [1, K, V]: K = completion tokens
        logp = row.unpack(token_logprobs(logits, row.targets))  # [N, T] as the padded pass, 0 on padding
    """

    input_ids: Tensor  # [1, L]  each sequence's prompt then completion, back to back, no padding
    position_ids: Tensor  # [1, L]  0, 1, ... from each sequence's first token (pack_sequences' positions)
    predicts: Tensor  # [K]  the positions whose logits predict a completion token, in the mask's order
    targets: Tensor  # [1, K]  those completion tokens
    mask: Tensor  # [N, T] bool  where the K tokens sit in the padded layout (the batch's completion_mask)
    kept: Tensor | None = None  # [1, K, W]  their kept sets (PackedBatch.kept), or None

    def unpack(self, values: Tensor) -> Tensor:
        """[1, K, ...] values of the completion tokens -> [N, T, ...] in the padded layout, 0 on padding
        (differentiable: its backward gathers the K values' gradients)."""
        out = values.new_zeros(*self.mask.shape, *values.shape[2:])
        out[self.mask] = values[0]
        return out

    @property
    def positions(self) -> int:
        """L: the positions the model computes (the padded pass computes N x (P + T))."""
        return self.input_ids.shape[1]


def one_row(batch: PackedBatch) -> OneRow:
    """The batch's N sequences (left-padded prompt, right-padded completion) as one padding-free row."""
    N, W = batch.input_ids.shape
    P = W - batch.completion_width
    real = batch.attention_mask.bool()  # [N, P + T]
    mask = batch.completion_mask.bool()  # [N, T]
    if P == 0 or (mask.any(1) & ~real[:, P - 1]).any():
        raise ValueError("a completion with an empty prompt: no position predicts its first token")
    place = real.flatten().cumsum(0).view(N, W) - 1  # [N, P + T]: each real token's place in the row
    return OneRow(
        batch.input_ids[real][None],
        batch.position_ids[real][None],
        place[:, P:][mask] - 1,  # the token before each completion token (its prompt's last, for the first)
        batch.completion_ids[mask][None],
        mask,
        None if batch.kept is None else batch.kept[mask.to(batch.kept.device)][None],
    )


@dataclass
class Groups:
    """Prompts with their G completions each and the rewards of those, before advantages."""

    rows: list[PromptRow]  # [B]
    comps: Completions  # [B * G], prompt-major
    scored: RewardOutput  # total / per_function [B * G]

    @staticmethod
    def take(chosen: list[tuple[Groups, int]], G: int) -> Groups:
        """The groups (source, index) in `chosen`, concatenated in that order."""
        spans = [(src, slice(g * G, (g + 1) * G)) for src, g in chosen]

        def cat(get: Callable[[Groups], list[Any] | None]) -> list[Any]:
            """get(source)'s rows in `spans`, concatenated (the callers check that every source has them)."""
            out: list[Any] = []
            for src, sl in spans:
                rows = get(src)
                assert rows is not None
                out += rows[sl]
            return out

        logprobs = None
        if all(src.comps.logprobs is not None for src, _ in spans):
            logprobs = cat(lambda s: s.comps.logprobs)
        comps = Completions(
            cat(lambda s: s.comps.token_ids),
            cat(lambda s: s.comps.texts),
            cat(lambda s: s.comps.finish_reasons),
            logprobs,
        )
        if all(src.comps.episodes is not None for src, _ in spans):  # multi-turn episodes with tools
            comps.model_mask, comps.episodes = (
                cat(lambda s: s.comps.model_mask),
                cat(lambda s: s.comps.episodes),
            )
        if all(src.comps.versions is not None for src, _ in spans):
            comps.versions = cat(lambda s: s.comps.versions)
        if all(src.comps.kept is not None for src, _ in spans):
            comps.kept = cat(lambda s: s.comps.kept)
        scored = RewardOutput.take([(src.scored, sl) for src, sl in spans])
        return Groups([src.rows[g] for src, g in chosen], comps, scored)


def repeat_rows(rows: list[PromptRow], G: int) -> tuple[list[Any], dict[str, list[Any]]]:
    """Prompts and dataset columns repeated G times, aligned with the completions (reward function
    arguments)."""
    prompts = [r.prompt for r in rows for _ in range(G)]
    columns = {c: [r.columns[c] for r in rows for _ in range(G)] for c in rows[0].columns}
    return prompts, columns


@dataclass
class ValueTargets:
    """What the PPO critic's update needs from the rollout (grpokit/policy/critic.py)."""

    values: Tensor  # [N, T] V_old: the critic at rollout time (the value-clipping anchor)
    returns: Tensor  # [N, T] GAE returns A + V_old: the critic's targets


@dataclass
class RolloutBatch:
    """Everything one step trains on. N = prompts_per_step x G completions, groups contiguous."""

    tokens: PackedBatch  # input_ids / masks [N, P + T], completion ids / mask [N, T]
    loss_mask: Tensor  # [N, T] completion_mask, minus truncated rows when they are masked (DAPO)
    truncated: Tensor  # [N] bool: hit max_completion_length without EOS
    rewards: Tensor  # [N] weighted total reward
    # [N] one per completion, broadcast over its tokens; or [N, T] per token (process rewards, PPO's GAE)
    advantages: Tensor
    old_logp: Tensor | None  # [N, T] pi_old; None when it equals pi_theta (mu = 1, one minibatch)
    ref_logp: Tensor | None  # [N, T] pi_ref; None when beta = 0
    value_targets: ValueTargets | None  # the critic's V_old and returns [N, T] (PPO); None for GRPO
    # [N, T] the rollout engine's log-probs of the sampled tokens (rollout/mismatch.py), None when it gives
    # none (hf). The one field with a default: batches built without an engine (tests, benchmarks) have none.
    sampler_logp: Tensor | None = None

    def rows(self, idx: Tensor) -> RolloutBatch:
        """Rows idx (a micro-batch), every [N, T] field trimmed to their longest completion as tokens.rows
        trims the tokens."""
        tokens = self.tokens.rows(idx)
        T = tokens.completion_width

        def cut(x: Tensor | None) -> Any:
            return None if x is None else x[idx, :T]

        targets = self.value_targets
        return RolloutBatch(
            tokens,
            cut(self.loss_mask),
            self.truncated[idx],
            self.rewards[idx],
            self.advantages[idx] if self.advantages.dim() == 1 else cut(self.advantages),
            cut(self.old_logp),
            cut(self.ref_logp),
            None if targets is None else ValueTargets(cut(targets.values), cut(targets.returns)),
            cut(self.sampler_logp),
        )


# ---------------------------------------------------------------- process rewards: characters -> tokens
# Reward functions see text and say where each step ends in characters (grpokit.rewards.StepScores);
# the loop trains on tokens. DeepSeekMath §4.1.3; docs/algorithm.md, "Process rewards end to end".


def token_char_ends(tokenizer: Any, token_ids: list[int]) -> list[int]:
    """[L] for each completion token, how many characters of the completion's text are complete
    once it is decoded: the length of the common prefix of the decoded token prefix and the text.

    Decodes every prefix as the rollout engines decode (skip_special_tokens=True), so it holds for
    any tokenizer (character-level, BPE, SentencePiece): a prefix that ends inside a multi-byte
    character decodes to a replacement character there, which does not count until the token
    that completes it. Non-decreasing. One batch_decode per completion."""
    if not token_ids:
        return []
    texts = tokenizer.batch_decode(
        [token_ids[: k + 1] for k in range(len(token_ids))], skip_special_tokens=True
    )
    full = texts[-1]
    out, best = [], 0
    for t in texts:
        if full.startswith(t):  # the usual case, checked in C
            n = len(t)
        else:
            n = next(
                (j for j, (a, b) in enumerate(zip(t, full, strict=False)) if a != b), min(len(t), len(full))
            )
        best = max(best, n)
        out.append(best)
    return out


def step_token_ends(char_ends: list[int], token_ends: list[int], text_length: int) -> list[int]:
    """Token index (0-based, inclusive) where each step ends: the first token whose decoded prefix
    covers the step's last character; a step ending at the end of the text ends at the last token
    (so EOS, which decodes to nothing, belongs to the final step). token_ends: token_char_ends."""
    last = len(token_ends) - 1
    return [last if e >= text_length else min(bisect_left(token_ends, e), last) for e in char_ends]


def process_rewards(
    scored: RewardOutput, texts: list[str], token_ids: list[list[int]], tokenizer: Any
) -> tuple[list[Tensor], list[Tensor]]:
    """Each completion's step rewards [K_i] and step end tokens [K_i], for step_advantages.

    Every function with a nonzero weight contributes weight x score at each of its steps' end
    tokens (a float reward: one step at the last token; None or a failed reward: nothing);
    contributions on the same token add up. A sample whose group a timed-out call dropped (scored.skipped,
    on_timeout=skip_group) has no steps, so its group's advantages are 0."""
    out_rewards, out_ends = [], []
    for i, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
        at: dict[int, float] = {}
        if scored.skip_mask[i]:
            out_rewards.append(torch.zeros(0))
            out_ends.append(torch.zeros(0, dtype=torch.long))
            continue
        token_ends: list[int] | None = None
        for name, r in scored.per_function.items():
            w = scored.weights[name]
            if w == 0 or not ids:
                continue
            steps = scored.steps.get(name)
            item = steps[i] if steps is not None else None
            if item is None:  # an outcome reward, or a float from a step function: one step at the end
                v = float(r[i])
                if math.isfinite(v):
                    at[len(ids) - 1] = at.get(len(ids) - 1, 0.0) + w * v
                continue
            if token_ends is None:
                token_ends = token_char_ends(tokenizer, ids)
            for tok, s in zip(step_token_ends(item.ends, token_ends, len(text)), item.scores, strict=True):
                at[tok] = at.get(tok, 0.0) + w * float(s)
        order = sorted(at)
        out_rewards.append(torch.tensor([at[t] for t in order], dtype=torch.float32))
        out_ends.append(torch.tensor(order, dtype=torch.long))
    return out_rewards, out_ends
