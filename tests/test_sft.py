"""SFT warm-start: completion-only labels, the loss, learning a toy task, files in and out."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.data import DataError
from grpokit.policy.optim import lr_lambda
from grpokit.sft import IGNORE_INDEX, collate, completion_loss, encode_pair, load_pairs, train_sft
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer
from tests.helpers import read_metrics

# toy task: swap two digits ("47=" -> "74"); a test-size model learns it in a few dozen steps
SWAP = [{"prompt": f"{i}{j}=", "completion": f"{j}{i}"} for i in range(10) for j in range(10)]


@pytest.fixture()
def tok():
    return build_tokenizer("0123456789+-=")


def exact_match(model, tok, pairs):
    tok.padding_side = "left"
    enc = tok([p["prompt"] for p in pairs], return_tensors="pt", padding=True)
    out = model.generate(
        **enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t == p["completion"] for t, p in zip(texts, pairs, strict=True)) / len(pairs)


def prompt_ids(tok, prompt):
    return tok(prompt)["input_ids"]  # a string prompt as grpokit.data renders it: the tokenizer's BOS first


def test_encode_pair_labels_only_the_completion_and_eos(tok):
    ids, labels, truncated = encode_pair(tok, prompt_ids(tok, "12="), "21", max_length=16)
    c = tok.convert_tokens_to_ids
    assert ids == [tok.bos_token_id, c("1"), c("2"), c("="), c("2"), c("1"), tok.eos_token_id]
    assert labels == [IGNORE_INDEX] * 4 + [c("2"), c("1"), tok.eos_token_id]
    assert not truncated
    ids, labels, truncated = encode_pair(tok, prompt_ids(tok, "12="), "21", max_length=5)
    assert truncated and len(ids) == len(labels) == 5 and labels[-1] == c("2")


def test_collate_right_pads_with_plain_positions(tok):
    a = encode_pair(tok, prompt_ids(tok, "1="), "1", 16)[:2]
    b = encode_pair(tok, prompt_ids(tok, "123="), "321", 16)[:2]
    batch = collate([a, b], tok.pad_token_id)
    assert batch["input_ids"][0].tolist() == a[0] + [tok.pad_token_id] * 4
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 4, [1] * 9]
    assert batch["labels"][0].tolist() == a[1] + [IGNORE_INDEX] * 4
    assert batch["position_ids"].tolist() == [list(range(9))] * 2


def test_loss_is_cross_entropy_of_completion_tokens_only(tok):
    model = build_tiny_llama(tok, size="test")
    batch = collate(
        [
            encode_pair(tok, prompt_ids(tok, "12="), "21", 16)[:2],
            encode_pair(tok, prompt_ids(tok, "3+45="), "48", 16)[:2],
        ],
        tok.pad_token_id,
    )
    loss, n_tokens = completion_loss(model, batch)
    assert n_tokens == 3 + 3  # two digits + EOS per row
    # by hand: the log-prob of each completion token given everything before it
    logp = torch.log_softmax(
        model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits, -1
    )
    expected = []
    for row, (start, end) in enumerate([(4, 7), (6, 9)]):
        for t in range(start, end):
            expected.append(-logp[row, t - 1, batch["input_ids"][row, t]])
    torch.testing.assert_close(loss, torch.stack(expected).mean())
    # and transformers' own label-shifting loss agrees
    torch.testing.assert_close(loss, model(**batch).loss)


def test_lr_schedule_warmup_then_decay_to_zero():
    cos = lr_lambda("cosine", warmup=2, total=10)
    assert [cos(0), cos(1), cos(2)] == [0.5, 1.0, 1.0]
    assert cos(6) == pytest.approx(0.5) and cos(10) == pytest.approx(0.0)
    lin = lr_lambda("linear", warmup=0, total=10)
    assert [lin(0), lin(5), lin(10)] == [1.0, 0.5, 0.0]


def test_training_and_sft_share_the_optimizer_fields_with_their_own_defaults():
    """One set of optimizer fields (OptimizerSettings); SFT's defaults differ only where stated."""
    from grpokit.config import SFT_OPTIMIZER_DEFAULTS, OptimConfig, OptimizerSettings, SFTSection
    from grpokit.policy.optim import Optimizer

    shared = set(OptimizerSettings.model_fields)
    assert shared <= set(OptimConfig.model_fields) and shared <= set(SFTSection.model_fields)
    for name in shared:
        sft, optim = SFTSection.model_fields[name], OptimConfig.model_fields[name]
        assert sft.metadata == optim.metadata and sft.description == optim.description
        assert sft.default == SFT_OPTIMIZER_DEFAULTS.get(name, optim.default), name
    # training reads warmup_ratio the way SFT does: warmup_steps, else that fraction of the steps
    w = torch.nn.Parameter(torch.zeros(1))
    opt = Optimizer([("w", w)], OptimConfig(warmup_ratio=0.5), lr=1.0, total_steps=10)
    assert opt.scheduler.get_last_lr() == [pytest.approx(0.2)]  # step 0 of a 5-step warm-up


