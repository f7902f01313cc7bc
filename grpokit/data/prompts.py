"""Prompts rendered and tokenized once (PromptDataset), as TRL renders them: a string as-is with the
tokenizer's special tokens, chat messages through the chat template with the generation prompt."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from grpokit.data.files import DataError, check_prompt_column, column_names
from grpokit.types import Prompt, PromptRow
from grpokit.values import short_repr

OVERLONG_CHOICES = ("error", "truncate")

logger = logging.getLogger("grpokit.data")


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
    )


def _is_blank(prompt: Prompt) -> bool:
    """An empty or whitespace-only string, or chat messages none of which has any content."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return all(_is_blank(m["content"]) if isinstance(m["content"], str) else not m["content"] for m in prompt)


class PromptDataset:
    """Rows with their prompts rendered and tokenized once, at construction.

    overlong="error" rejects a prompt longer than max_prompt_length; "truncate" keeps its last
    max_prompt_length tokens (the question is usually at the end; the cost is that a truncated
    prompt loses its BOS and the head of its chat template) and counts it in `num_truncated`.
    where: each row's place as errors name it (load_located_rows: "prompts.jsonl line 57"); default "row i".
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        prompt_column: str = "prompt",
        max_prompt_length: int = 512,
        overlong: str = "error",
        system_prompt: str | None = None,
        where: Sequence[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ):
        self._check_settings(rows, max_prompt_length, overlong)
        self.column_names = column_names(rows)  # every column, prompt included, in first-seen order
        check_prompt_column(self.column_names, prompt_column)
        self.prompt_column = prompt_column
        self.max_prompt_length = max_prompt_length

        where = self._row_labels(rows, where)
        prompts: list[Any] = [row.get(prompt_column) for row in rows]  # Prompts once _render accepts them
        texts = [
            self._render(w, p, tokenizer, system_prompt, tools) for w, p in zip(where, prompts, strict=True)
        ]
        ids = self._tokenize(texts, prompts, tokenizer)
        overlong_rows = self._check_lengths(ids, prompts, where, max_prompt_length, overlong)
        self._truncate(ids, texts, overlong_rows, tokenizer, max_prompt_length)
        self.num_truncated = len(overlong_rows)

        self._ids = ids
        self._truncated = set(overlong_rows)
        self._texts = texts
        self._prompts = prompts
        self._columns = [{c: row.get(c) for c in self.column_names if c != prompt_column} for row in rows]

    @staticmethod
    def _check_settings(rows: Sequence[dict[str, Any]], max_prompt_length: int, overlong: str) -> None:
        """Rejects an unknown overlong choice, a max_prompt_length that is not a positive int, and no rows."""
        if overlong not in OVERLONG_CHOICES:
            raise DataError(f"data.overlong_prompts={overlong!r} is not one of {list(OVERLONG_CHOICES)}")
        if (
            isinstance(max_prompt_length, bool)
            or not isinstance(max_prompt_length, int)
            or max_prompt_length < 1
        ):
            raise DataError(f"data.max_prompt_length={max_prompt_length!r} must be a positive int")
        if not rows:
            raise DataError("the dataset has no rows; point to a file with at least one prompt")

    @staticmethod
    def _row_labels(rows: Sequence[dict[str, Any]], where: Sequence[str] | None) -> list[str]:
        """Each row's place as errors name it: `where`, or "row i"."""
        labels = [f"row {i}" for i in range(len(rows))] if where is None else list(where)
        if len(labels) != len(rows):
            raise ValueError(f"where has {len(labels)} labels for {len(rows)} rows")
        return labels

    @staticmethod
    def _check_lengths(
        ids: list[list[int]], prompts: list[Any], where: list[str], max_prompt_length: int, overlong: str
    ) -> list[int]:
        """The rows longer than max_prompt_length; raises on a prompt of zero tokens, and on an overlong one
        unless overlong="truncate"."""
        lengths = [len(x) for x in ids]
        if min(lengths) == 0:
            i = lengths.index(0)
            raise DataError(
                f"{where[i]}: prompt {short_repr(prompts[i])} renders to zero tokens; remove the row or "
                "fill in its prompt"
            )
        overlong_rows = [i for i, n in enumerate(lengths) if n > max_prompt_length]
        if overlong_rows and overlong == "error":
            i, more = overlong_rows[0], len(overlong_rows) - 1
            others = f" ({more} more rows are too)" if more else ""
            raise DataError(
                f"{where[i]}: prompt is {lengths[i]} tokens, longer than "
                f"data.max_prompt_length={max_prompt_length}{others}; raise data.max_prompt_length or set "
                "data.overlong_prompts=truncate"
            )
        return overlong_rows

    @staticmethod
    def _truncate(
        ids: list[list[int]], texts: list[str], rows: list[int], tokenizer: Any, max_prompt_length: int
    ) -> None:
        """Keeps the last max_prompt_length tokens of each of `rows` (in place, texts decoded again)."""
        for i in rows:
            ids[i] = ids[i][-max_prompt_length:]
            texts[i] = tokenizer.decode(ids[i], skip_special_tokens=False)
        if rows:
            logger.warning(
                "%d of %d prompts are longer than data.max_prompt_length=%d tokens; kept the last %d tokens "
                "of each (data.overlong_prompts=truncate)",
                len(rows),
                len(ids),
                max_prompt_length,
                max_prompt_length,
            )

    @staticmethod
    def _render(
        where: str, prompt: Any, tokenizer: Any, system_prompt: str | None, tools: list[dict[str, Any]] | None
    ) -> str:
        if not isinstance(prompt, str) and not _is_messages(prompt):
            raise DataError(
                f"{where}: prompt {short_repr(prompt)} ({type(prompt).__name__}) is not a string or a list "
                "of "
                '{"role", "content"} messages; fix that row or point data.prompt_column at the prompt column'
            )
        if _is_blank(prompt):  # it would train on the system prompt or BOS alone, silently
            raise DataError(
                f"{where}: prompt {short_repr(prompt)} is empty; remove the row or fill in its prompt"
            )
        if isinstance(prompt, str):
            return prompt if system_prompt is None else system_prompt + "\n" + prompt
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{where}: prompt is a list of chat messages but the tokenizer has no chat_template; "
                "use a tokenizer with a chat template (e.g. an instruct model) or plain-string prompts"
            )
        messages = list(prompt)
        if system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        if tools:  # the tools' JSON schemas, where the template shows them (Qwen3: a "# Tools" system block)
            return tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @staticmethod
    def _tokenize(texts: list[str], prompts: list[Any], tokenizer: Any) -> list[list[int]]:
        # Two batched calls: plain strings get the tokenizer's special tokens (BOS), rendered chats
        # do not, because the chat template already wrote them.
        ids: list[list[int]] = [[] for _ in texts]
        for is_str in (True, False):
            idx = [i for i, p in enumerate(prompts) if isinstance(p, str) == is_str]
            if idx:
                enc = tokenizer([texts[i] for i in idx], add_special_tokens=is_str)["input_ids"]
                for i, e in zip(idx, enc, strict=True):
                    ids[i] = list(e)
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> PromptRow:
        return PromptRow(
            prompt_ids=self._ids[i],
            prompt_text=self._texts[i],
            prompt=self._prompts[i],
            columns=self._columns[i],
            truncated=i in self._truncated,
        )
