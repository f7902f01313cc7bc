"""A character-level tokenizer for the built-in tasks, built with `tokenizers` (no download).

    tok = build_tokenizer(get_task("countdown"), "runs/demo/tokenizer")
    tok("7 3>21=")["input_ids"]            # [<s>, "7", " ", "3", ">", "2", "1", "="]
    AutoTokenizer.from_pretrained("runs/demo/tokenizer")   # the same tokenizer back

Every character of the alphabet is one token; by default "<pad>", "<s>", "</s>" and "<unk>" are the
pad / bos / eos / unk tokens (ids 0-3) and the characters follow, sorted. Like Llama's tokenizer it
puts <s> in front of every encoded text (pass add_special_tokens=False to encode a completion alone).
Decoding joins the characters with nothing in between, so decode(encode(text), skip_special_tokens=True)
== text for any text over the alphabet.

To reproduce a given character vocabulary: `special_tokens` (which roles, which strings, in which id
order; leave out unk_token for none), `sort=False` (characters keep the order given), `add_bos=False`.

    tok = build_tokenizer(
        "abc+=", special_tokens={"pad_token": "[PAD]", "eos_token": "[EOS]"}, sort=False, add_bos=False
    )
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ROLES = ("pad_token", "bos_token", "eos_token", "unk_token")


def build_tokenizer(
    task_or_charset: Any,
    out_dir: str | Path | None = None,
    *,
    special_tokens: Mapping[str, str] = SPECIAL_TOKENS,
    sort: bool = True,
    add_bos: bool = True,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Character-level tokenizer over a task's alphabet (`task.charset`) or a string of characters;
    saved to `out_dir` with save_pretrained when given.

    special_tokens: role (pad_token, bos_token, eos_token, unk_token) -> token, ids 0.. in this order;
    eos_token is required (completions end with it). sort: characters sorted (else in the order given,
    duplicates dropped). add_bos: put the bos token in front of every encoded text (needs a bos_token)."""
    charset = task_or_charset if isinstance(task_or_charset, str) else task_or_charset.charset
    chars = sorted(set(charset)) if sort else list(dict.fromkeys(charset))
    if not chars:
        raise ValueError("empty character set")
    if unknown := sorted(set(special_tokens) - set(ROLES)):
        raise ValueError(f"special_tokens: unknown roles {unknown}; allowed: {', '.join(ROLES)}")
    if "eos_token" not in special_tokens:
        raise ValueError("special_tokens needs an eos_token: completions end with it")
    if add_bos and "bos_token" not in special_tokens:
        raise ValueError("add_bos=True needs a bos_token in special_tokens (or pass add_bos=False)")
    specials = list(special_tokens.values())
    if len(set(specials)) < len(specials) or set(specials) & set(chars):
        raise ValueError(f"special tokens {specials} must be distinct and not characters of the alphabet")
    vocab = {tok: i for i, tok in enumerate(specials + chars)}

    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special_tokens.get("unk_token")))
    # one pre-token per character, spaces included; WordLevel then maps each to its id
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if add_bos:
        bos = special_tokens["bos_token"]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    tk.decoder = decoders.Fuse()  # concatenate the characters, no spaces in between
    tk.add_special_tokens(specials)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        **special_tokens,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
