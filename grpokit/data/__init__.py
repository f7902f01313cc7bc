"""The data stage (config section `data`): load rows, render and tokenize prompts, sample prompts per step.

    data = build_datasets(cfg.data, tokenizer, seed=cfg.seed)   # train / eval / sft / demo: rows -> split ->
                                                                # datasets
    rows = load_rows("train.jsonl")                      # .jsonl .json .parquet .csv, or a datasets folder
    rows, where = load_located_rows("train.jsonl")       # ... and where each row is: "train.jsonl line 57"
    train, held_out = split_rows(rows, eval_size=100, seed=0)
    ds = PromptDataset(train, tokenizer, max_prompt_length=512)
    sampler = PromptSampler(len(ds), prompts_per_step=8, seed=0)
    batch = [ds[i] for i in sampler.next()]              # each row is then repeated G times by the trainer

Rendering follows TRL (`maybe_apply_chat_template`): a string prompt is tokenized as-is with the
tokenizer's special tokens (BOS); a list of chat messages goes through the tokenizer's chat template
with the generation prompt, and is tokenized without special tokens because the template already
writes them. Prompts are tokenized once, here, so rollouts never re-tokenize.

The stages, one module each: files.py (files -> rows), split.py (held-out prompts), prompts.py (rendering and
tokenizing), build.py (the config's `data` section -> Datasets), sampler.py (the prompts of each step).

Errors about one row name it as the user finds it in the file ("prompts.jsonl line 57", "prompts.parquet
row 56 (0-based)"), also after data.eval_size took held-out rows out of the middle: build_datasets carries
those labels beside the rows (never inside them, so reward functions see only the file's columns).
"""

from __future__ import annotations

from grpokit.data.build import Datasets, build_datasets, check_context_length
from grpokit.data.files import SUPPORTED_FILES, DataError, load_located_rows, load_rows
from grpokit.data.prompts import OVERLONG_CHOICES, PromptDataset
from grpokit.data.sampler import PromptSampler, SamplerBookmarks
from grpokit.data.split import split_indices, split_rows
from grpokit.data.tasks import get_task
from grpokit.types import Prompt, PromptRow

__all__ = [
    "OVERLONG_CHOICES",
    "SUPPORTED_FILES",
    "DataError",
    "Datasets",
    "Prompt",
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
    "SamplerBookmarks",
    "build_datasets",
    "check_context_length",
    "get_task",
    "load_located_rows",
    "load_rows",
    "split_indices",
    "split_rows",
]