@pytest.mark.slow
def test_sft_lowers_the_loss_and_learns_a_toy_task(tok):
    torch.manual_seed(0)
    model = build_tiny_llama(tok, size="test")
    assert exact_match(model, tok, SWAP) < 0.1
    logs = []
    stats = train_sft(
        model,
        tok,
        SWAP,
        max_steps=40,
        batch_size=32,
        learning_rate=3e-3,
        warmup_steps=5,
        seed=0,
        log_every=10,
        on_step=lambda step, m: m and logs.append((step, m)),
    )
    assert stats["steps"] == 40 and [step for step, _ in logs] == [10, 20, 30, 40]
    assert stats["final_loss"] < stats["first_loss"] / 4
    assert logs[-1][1]["sft/loss"] < logs[0][1]["sft/loss"]
    assert exact_match(model, tok, SWAP) > 0.8


def test_sft_is_deterministic_for_a_seed(tok):
    weights = []
    for _ in range(2):
        model = build_tiny_llama(tok, size="test")
        train_sft(model, tok, SWAP, max_steps=5, batch_size=16, seed=7)
        weights.append(model.state_dict())
    for name, w in weights[0].items():
        assert torch.equal(w, weights[1][name]), name


def test_sft_length_is_epochs_or_steps(tok):
    model = build_tiny_llama(tok, size="test")
    assert train_sft(model, tok, SWAP, epochs=0.5, batch_size=10)["steps"] == 5
    assert train_sft(model, tok, SWAP, batch_size=30)["steps"] == 4  # one epoch by default
    assert train_sft(model, tok, SWAP, epochs=3, max_steps=2, batch_size=30)["steps"] == 2  # max_steps wins
    with pytest.raises(ValueError, match="lr_scheduler"):
        train_sft(model, tok, SWAP, lr_scheduler="exp")
    with pytest.raises(ValueError, match="learning_rat"):  # a key that does not exist is named too
        train_sft(model, tok, SWAP, learning_rat=1e-3)


def test_one_set_of_defaults_for_the_command_and_the_function(tok):
    """`grpokit sft` and train_sft read their defaults from one place, grpokit.config.SFTSection."""
    import inspect

    from grpokit.config import SFTConfig, SFTSection

    assert SFTConfig().sft == SFTSection()
    params = inspect.signature(train_sft).parameters
    assert not set(SFTSection.model_fields) & set(params)  # no second copy of a default in the signature
    defaults = SFTSection()
    assert (defaults.learning_rate, defaults.batch_size, defaults.max_grad_norm) == (1e-4, 32, 1.0)


