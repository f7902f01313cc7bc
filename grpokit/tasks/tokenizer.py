"""A character-level tokenizer for the built-in tasks, built with `tokenizers` (no download).

    tok = build_tokenizer(get_task("countdown"), "runs/demo/tokenizer")
    tok("7 3>21=")["input_ids"]            # [<s>, "7", " ", "3", ">", "2", "1", "="]
    AutoTokenizer.from_pretrained("runs/demo/tokenizer")   # the same tokenizer back

Every character of the alphabet is one token; "<pad>", "<s>", "</s>" and "<unk>" are the
pad / bos / eos / unk tokens. Like Llama's tokenizer it puts <s> in front of every encoded
text (pass add_special_tokens=False to encode a completion alone). Decoding joins the
characters with nothing in between, so decode(encode(text), skip_special_tokens=True) == text
for any text over the alphabet.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_tokenizer(task_or_charset: Any, out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Character-level tokenizer over a task's alphabet (`task.charset`) or a string of
    characters; saved to `out_dir` with save_pretrained when given."""
    charset = task_or_charset if isinstance(task_or_charset, str) else task_or_charset.charset
    chars = sorted(set(charset))
    if not chars:
        raise ValueError("empty character set")
    specials = list(SPECIAL_TOKENS.values())  # ids 0..3: pad, bos, eos, unk
    vocab = {tok: i for i, tok in enumerate(specials + chars)}

    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # one pre-token per character, spaces included; WordLevel then maps each to its id
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tk.decoder = decoders.Fuse()  # concatenate the characters, no spaces in between
    tk.add_special_tokens(specials)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
        **SPECIAL_TOKENS,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
