"""grpokit.data: loading every format, rendering prompts, truncation, splitting, sampling."""

from __future__ import annotations

import csv
import json
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.config import DataConfig
from grpokit.data import (
    DataError,
    PromptDataset,
    PromptSampler,
    build_datasets,
    load_located_rows,
    load_rows,
    split_rows,
)
from tests.helpers import read_metrics, require

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

ROWS = [
    {"prompt": "What is 2+3?", "answer": 5, "tags": ["add", "easy"]},
    {"prompt": "What is 7*6?", "answer": 42, "tags": ["mul"]},
    {"prompt": "Is 9 prime?", "answer": 0, "tags": []},
]


def _build_tokenizer(path):
    """Character-level tokenizer: one token per printable character, BOS added by the post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.printable)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    t = _build_tokenizer(tmp_path_factory.mktemp("chat_tok"))
    t.chat_template = CHAT_TEMPLATE
    return t


def char_ids(tok, text):
    return [tok.convert_tokens_to_ids(c) for c in text]


# ---------------------------------------------------------------------------------------------
# Loading


def test_jsonl_roundtrip(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")  # a trailing blank line is fine
    assert load_rows(p) == ROWS


def test_json_list_and_json_lines(tmp_path):
    p = tmp_path / "list.json"
    p.write_text(json.dumps(ROWS))
    assert load_rows(p) == ROWS
    p = tmp_path / "lines.json"
    p.write_text("\n".join(json.dumps(r) for r in ROWS))
    assert load_rows(str(p)) == ROWS


def test_parquet_roundtrip_with_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ROWS + [{"prompt": "x", "answer": 1, "tags": ["a"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.parquet") == rows

    chats = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "a"}]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "c.parquet")
    assert load_rows(tmp_path / "c.parquet") == chats


def test_csv_roundtrip_infers_numeric_columns(tmp_path):
    p = tmp_path / "d.csv"
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "answer", "score", "note"])
        w.writerow(["What is 2+3, exactly?", "5", "0.5", "line one\nline two"])
        w.writerow(["What is 7*6?", "42", "1", ""])
    assert load_rows(p) == [
        {"prompt": "What is 2+3, exactly?", "answer": 5, "score": 0.5, "note": "line one\nline two"},
        {"prompt": "What is 7*6?", "answer": 42, "score": 1.0, "note": ""},
    ]


def test_datasets_folder_and_dataset_dict(tmp_path):
    datasets = require("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(tmp_path / "ds") == ROWS

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd") == ROWS[:2]

    datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(ROWS), "validation": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match=r"splits \['test', 'validation'\] but no 'train'"):
        load_rows(tmp_path / "no_train")


def test_load_errors(tmp_path):
    with pytest.raises(
        DataError, match="dataset not found: .*missing.jsonl.*check data.train_path / data.eval_path"
    ):
        load_rows(tmp_path / "missing.jsonl")

    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(
        DataError, match=r"unsupported dataset file 'd.txt'; use one of .jsonl, .json, .parquet, .csv"
    ):
        load_rows(tmp_path / "d.txt")

    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        load_rows(tmp_path / "empty.jsonl")

    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="has no rows"):
        load_rows(tmp_path / "empty.json")

    (tmp_path / "header.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match="has no rows"):
        load_rows(tmp_path / "header.csv")

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_rows(tmp_path / "bad.jsonl")


def test_non_utf8_bytes_name_the_line_and_column(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "a"}\n\n{"prompt": "b\xff"}\n')
    with pytest.raises(
        DataError,
        match=r"^d.jsonl: line 3 is not valid UTF-8 \(byte 0xff at column 14\); re-save the file as UTF-8$",
    ):
        load_rows(tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_bytes(b'[\n  {"prompt": "a"},\n  {"prompt": "\xe9t\xe9"}\n]')
    with pytest.raises(DataError, match=r"^d.json: line 3 is not valid UTF-8 \(byte 0xe9 at column 15\)"):
        load_rows(tmp_path / "d.json")
    (tmp_path / "d.csv").write_bytes(b"prompt,answer\nq,1\n" + "caf\u00e9,2\n".encode("cp1252"))
    with pytest.raises(DataError, match=r"^d.csv: line 3 is not valid UTF-8 \(byte 0xe9 at column 4\)"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')  # a BOM is UTF-8, not an error
    assert load_rows(tmp_path / "bom.jsonl") == [{"prompt": "a"}]


def test_located_rows_say_where_each_row_is(tmp_path):
    """The labels errors use: the line of a text file (blank lines and multi-line CSV cells counted), the
    0-based index of a list item or a Parquet / datasets row."""
    (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert load_located_rows(tmp_path / "d.jsonl") == (
        [{"prompt": "a"}, {"prompt": "b"}],
        ["d.jsonl line 1", "d.jsonl line 3"],
    )
    (tmp_path / "lines.json").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert load_located_rows(tmp_path / "lines.json")[1] == ["lines.json line 1", "lines.json line 2"]
    (tmp_path / "list.json").write_text(json.dumps(ROWS, indent=2))
    assert load_located_rows(tmp_path / "list.json")[1] == [f"list.json item {i} (0-based)" for i in range(3)]
    with (tmp_path / "d.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["prompt", "note"], ["a", "two\nlines"], ["b", ""]])
    assert load_located_rows(tmp_path / "d.csv") == (
        [{"prompt": "a", "note": "two\nlines"}, {"prompt": "b", "note": ""}],
        ["d.csv line 2", "d.csv line 4"],
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert load_located_rows(tmp_path / "d.parquet")[1] == [f"d.parquet row {i} (0-based)" for i in range(3)]


def test_csv_extra_field_names_the_line(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,answer\nq,1\nWhat is 1,2?,3\n")
    with pytest.raises(
        DataError, match=r"d.csv: line 3 has more fields than the header \['prompt', 'answer'\]"
    ):
        load_rows(tmp_path / "d.csv")


def test_plain_folder_is_not_a_dataset(tmp_path):
    require("datasets")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        load_rows(tmp_path / "folder")


def test_errors_are_one_line(tmp_path, tok):
    cases = [
        lambda: load_rows(tmp_path / "nope.csv"),
        lambda: PromptDataset([{"question": "a"}], tok),
        lambda: PromptDataset([{"prompt": "a" * 50}], tok, max_prompt_length=10),
        lambda: PromptDataset([{"prompt": {"text": "a\nb"}}], tok),
        lambda: PromptSampler(3, 4, seed=0),
    ]
    for case in cases:
        with pytest.raises(DataError) as e:
            case()
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# PromptDataset


def test_string_prompt_adds_bos_and_keeps_columns(tok):
    ds = PromptDataset(ROWS, tok)
    assert len(ds) == 3
    assert ds.column_names == ["prompt", "answer", "tags"]
    row = ds[1]
    assert row.prompt == row.prompt_text == "What is 7*6?"
    assert row.prompt_ids == [tok.bos_token_id] + char_ids(tok, "What is 7*6?")
    assert row.columns == {"answer": 42, "tags": ["mul"]}
    assert ds.num_truncated == 0


def test_missing_columns_in_some_rows_become_none(tok):
    ds = PromptDataset([{"prompt": "a", "answer": 1}, {"prompt": "b", "level": "hard"}], tok)
    assert ds.column_names == ["prompt", "answer", "level"]
    assert ds[0].columns == {"answer": 1, "level": None}
    assert ds[1].columns == {"answer": None, "level": "hard"}


def test_chat_prompt_uses_template_without_extra_bos(chat_tok):
    msgs = [{"role": "user", "content": "hi"}]
    row = PromptDataset([{"prompt": msgs, "answer": "x"}], chat_tok)[0]
    assert row.prompt == msgs
    assert row.prompt_text == "<user>hi\n<assistant>"
    assert row.prompt_ids == char_ids(
        chat_tok, "<user>hi\n<assistant>"
    )  # no BOS: the template owns special tokens
    assert row.columns == {"answer": "x"}


def test_mixed_string_and_chat_prompts(chat_tok):
    ds = PromptDataset([{"prompt": "ab"}, {"prompt": [{"role": "user", "content": "cd"}]}], chat_tok)
    assert ds[0].prompt_ids == [chat_tok.bos_token_id] + char_ids(chat_tok, "ab")
    assert ds[1].prompt_text == "<user>cd\n<assistant>"


def test_system_prompt(chat_tok):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]},
        {"prompt": "plain"},
    ]
    ds = PromptDataset(rows, chat_tok, system_prompt="Be brief.")
    assert ds[0].prompt_text == "<system>Be brief.\n<user>hi\n<assistant>"
    assert ds[1].prompt_text == "<system>own\n<user>hi\n<assistant>"  # an existing system message wins
    assert ds[2].prompt_text == "Be brief.\nplain"
    assert ds[2].prompt_ids == [chat_tok.bos_token_id] + char_ids(chat_tok, "Be brief.\nplain")
    assert ds[0].prompt == rows[0]["prompt"]  # reward functions see the user's prompt, not the rendered one


def test_truncation_keeps_the_tail_and_counts(tok):
    rows = [{"prompt": "context context QUESTION"}, {"prompt": "short"}]
    ds = PromptDataset(rows, tok, max_prompt_length=8, overlong="truncate")
    assert ds.num_truncated == 1
    assert [ds[0].truncated, ds[1].truncated] == [
        True,
        False,
    ]  # counted per step as rollout/truncated_prompts
    assert ds[0].prompt_ids == char_ids(tok, "QUESTION")
    assert ds[0].prompt_text == "QUESTION"
    assert ds[0].prompt == "context context QUESTION"
    assert ds[1].prompt_ids == [tok.bos_token_id] + char_ids(tok, "short")


def test_overlong_error_names_row_length_and_fixes(tok):
    rows = [{"prompt": "ok"}, {"prompt": "x" * 20}, {"prompt": "y" * 30}]
    msg = (
        r"row 1: prompt is 21 tokens, longer than data.max_prompt_length=10 \(1 more rows are too\); "
        r"raise data.max_prompt_length or set data.overlong_prompts=truncate"
    )
    with pytest.raises(DataError, match=msg):
        PromptDataset(rows, tok, max_prompt_length=10)


def test_missing_prompt_column_names_columns_and_config_key(tok):
    with pytest.raises(
        DataError, match=r"no 'prompt' column .*columns found: \['question', 'answer'\].*data.prompt_column"
    ):
        PromptDataset([{"question": "q", "answer": 1}], tok)
    ds = PromptDataset([{"question": "q", "answer": 1}], tok, prompt_column="question")
    assert ds[0].prompt == "q" and ds[0].columns == {"answer": 1}


@pytest.mark.parametrize("bad", [42, None, {"text": "hi"}, [], ["hi"], [{"content": "no role"}]])
def test_bad_prompt_names_the_row(tok, bad):
    with pytest.raises(
        DataError, match=r"row 1: prompt .* is not a string or a list of \{\"role\", \"content\"\} messages"
    ):
        PromptDataset([{"prompt": "fine"}, {"prompt": bad}], tok)


def test_chat_prompt_without_chat_template(tok):
    msg = "row 0: .*no chat_template; use a tokenizer with a chat template .* or plain-string prompts"
    with pytest.raises(DataError, match=msg):
        PromptDataset([{"prompt": [{"role": "user", "content": "hi"}]}], tok)


@pytest.mark.parametrize(
    "empty",
    [
        "",
        "  \n\t",
        [{"role": "user", "content": ""}],
        [{"role": "system", "content": " "}, {"role": "user", "content": None}],
    ],
)
def test_empty_prompt_names_the_row_and_the_fix(chat_tok, empty):
    with pytest.raises(DataError, match=r"^row 1: prompt .* is empty; remove the row or fill in its prompt$"):
        PromptDataset([{"prompt": "fine"}, {"prompt": empty}], chat_tok, system_prompt="Be brief.")
    PromptDataset(
        [{"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]}], chat_tok
    )  # one is enough


def test_errors_name_the_file_line_after_the_split(tmp_path, tok):
    """split_rows takes held-out rows out of the middle: errors still name the line of the file."""
    rows = [{"prompt": f"q{i}", "answer": i} for i in range(10)]
    lines = [json.dumps(r) for r in rows]
    lines[7] = json.dumps({"prompt": "x" * 30, "answer": 7})
    (tmp_path / "d.jsonl").write_text(
        "\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n"
    )  # line 6 is blank
    cfg = DataConfig(train_path=str(tmp_path / "d.jsonl"), eval_size=4, max_prompt_length=10)
    with pytest.raises(DataError, match=r"^d.jsonl line 9: prompt is 31 tokens"):
        build_datasets(cfg, tok, seed=0)
    lines[7] = json.dumps({"prompt": "", "answer": 7})
    (tmp_path / "d.jsonl").write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
    with pytest.raises(DataError, match=r"^d.jsonl line 9: prompt '' is empty"):
        build_datasets(cfg, tok, seed=0)
    # Rows given in code are named by their index before the split.
    with pytest.raises(DataError, match=r"^row 7: prompt '' is empty"):
        build_datasets(
            DataConfig(eval_size=4), tok, seed=0, train_rows=[*rows[:7], {"prompt": ""}, *rows[8:]]
        )


def test_where_labels_never_reach_the_columns(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data = build_datasets(DataConfig(train_path=str(tmp_path / "d.jsonl"), eval_size=1), tok, seed=0)
    for ds in (data.train, data.eval):
        assert ds.column_names == ["prompt", "answer", "tags"]
        assert all(set(ds[i].columns) == {"answer", "tags"} for i in range(len(ds)))


def test_empty_dataset_and_bad_options(tok):
    with pytest.raises(DataError, match="no rows"):
        PromptDataset([], tok)
    with pytest.raises(DataError, match=r"data.overlong_prompts='cut' is not one of \['error', 'truncate'\]"):
        PromptDataset(ROWS, tok, overlong="cut")
    with pytest.raises(DataError, match="max_prompt_length=0 must be a positive int"):
        PromptDataset(ROWS, tok, max_prompt_length=0)


# ---------------------------------------------------------------------------------------------
# split_rows


def test_split_rows_sizes_and_determinism():
    rows = [{"prompt": f"q{i}", "i": i} for i in range(20)]
    train, held = split_rows(rows, 5, seed=3)
    assert len(train) == 15 and len(held) == 5
    assert split_rows(rows, 5, seed=3) == (train, held)
    assert split_rows(rows, 5, seed=4)[1] != held
    assert [r["i"] for r in train] == sorted(r["i"] for r in train)  # input order kept
    assert len(split_rows(rows, 0.1, seed=0)[1]) == 2
    assert split_rows(rows, 0, seed=0) == (rows, [])
    msg = "hold out 20 of the dataset's 20 distinct prompts, leaving none to train on; lower data.eval_size"
    with pytest.raises(DataError, match=msg):
        split_rows(rows, 20, seed=0)
    with pytest.raises(DataError, match="must be in \\(0, 1\\)"):
        split_rows(rows, 1.5, seed=0)


def test_split_rows_keeps_duplicate_prompts_on_one_side():
    rows = [{"prompt": "same", "i": i} for i in range(5)] + [
        {"prompt": f"q{i}", "i": 5 + i} for i in range(5)
    ]
    for seed in range(10):
        train, held = split_rows(rows, 3, seed=seed)
        train_prompts = {r["prompt"] for r in train}
        assert not train_prompts & {r["prompt"] for r in held}
        assert len(held) == 3 == len({r["prompt"] for r in held})


_prompt = st.one_of(
    st.sampled_from(["a", "b", "c", "d", "e", "f"]),
    st.sampled_from(["a", "b"]).map(lambda c: [{"role": "user", "content": c}]),
)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(_prompt, min_size=2, max_size=30), frac=st.floats(0.01, 0.99), seed=st.integers(0, 2**32)
)
def test_split_rows_never_overlaps(prompts, frac, seed):
    rows = [{"prompt": p, "i": i} for i, p in enumerate(prompts)]
    n_unique = len({json.dumps(p) for p in prompts})
    n_eval = max(1, int(frac * n_unique))
    if n_eval >= n_unique:
        with pytest.raises(DataError):
            split_rows(rows, n_eval, seed=seed)
        return
    train, held = split_rows(rows, n_eval, seed=seed)
    train_i, held_i = {r["i"] for r in train}, {r["i"] for r in held}
    assert not train_i & held_i

    def key(r):
        return json.dumps(r["prompt"])

    held_keys = {key(r) for r in held}
    assert not {key(r) for r in train} & held_keys
    assert len(held) == len(held_keys) == n_eval
    # nothing is lost but duplicates of held-out prompts
    assert train_i == {r["i"] for r in rows if key(r) not in held_keys}
    assert split_rows(rows, n_eval, seed=seed) == (train, held)


# ---------------------------------------------------------------------------------------------
# PromptSampler


def test_sampler_epochs_cover_every_row_and_wrap():
    s = PromptSampler(10, 4, seed=0)
    b = [s.next() for _ in range(5)]  # 20 indices = exactly two epochs
    flat = [i for batch in b for i in batch]
    assert all(len(x) == 4 for x in b)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert s.epoch == 2
    # batch 3 straddles the end of epoch 0: two from epoch 0, two from epoch 1
    assert b[2][:2] == flat[8:10] and b[2][2:] == flat[10:12]


def test_sampler_epoch_counter_mid_batch():
    s = PromptSampler(5, 3, seed=1)
    s.next()
    assert s.epoch == 0
    s.next()  # runs past row 5 into epoch 1
    assert s.epoch == 1


def test_sampler_is_deterministic_and_seeded():
    def first_batches(seed):
        s = PromptSampler(50, 7, seed=seed)
        return [s.next() for _ in range(10)]

    assert first_batches(11) == first_batches(11)
    assert first_batches(11) != first_batches(12)


def test_sampler_without_shuffle():
    s = PromptSampler(5, 3, seed=0, shuffle=False)
    assert [s.next() for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


@pytest.mark.parametrize("steps_before", [0, 1, 3, 4, 9])
def test_sampler_resume_is_exact(steps_before):
    ref = PromptSampler(13, 5, seed=7)
    for _ in range(steps_before):
        ref.next()
    state = json.loads(json.dumps(ref.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(13, 5, seed=999)  # seed comes from the state
    resumed.load_state_dict(state)
    assert resumed.epoch == ref.epoch
    assert [resumed.next() for _ in range(10)] == [ref.next() for _ in range(10)]


def test_sampler_errors():
    msg = (
        "rollout.prompts_per_step=8 is more than the 5 rows in the dataset; lower rollout.prompts_per_step "
        "or add rows"
    )
    with pytest.raises(DataError, match=msg):
        PromptSampler(5, 8, seed=0)
    with pytest.raises(DataError, match="state is for 5 rows but the dataset has 6"):
        PromptSampler(6, 2, seed=0).load_state_dict(PromptSampler(5, 2, seed=0).state_dict())


def test_a_renamed_prompt_column_with_a_held_out_split_trains(tiny_model_dir, tmp_path, monkeypatch):
    """`grpokit train` with data.prompt_column=question and data.eval_size > 0: the split used to be
    called without the column and died with "no 'prompt' column ... name the prompt column with
    data.prompt_column" although it was named."""
    from typer.testing import CliRunner

    from grpokit.cli import app

    monkeypatch.setattr("grpokit.trainer.plot_run", lambda *a, **k: None)
    rows = [{"question": f"{a} {b}>{a + b}=", "target": a + b} for a in range(1, 5) for b in range(1, 3)]
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = f"{Path(__file__).parent / 'reward_fns.py'}:count_sevens"
    (tmp_path / "config.yaml").write_text("{}\n")
    result = CliRunner().invoke(
        app,
        [
            "train",
            str(tmp_path / "config.yaml"),
            f"model.name_or_path={tiny_model_dir}",
            f"data.train_path={tmp_path / 'questions.jsonl'}",
            "data.prompt_column=question",
            "data.eval_size=2",
            f"rewards=[{{function: '{reward}'}}]",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=4",
            "optim.max_steps=1",
            "algorithm.beta=0.0",
            "eval.k=1",
            "logging.sample_every=0",
            "logging.tensorboard=false",
            "checkpoint.save_every=0",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    assert result.exit_code == 0, (result.output, result.exception)
    logged = read_metrics(tmp_path / "run")
    assert [r["step"] for r in logged] == [0, 1]
    assert all(r["eval/num_prompts"] == 2 for r in logged)  # the 2 held-out questions, before and after