def test_max_grad_norm_zero_means_off(tok):
    """0 = off, as optim.max_grad_norm in training; it used to scale every gradient to 0 (a frozen model)."""
    model = build_tiny_llama(tok, size="test")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = train_sft(
        model,
        tok,
        SWAP,
        max_steps=3,
        batch_size=16,
        learning_rate=1e-2,
        max_grad_norm=0,
        log_every=1,
        on_step=lambda step, m: None,
    )
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters()), "every parameter trains"
    assert stats["final_loss"] < stats["first_loss"]


def test_grpokit_sft_command_config_overrides_progress_metrics_and_table(tmp_path, tok):
    """`grpokit sft CONFIG key=value ...`: the typed config (file + dotted overrides), a progress line and an
    end-of-run table on the screen, metrics.jsonl with sft/* and held-out eval/*, and final/ that loads."""
    from typer.testing import CliRunner

    from grpokit.cli import app

    base = tmp_path / "base"
    tok.save_pretrained(base)
    build_tiny_llama(tok, size="test").save_pretrained(base)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in SWAP))
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model: {{name_or_path: {base}}}\ndata: {{train_path: {data}, eval_size: 20}}\n"
        "sft: {max_steps: 40, batch_size: 32, learning_rate: 1.0e-3, warmup_steps: 5, log_every: 10}\n"
    )
    out = tmp_path / "sft"
    r = CliRunner().invoke(
        app,
        [
            "sft",
            str(config),
            "sft.learning_rate=3e-3",
            f"output_dir={out}",
            "logging.tensorboard=false",
            "--threads",
            "1",
        ],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    assert "threads: 1 (threads setting" in r.output  # the count in use, said at start
    assert "step 40/40" in r.output and "sft/loss" in r.output  # the progress line
    assert (
        "held-out exact_match: before -> after" in r.output and "{'steps'" not in r.output
    )  # a table, not a dict
    rows = read_metrics(out)
    assert rows[0]["step"] == 0 and rows[0]["eval/exact_match"] < 0.2  # before training
    assert [r["step"] for r in rows if "sft/loss" in r] == [10, 20, 30, 40]
    assert (
        rows[-1]["eval/exact_match"] > 0.5 and rows[-1]["eval/loss"] < rows[0]["eval/loss"] / 2
    )  # unseen pairs
    assert all(r["perf/train_tokens_per_s"] > 0 for r in rows if "sft/loss" in r)
    stats = json.loads((out / "sft_stats.json").read_text())
    assert stats["steps"] == 40 and stats["examples"] == len(SWAP) - 20  # 20 held out, never trained on
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert exact_match(model, AutoTokenizer.from_pretrained(out / "final"), SWAP) > 0.8
    r = CliRunner().invoke(app, ["sft", str(config), "sft.lr=1"])
    assert r.exit_code == 2 and "unknown config key 'sft.lr'" in r.output


def test_load_pairs_reads_csv_through_grpokit_data_and_names_a_missing_column(tmp_path, tok):
    good = tmp_path / "pairs.csv"
    with good.open("w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "completion"])
        w.writeheader()
        w.writerows(SWAP[1:4])  # CSV columns of numbers are read as numbers (as datasets does): "10" -> 10
    ds = load_pairs(good, tok)
    assert [ds[i].prompt for i in range(3)] == [p["prompt"] for p in SWAP[1:4]]
    assert [str(ds[i].columns["completion"]) for i in range(3)] == [p["completion"] for p in SWAP[1:4]]
    assert ds[0].prompt_ids == prompt_ids(tok, SWAP[1]["prompt"])
    with_system = load_pairs(
        good, tok, system_prompt="swap"
    )  # rendered as training prompts are (data.system_prompt)
    assert with_system[0].prompt_ids == prompt_ids(tok, "swap\n" + SWAP[1]["prompt"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1=", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match="'completion'"):
        load_pairs(bad, tok)
    with pytest.raises(DataError, match="not found"):
        load_pairs(tmp_path / "pairs.parquet", tok)
