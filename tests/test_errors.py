"""Every bad input listed in docs/errors.md, and what the user sees.

Run: .venv/bin/python -m pytest tests/test_errors.py

User mistakes give one line on stderr that names the problem and the fix, exit status 2 and no
traceback. Reward functions that misbehave are not errors: the sample gets no reward from them,
the failure is counted (reward/errors/<name>) and logged once (unless reward_errors=raise).
Each test runs `grpokit train` in-process through typer's test runner (the same code the console
script runs, without paying for a Python start per row); test_console_script_one_line runs the
real console script once. The last column of the table in docs/errors.md names the test of each
row; test_every_row_has_a_test keeps the two in step.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from grpokit.checkpoint import list_checkpoints
from grpokit.cli import app
from grpokit.doctor import diagnose
from grpokit.metrics.compute import read_metrics
from tests.helpers import NO_TASK, require, tiny_overrides
from tests.helpers import read_metrics as read_test_metrics

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    {"prompt": f"{a} {b} {c}>{t}=", "target": t}
    for a, b, c, t in [
        (3, 4, 5, 12),
        (2, 1, 5, 10),
        (6, 4, 8, 9),
        (1, 2, 3, 6),
        (7, 1, 2, 9),
        (5, 5, 2, 8),
        (9, 3, 1, 4),
        (8, 2, 6, 4),
    ]
]

BAD_REWARDS = """
import math
import time

def sevens(completions, **kwargs):
    return [c.count("7") / max(len(c), 1) for c in completions]

def needs_answer(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]

def boom(completions, **kwargs):
    raise ZeroDivisionError("division by zero")

def too_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def strings(completions, **kwargs):
    return ["1.0"] * len(completions)

def nan_and_inf(completions, **kwargs):
    return [math.nan if i % 2 else math.inf for i in range(len(completions))]

def sleepy(completions, **kwargs):
    # stuck (a network call that never answers, a deadlock): far longer than the tests' timeouts
    time.sleep(3)
    return [0.0] * len(completions)

def slowish(completions, **kwargs):
    time.sleep(0.2)
    return [0.0] * len(completions)

def short_from_step_two(completions, **kwargs):
    # one reward too few from its second call (step 2) on
    global calls3
    calls3 = globals().get("calls3", 0) + 1
    return [0.0] * (len(completions) - (calls3 >= 2))

def huge(completions, **kwargs):
    # finite floats, but 10 x this overflows float32: the weighted total is inf (once: the run goes on)
    global calls
    calls = globals().get("calls", 0) + 1
    return [3e38 if calls == 1 else 0.0 for _ in completions]

def huge_tie_breaker(completions, **kwargs):
    # finite totals whose group mean overflows float32: the advantages are NaN (once)
    global calls2
    calls2 = globals().get("calls2", 0) + 1
    return [(3e38 if i % 4 else 0.0) if calls2 == 1 else 0.0 for i in range(len(completions))]
"""


@pytest.fixture(autouse=True)
def _quiet_and_quick(monkeypatch):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # as grpokit.cli.main does; the test runner skips main()
    monkeypatch.setattr("grpokit.trainer.plot_run", lambda *a, **k: None)  # plots are not what these test


@pytest.fixture
def env(tiny_model_dir, tmp_path):
    """A config file, a prompts file and a rewards file in tmp_path, and the overrides of a 1-step run."""
    (tmp_path / "config.yaml").write_text("{}\n")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    base = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        *NO_TASK,
        f"data.train_path={tmp_path / 'prompts.jsonl'}",
        f"rewards=[{{function: '{tmp_path / 'bad_rewards.py'}:sevens'}}]",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=4",
        "optim.learning_rate=1e-6",  # the default (TINY_RUN's is 3e-3)
        "optim.max_steps=1",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    )
    return tmp_path, base


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rewards(tmp_path, *names, weight=1.0) -> str:
    return (
        "rewards=["
        + ", ".join(f"{{function: '{tmp_path / 'bad_rewards.py'}:{n}', weight: {weight}}}" for n in names)
        + "]"
    )


def train(env, *overrides, config=None):
    tmp_path, base = env
    return CliRunner().invoke(app, ["train", str(config or tmp_path / "config.yaml"), *base, *overrides])


def user_error(result, *words) -> str:
    """The one stderr line of a user mistake (exit 2, no traceback); asserts it names `words`."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def metrics(env) -> list[dict]:
    return read_test_metrics(env[0] / "run")


# ----------------------------------------------------------------------------- config


def test_config_file_missing(env):
    user_error(train(env, config=env[0] / "nope.yaml"), "config file", "nope.yaml", "not found")


def test_config_not_yaml(env):
    bad = env[0] / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    user_error(train(env, config=bad), "is not valid YAML at line")


def test_config_file_empty(env):
    """An empty file (or one of comments only) is named so, not blamed on the first key it lacks."""
    for text in ("", "# model: {name_or_path: ...}\n\n"):
        empty = env[0] / "empty.yaml"
        empty.write_text(text)
        line = user_error(train(env, config=empty))
        assert line == (
            f"error: config file {str(empty)!r} is empty: give it the sections of a run (model:, data:, "
            "rewards:, ...; examples/config.yaml is one, `grpokit config` lists every key), or write {} to "
            "set everything with key=value overrides"
        )
    assert train(env, config=env[0] / "config.yaml").exit_code == 0  # `{}` and overrides: a run


def test_config_typo_did_you_mean(env):
    user_error(
        train(env, "algorithm.betaa=0.1"), "unknown config key 'algorithm.betaa'", "did you mean 'beta'?"
    )


def test_config_bad_value_lists_allowed(env):
    line = user_error(train(env, "algorithm.loss_type=foo"), "'algorithm.loss_type'", "'foo'", "'grpo'")
    assert f"`{line}`" in (ROOT / "docs" / "errors.md").read_text()  # the table quotes today's list


def test_group_size_below_two(env):
    user_error(
        train(env, "rollout.num_generations=1"), "rollout.num_generations", "greater than or equal to 2"
    )


def test_importance_correction_without_sampler_logprobs(env):
    user_error(
        train(env, "rollout.engine=hf", "rollout.importance_correction=token_truncate"),
        "rollout.importance_correction=token_truncate needs the sampler's log-probs",
        "rollout.engine=fast or vllm",
    )


def test_policy_lag_without_sampler_logprobs(env):
    user_error(
        train(env, "rollout.engine=hf", "rollout.max_policy_lag=1"),
        "rollout.max_policy_lag=1 needs the sampler's log-probs",
        "use rollout.engine=fast or vllm, or max_policy_lag=0",
    )


def test_process_sampler_without_lag_or_fast(env):
    user_error(
        train(env, "rollout.engine=hf", "rollout.async_sampler=process"),
        "rollout.async_sampler=process runs the fast engine in a process of its own",
        "set rollout.engine=fast (it is hf)",
        "or async_sampler=thread",
    )


def test_importance_bounds_out_of_order(env):
    user_error(
        train(
            env,
            "rollout.engine=fast",
            "rollout.importance_correction=token_mask",
            "rollout.importance_c_min=3",
            "rollout.importance_c_max=2",
        ),
        "rollout.importance_c_min=3.0 must be below rollout.importance_c_max=2.0",
    )


def test_vllm_with_a_head_size_it_cannot_run(env):
    # the tests' tiny model has 4 heads of 24; vLLM's CPU attention kernel takes 32, 64, 80, ...
    user_error(
        train(env, "rollout.engine=vllm"),
        "rollout.engine=vllm on CPU needs an attention head size in [32, 64",
        "this model's is 24",
        "use rollout.engine=fast or hf",
    )


SERVER = ("rollout.engine=vllm", "rollout.vllm_mode=server", "rollout.vllm_server_timeout=1")


def test_vllm_server_not_reachable(env):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    user_error(
        train(env, *SERVER, f"rollout.vllm_server_url={url}"),
        f"no rollout server answers at {url} (rollout.vllm_server_url) after 1 s "
        "(rollout.vllm_server_timeout)",
        f"start one with `grpokit serve MODEL_DIR --port {port}`, or use rollout.vllm_mode=colocate",
    )


def test_vllm_server_does_not_answer(env):
    with socket.socket() as s:  # accepts connections (the kernel's backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        user_error(
            train(env, *SERVER, f"rollout.vllm_server_url={url}"),
            f"the rollout server at {url} did not answer GET /health within 1 s "
            "(rollout.vllm_server_timeout)",
            "raise rollout.vllm_server_timeout, or see the server's output",
        )


def test_vllm_server_mode_without_the_vllm_engine(env):
    user_error(
        train(env, "rollout.engine=fast", "rollout.vllm_mode=server"),
        "rollout.vllm_mode=server samples from a vLLM server; set rollout.engine=vllm (it is fast)",
    )
    user_error(
        train(
            env, "rollout.engine=vllm", "rollout.vllm_mode=server", "rollout.vllm_server_url=localhost:8000"
        ),
        "rollout.vllm_server_url='localhost:8000' must be http://HOST:PORT, as `grpokit serve` prints it",
    )


def test_serve_on_a_port_in_use(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(
            app, ["serve", str(tiny_model_dir), "--port", str(port), "--threads", "1"]
        )
    user_error(
        result,
        f"grpokit serve cannot listen on 127.0.0.1:{port} (Address already in use): pick another --port "
        "(0 = any free one) or stop what uses it",
    )


def test_prompts_per_step_not_divisible_by_minibatches(env):
    user_error(
        train(env, "rollout.prompts_per_step=3", "rollout.num_generations=2", "optim.num_minibatches=4"),
        "optim.num_minibatches=4 must divide the rollout batch",
        "= 6",
    )


def test_minibatch_not_divisible_by_micro_batch(env):
    user_error(
        train(env, "rollout.prompts_per_step=3", "rollout.num_generations=2", "optim.micro_batch_size=4"),
        "optim.micro_batch_size=4 must divide the minibatch size 6",
    )


def test_eval_reward_not_configured(env):
    user_error(
        train(env, "eval.reward=acuracy"), "eval.reward='acuracy' is not a configured reward", "sevens"
    )


def test_epsilon_high_below_epsilon(env):
    user_error(
        train(env, "algorithm.epsilon=0.2", "algorithm.epsilon_high=0.1"),
        "algorithm.epsilon_high=0.1 is below algorithm.epsilon=0.2",
        "clip-higher",
        "set algorithm.epsilon_high >= algorithm.epsilon or leave it unset",
    )
    # A preset's own pair is kept unless the user moves one end of it.
    user_error(
        train(env, "algorithm.preset=gspo", "algorithm.epsilon=0.2"),
        "algorithm.epsilon_high=0.0004 (from algorithm.preset=gspo) is below algorithm.epsilon=0.2",
    )
    from grpokit.config import PRESETS, load_config

    for name in PRESETS:
        load_config(None, [f"algorithm.preset={name}"])


def test_tracker_not_installed(env, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if it were not installed
    user_error(
        train(env, "logging.wandb=true"),
        "logging.wandb=true but wandb is not installed",
        "pip install 'grpokit[wandb]' or set logging.wandb=false",
    )
    assert not (env[0] / "run" / "metrics.jsonl").exists()  # stopped before the first step


# ----------------------------------------------------------------------------- model and output folder


def test_model_path_missing(env):
    user_error(
        train(env, f"model.name_or_path={env[0] / 'no-such-model'}"),
        "no-such-model",
        "no such folder",
        "fix the path",
    )


def test_a_run_whose_memory_plan_cannot_fit_is_refused_before_its_model_loads(env, monkeypatch):
    monkeypatch.setattr("grpokit.policy.plan.available_memory", lambda ranks: (1 << 20, "cpu"))  # 1 MiB
    loaded = []
    monkeypatch.setattr("grpokit.policy.loading.load_model", lambda *a, **k: loaded.append(1))
    msg = user_error(train(env), "memory plan: the update needs", "0.00 GiB available", "grpokit plan")
    assert "model.memory_check=false" in msg and not loaded


def test_output_dir_not_writable(env, monkeypatch):
    # We run as root, so chmod would not stop us: a path under a regular file cannot be created by anyone.
    (env[0] / "file.txt").write_text("x")
    loaded = []
    monkeypatch.setattr("grpokit.policy.loading.load_model", lambda *a, **k: loaded.append(1))
    msg = user_error(
        train(env, f"output_dir={env[0] / 'file.txt' / 'run'}"),
        "output_dir",
        "file.txt/run",
        "not a writable folder",
    )
    assert "Not a directory" in msg and not loaded  # checked before the model is loaded


def test_context_longer_than_model_positions(env):
    # The tiny Llama has max_position_embeddings=256; the longest prompt is 10 tokens.
    user_error(
        train(env, "rollout.max_completion_length=300"),
        "max_position_embeddings=256",
        "rollout.max_completion_length=300",
        "lower rollout.max_completion_length to 246",
    )
    assert not (env[0] / "run" / "metrics.jsonl").exists()  # nothing trained


def test_context_shorter_than_the_prompts(env, tiny_model_dir):
    """A model whose context cannot hold the prompts themselves: lowering rollout.max_completion_length would
    not help (and 0 is refused), so the line names the keys that shorten or truncate the prompts."""
    model = env[0] / "short-context"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 5}))
    msg = user_error(
        train(env, f"model.name_or_path={model}"),
        "the longest prompt (10 tokens) alone fills the model's max_position_embeddings=5",
        "the prompts alone exceed the context",
        "data.max_prompt_length=1 and data.overlong_prompts=truncate",
    )
    assert "rollout.max_completion_length" not in msg  # the prompts are the problem, not the completions
    assert not (env[0] / "run" / "metrics.jsonl").exists()  # nothing trained


def test_gguf_file_cut_short(env, monkeypatch):
    """An interrupted download: cut inside its tensor data, and inside its metadata."""
    import numpy as np
    from gguf import GGUFWriter

    monkeypatch.setenv("GRPOKIT_CACHE", str(env[0] / "cache"))
    model = env[0] / "model.gguf"
    writer = GGUFWriter(str(model), "llama")
    writer.add_string("general.name", "a GGUF file whose end is missing")
    writer.add_tensor("token_embd.weight", np.zeros((16, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = model.read_bytes()
    key = "model.tokenizer / model.name_or_path"
    model.write_bytes(whole[:-64])
    line = user_error(train(env, f"model.name_or_path={model}"))
    assert line == (
        f"error: {key}={str(model)!r} is truncated: its tensors end at byte {len(whole):,} but the file has "
        f"{len(whole) - 64:,} bytes ({(len(whole) - 64) / len(whole):.0%}); download or copy it again"
    )
    model.write_bytes(whole[:100])
    line = user_error(train(env, f"model.name_or_path={model}"))
    assert line == (
        f"error: {key}={str(model)!r} is truncated or damaged: its header (metadata and tensor list) cannot "
        "be read in its 100 bytes; download or copy it again"
    )


def test_model_folder_with_only_a_tokenizer(env, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = env[0] / "just-a-tokenizer"
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tok)
    assert not (tok / "config.json").exists()
    user_error(
        train(env, f"model.name_or_path={tok}"),
        f"model.name_or_path='{tok}': the folder holds a tokenizer but no config.json or weights",
        "point model.name_or_path at the model's folder (model.tokenizer names a separate tokenizer)",
    )


def test_tokenizer_without_pad_token_falls_back_to_eos(env, tiny_model_dir, caplog):
    tok = env[0] / "tok-no-pad"
    shutil.copytree(tiny_model_dir, tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg.pop("pad_token")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        r = train(env, f"model.tokenizer={tok}")
    assert r.exit_code == 0, r.output
    assert "has no pad token; padding with its EOS token '</s>'" in caplog.text


def test_top_p_on_an_engine_without_kept_sets_says_so(env, caplog):
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        r = train(env, "rollout.engine=hf", "rollout.top_p=0.9", "rollout.top_k=20")
    assert r.exit_code == 0, r.output
    said = [m for m in caplog.messages if "does not record the tokens top_k / top_p kept" in m]
    assert len(said) == 1 and "rollout.engine=hf" in said[0] and "untruncated distribution" in said[0]


# ----------------------------------------------------------------------------- data


def test_dataset_missing(env):
    user_error(
        train(env, f"data.train_path={env[0] / 'nope.jsonl'}"),
        "dataset not found",
        "nope.jsonl",
        "data.train_path",
    )


def test_dataset_empty(env):
    (env[0] / "empty.jsonl").write_text("")
    user_error(train(env, f"data.train_path={env[0] / 'empty.jsonl'}"), "has no rows")


def test_dataset_bad_json_line(env):
    (env[0] / "bad.jsonl").write_text('{"prompt": "1 2>3="}\n{"prompt": \n')
    user_error(
        train(env, f"data.train_path={env[0] / 'bad.jsonl'}"),
        "line 2 is not valid JSON",
        "fix or remove that line",
    )


def test_dataset_unsupported_format(env):
    (env[0] / "prompts.txt").write_text("1 2>3=\n")
    user_error(
        train(env, f"data.train_path={env[0] / 'prompts.txt'}"),
        "unsupported dataset file 'prompts.txt'",
        ".jsonl",
    )


def test_dataset_without_prompt_column(env):
    path = write_jsonl(
        env[0] / "q.jsonl", [{"question": r["prompt"], "target": r["target"]} for r in PROMPTS]
    )
    user_error(
        train(env, f"data.train_path={path}"), "no 'prompt' column", "'question'", "data.prompt_column"
    )


def test_fewer_rows_than_prompts_per_step(env):
    path = write_jsonl(env[0] / "two.jsonl", PROMPTS[:1])
    user_error(train(env, f"data.train_path={path}"), "rollout.prompts_per_step=2 is more than the 1 rows")


def test_eval_size_leaves_nothing_to_train_on(env):
    user_error(train(env, "data.eval_size=8"), "data.eval_size", "leaving none to train on")


def test_chat_prompts_without_chat_template(env):
    path = write_jsonl(
        env[0] / "chat.jsonl", [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in PROMPTS]
    )
    user_error(
        train(env, f"data.train_path={path}"),
        "chat.jsonl line 1: prompt",
        "no chat_template",
        "plain-string prompts",
    )


def test_prompt_longer_than_max_prompt_length(env):
    user_error(
        train(env, "data.max_prompt_length=5"),
        "prompts.jsonl line 1: prompt is 10 tokens",
        "data.max_prompt_length=5",
        "data.overlong_prompts=truncate",
    )


def test_prompt_longer_than_max_prompt_length_truncated(env, caplog):
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        r = train(env, "data.max_prompt_length=5", "data.overlong_prompts=truncate")
    assert r.exit_code == 0, r.output
    assert "8 of 8 prompts are longer than data.max_prompt_length=5 tokens" in caplog.text


def test_dataset_not_utf8(env):
    path = env[0] / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1 2 3>6="}\n{"prompt": "2 2 2>6="}\n{"prompt": "caf\xe9 1>1="}\n')
    user_error(
        train(env, f"data.train_path={path}"),
        "latin1.jsonl: line 3 is not valid UTF-8 (byte 0xe9 at column 16)",
        "re-save the file as UTF-8",
    )


def test_data_error_names_the_file_line_after_the_eval_split(env):
    """The rows held out by data.eval_size come out of the middle of the file: the error still names
    the line the user can open, not the row's position in what is left (it used to say "row 7")."""
    long = {"prompt": "1 2 3 4 5 6 7 8 9>45=" * 2, "target": 45}
    text = "".join(json.dumps(r) + "\n" for r in PROMPTS) + "\n" + json.dumps(long) + "\n"  # a blank line 9
    (env[0] / "prompts.jsonl").write_text(text)
    user_error(
        train(env, "data.eval_size=3", "data.max_prompt_length=20"),
        "prompts.jsonl line 10: prompt is 43 tokens, longer than data.max_prompt_length=20",
    )


def test_empty_prompt(env):
    rows = [*PROMPTS[:2], {"prompt": "  ", "target": 1}, *PROMPTS[2:]]
    path = write_jsonl(env[0] / "blank.jsonl", rows)
    user_error(
        train(env, f"data.train_path={path}"),
        "blank.jsonl line 3: prompt '  ' is empty",
        "remove the row or fill in its prompt",
    )


def test_resume_with_a_different_dataset(env):
    assert train(env).exit_code == 0
    more = write_jsonl(env[0] / "more.jsonl", PROMPTS + [{"prompt": "4 4 4>12=", "target": 12}])
    # A changed data.train_path alone stops the resume (tests/test_crash.py); allowed, the data must still
    # fit.
    user_error(
        train(
            env,
            f"data.train_path={more}",
            "optim.max_steps=2",
            "checkpoint.allow_changes=[data.train_path,optim.max_steps]",
        ),
        "sampler state is for 8 rows but the dataset has 9",
        "same dataset",
    )


def test_resume_with_another_model(env):
    assert train(env).exit_code == 0
    from transformers import AutoTokenizer

    from grpokit.tasks.tiny_model import build_tiny_llama

    other = env[0] / "other-model"
    tok = AutoTokenizer.from_pretrained(env[1][0].split("=", 1)[1])
    build_tiny_llama(tok, size="test", hidden_size=64).save_pretrained(other)
    tok.save_pretrained(other)
    user_error(
        train(
            env,
            f"model.name_or_path={other}",
            "optim.max_steps=2",
            "checkpoint.allow_changes=[model.name_or_path,optim.max_steps]",
        ),
        "step-000001' holds weights of another architecture than model.name_or_path=",
        "hidden_size 96 -> 64",
        "give this run a new output_dir",
    )


def test_resume_with_a_same_shaped_model_of_another_architecture(env):
    """A run of a 3-head model resumed with a 2-head one (checkpoint.allow_changes=[model.name_or_path]):
    every weight has the same shape and loads, and computes another function. The resume is refused naming
    the fields; final/ keeps the model the run trained."""
    from transformers import AutoTokenizer

    from grpokit.tasks.tiny_model import build_tiny_llama

    tok = AutoTokenizer.from_pretrained(env[1][0].split("=", 1)[1])
    models = {}
    for heads in (3, 2):
        models[heads] = env[0] / f"{heads}-heads"
        build_tiny_llama(tok, size="test", num_heads=heads).save_pretrained(models[heads])
        tok.save_pretrained(models[heads])
    assert train(env, f"model.name_or_path={models[3]}").exit_code == 0
    final = (env[0] / "run" / "final" / "config.json").read_text()
    line = user_error(
        train(
            env,
            f"model.name_or_path={models[2]}",
            "optim.max_steps=2",
            "checkpoint.allow_changes=[model.name_or_path]",
        )
    )
    step_1 = env[0] / "run" / "checkpoints" / "step-000001"
    assert line == (
        f"error: {str(step_1)!r} holds weights of another architecture than "
        f"model.name_or_path={str(models[2])!r} (head_dim 32 -> 48; num_attention_heads 3 -> 2; "
        "num_key_value_heads 3 -> 2): they fit its shapes but would compute another function; resume with "
        f"the model it was trained from ({str(models[3])!r}), or give this run a new output_dir to start "
        "from this model"
    )
    assert (env[0] / "run" / "final" / "config.json").read_text() == final
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [1]


def test_damaged_checkpoint(env):
    assert train(env).exit_code == 0
    (env[0] / "run" / "checkpoints" / "step-000001" / "model.safetensors").write_bytes(b"not safetensors")
    user_error(
        train(env, "optim.max_steps=2", "checkpoint.allow_changes=[optim.max_steps]"),
        "step-000001' cannot be read",
        "delete it to resume from the one before",
    )


# ----------------------------------------------------------------------------- rewards


def test_reward_module_not_found(env):
    user_error(
        train(env, "rewards=[{function: 'no_such_module:score'}]"),
        "module 'no_such_module' not found",
        "PYTHONPATH",
    )


def test_reward_function_not_in_module(env):
    user_error(train(env, rewards(env[0], "scroe")), "has no attribute 'scroe'", "check the name after ':'")


def test_reward_file_not_found(env):
    user_error(
        train(env, "rewards=[{function: 'no/such/file.py:score'}]"), "file 'no/such/file.py' not found"
    )


def test_reward_function_typo_did_you_mean(env):
    user_error(
        train(env, rewards(env[0], "sevns")),
        "has no attribute 'sevns'; did you mean 'sevens'?",
        "check the name after ':'",
    )


def test_reward_module_typo_did_you_mean(env, monkeypatch):
    monkeypatch.chdir(env[0])  # a top-level module is looked for next to the command, as `python -m` does
    user_error(
        train(env, "rewards=[{function: 'bad_rewads:sevens'}]"),
        "module 'bad_rewads' not found; did you mean 'bad_rewards'?",
        "PYTHONPATH",
    )
    user_error(
        train(env, "rewards=[{function: 'grpokit.rewards.bultins:math'}]"),
        "module 'grpokit.rewards.bultins' not found; did you mean 'grpokit.rewards.builtins'?",
    )


def test_reward_file_typo_did_you_mean(env):
    user_error(
        train(env, f"rewards=[{{function: '{env[0] / 'bad_reward.py'}:sevens'}}]"),
        "bad_reward.py' not found",
        f"did you mean '{env[0] / 'bad_rewards.py'}'?",
        "fix the path",
    )


def test_reward_builtin_typo(env):
    user_error(
        train(env, "rewards=[{function: mth}]"), "reward 'mth' is not a built-in", "did you mean 'math'?"
    )


def test_reward_needs_a_missing_column(env, monkeypatch):
    rolled = []
    monkeypatch.setattr("grpokit.trainer.Trainer.rollout", lambda *a: rolled.append(1))
    user_error(
        train(env, rewards(env[0], "needs_answer")),
        "needs argument 'answer'",
        "dataset columns: ['prompt', 'target'] (the prompt column 'prompt' is passed as `prompts`). Add the "
        "column",
    )
    only_prompts = write_jsonl(env[0] / "only_prompts.jsonl", [{"prompt": r["prompt"]} for r in PROMPTS])
    user_error(
        train(env, rewards(env[0], "needs_answer"), f"data.train_path={only_prompts}"),
        "dataset columns: ['prompt'] (the prompt column 'prompt' is passed as `prompts`). Add the column",
    )
    assert not rolled  # found at start, not at the first rollout


def test_misbehaving_rewards_are_counted_not_fatal(env, caplog):
    """A reward function that raises, returns the wrong length, strings, or NaN / inf."""
    fns = ["sevens", "boom", "too_short", "strings", "nan_and_inf"]
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        r = train(env, rewards(env[0], *fns), "optim.max_steps=2")
    assert r.exit_code == 0, r.output
    N = 8
    for row in metrics(env):
        assert row["reward/errors/sevens"] == 0
        for name in fns[1:]:
            assert row[f"reward/errors/{name}"] == N, name  # every sample, every step: counted
        assert row["policy/skipped_updates"] == 0  # voided values never reach the update
    text = caplog.text
    assert "'boom'" in text and "raised ZeroDivisionError: division by zero" in text
    assert "'too_short'" in text and "returned 7 rewards for 8 completions" in text
    assert "'strings'" in text and "returned 8 invalid reward(s) of 8, e.g. '1.0'" in text
    assert "'nan_and_inf'" in text and "returned 8 invalid reward(s) of 8, e.g. inf" in text
    assert text.count("raised ZeroDivisionError") == 1  # logged once, then only counted


def test_a_misbehaving_reward_s_log_line_names_its_step(env, caplog):
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        r = train(env, rewards(env[0], "short_from_step_two"), "optim.max_steps=3")
    assert r.exit_code == 0, r.output
    assert caplog.messages == [
        f"step 2: reward function 'short_from_step_two' ({env[0] / 'bad_rewards.py'}:short_from_step_two) "
        "returned 7 rewards for 8 completions; the affected samples get no reward from it (NaN in "
        "per_function). Reported once: later failures are only counted in reward/errors/short_from_step_two"
    ]
    assert [row["reward/errors/short_from_step_two"] for row in metrics(env)] == [0, 8, 8]


def test_reward_raises_with_reward_errors_raise(env):
    user_error(
        train(env, rewards(env[0], "boom"), "reward_errors=raise"),
        "step 1: reward function 'boom'",
        "raised ZeroDivisionError: division by zero",
        "reward_errors=skip",
    )


def test_reward_that_hangs_is_timed_out_and_counted(env, caplog):
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        r = train(env, rewards(env[0], "sevens", "sleepy"), "reward_timeout=0.3", "optim.max_steps=2")
    assert r.exit_code == 0, r.output
    for row in metrics(env):  # step 2: step 1's call still runs, so none is started
        assert (
            row["reward/errors/sleepy"] == 8
            and row["reward/timeouts/sleepy"] == 1
            and row["reward/error_frac"] == 1
        )
        assert row["reward/errors/sevens"] == 0 and row["reward/timeouts/sevens"] == 0
    assert (
        "reward function 'sleepy'" in caplog.text
        and "did not return within 0.3 s: the call was left running" in caplog.text
    )
    assert "(reward_timeout=0.3 s; raise it, give this reward its own `timeout` in rewards:" in caplog.text


def test_reward_that_hangs_with_reward_errors_raise(env):
    user_error(
        train(env, rewards(env[0], "sleepy"), "reward_timeout=0.3", "reward_errors=raise"),
        "step 1: reward function 'sleepy'",
        "did not return within 0.3 s",
        "reward_timeout=0.3 s; raise it",
        "reward_errors=skip counts it",
    )


def test_reward_that_hangs_with_reward_on_timeout_skip_group(env, caplog):
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        r = train(
            env, rewards(env[0], "sevens", "sleepy"), "reward_timeout=0.3", "reward_on_timeout=skip_group"
        )
    assert r.exit_code == 0, r.output
    (row,) = metrics(env)
    assert (
        row["reward/timeouts/sleepy"] == 1
        and row["reward/skipped_frac"] == 1
        and row["advantage/abs_mean"] == 0
    )
    assert "their groups are dropped from the loss (skip_group" in caplog.text


def test_reward_that_hangs_with_reward_on_timeout_raise(env):
    user_error(
        train(env, rewards(env[0], "sleepy"), "reward_timeout=0.3", "reward_on_timeout=raise"),
        "step 1: reward function 'sleepy'",
        "did not return within 0.3 s",
        "reward_timeout=0.3 s; raise it",
        "reward_on_timeout=raise stops the run: skip, skip_group or a score goes on",
    )


def test_reward_on_timeout_not_allowed(env):
    user_error(
        train(env, "reward_on_timeout=drop"),
        "bad value for 'reward_on_timeout': 'drop'",
        "Input should be 'skip', 'skip_group', 'raise' or a finite number",
    )


def test_reward_on_timeout_skip_group_with_gae(env):
    user_error(
        train(env, "reward_on_timeout=skip_group", "algorithm.advantage_estimator=gae"),
        "reward_on_timeout=skip_group drops a prompt's group",
        "not gae); use skip, raise or a number",
    )


def test_slow_reward_call_warns_with_its_time(env, caplog):
    with caplog.at_level(logging.WARNING, logger="grpokit.rewards"):
        r = train(env, rewards(env[0], "sevens", "slowish"), "reward_slow_warning=0.1")
    assert r.exit_code == 0, r.output
    assert re.search(
        r"reward function 'slowish' \(.*\) took \d+\.\d s for 8 completions, more than "
        r"reward_slow_warning=0.1 s \(its timeout is 300 s\)",
        caplog.text,
    ), caplog.text
    assert "'sevens'" not in caplog.text


def test_reward_failing_on_most_of_a_step_warns(env, caplog):
    with caplog.at_level(logging.WARNING, logger="grpokit.records.health"):
        r = train(env, rewards(env[0], "sevens", "boom"), "optim.max_steps=2")
    assert r.exit_code == 0, r.output
    (warning,) = [
        rec.getMessage()
        for rec in caplog.records
        if rec.name == "grpokit.records.health" and "'boom'" in rec.getMessage()
    ]  # once, not at every step
    assert warning.startswith(
        "step 1: reward function 'boom' failed on 100% of the step's completions (more than "
        "reward_error_fraction=0.5)"
    ), warning
    assert "fix the function" in warning and warning.endswith(
        "The run stops after 20 such steps in a row (stop_after_bad_steps)"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpokit.records.health"):
        r = train(
            env, rewards(env[0], "sevens", "boom"), "reward_error_fraction=1", f"output_dir={env[0] / 'run2'}"
        )
    assert r.exit_code == 0 and not [
        rec for rec in caplog.records if rec.name == "grpokit.records.health" and "'boom'" in rec.getMessage()
    ]  # 1 = never


def test_no_learning_signal_warns_then_stops_after_bad_steps_in_a_row(env, caplog):
    """rollout.temperature 1e-4: the G completions of a prompt are the same, so are their rewards: no
    gradient."""
    with caplog.at_level(logging.WARNING, logger="grpokit.records.health"):
        msg = user_error(
            train(
                env,
                "rollout.temperature=1e-4",
                "stop_after_bad_steps=2",
                "optim.max_steps=5",
                "checkpoint.save_every=1",
            ),
            "stopped at step 2 after 2 bad steps in a row (steps 1-2; stop_after_bad_steps=2, 0 = never "
            "stop): no learning signal: in each of the 2 groups all 4 completions got the same reward",
        )
    assert "raise rollout.temperature (now 0.0001) or rollout.num_generations (now 4)" in msg
    assert [rec.getMessage()[:28] for rec in caplog.records if rec.name == "grpokit.records.health"] == [
        "step 1: no learning signal: "
    ]
    assert [row["step"] for row in metrics(env)] == [1, 2]  # the last step is logged ...
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [
        1
    ]  # ... not saved: what is on disk was saved before
    findings = diagnose(read_metrics(env[0] / "run" / "metrics.jsonl"))
    assert [(f.check, f.steps, f.severity) for f in findings] == [
        ("no_signal", (1, 2), "error")
    ]  # not "no problems"


def test_weighted_rewards_overflow_skip_the_update(env):
    r = train(env, rewards(env[0], "huge", weight=10.0), "optim.max_steps=2")
    assert r.exit_code == 0, r.output
    rows = metrics(env)
    assert [row["policy/skipped_updates"] for row in rows] == [1, 1]  # step 1 skipped, step 2 updated
    assert "policy/grad_norm" not in rows[0] and "policy/grad_norm" in rows[1]


def test_non_finite_advantages_skip_the_update(env):
    r = train(env, rewards(env[0], "huge_tie_breaker"), "optim.max_steps=2")
    assert r.exit_code == 0, r.output
    assert [row["policy/skipped_updates"] for row in metrics(env)] == [1, 1]


def test_non_finite_loss_in_a_row_stops_with_one_line(env, monkeypatch):
    import grpokit.algorithm

    real = grpokit.algorithm.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(grpokit.algorithm, "policy_loss", nan_loss)
    msg = user_error(
        train(env, "optim.max_steps=5", "optim.max_consecutive_skips=2", "checkpoint.save_every=1"),
        "the loss was non-finite in 2 optimizer steps in a row (last at step 2, pass 1, minibatch 1)",
        "no checkpoint with these weights was written",
    )
    assert "Lower optim.learning_rate" in msg
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [
        1
    ]  # step 1's weights were untouched, hence finite


# ----------------------------------------------------------------------------- memory

#: what torch's CPU allocator raises when malloc fails
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 21474836480 bytes. Error code 12 (Cannot allocate memory)"
)


def test_out_of_memory_errors_are_told_from_others():
    from grpokit.policy.optim import is_out_of_memory

    assert is_out_of_memory(RuntimeError(CPU_OOM))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))


@pytest.mark.parametrize(
    "key, size, rows, checkpointing, fixes",
    [
        ("optim.micro_batch_size", 8, 8, False, "optim.micro_batch_size=4 (now 8) or model.gradient_che"),
        ("optim.micro_batch_size", 1, 1, False, "set model.gradient_checkpointing=true or a lower"),
        ("optim.micro_batch_size", 1, 1, True, "set a lower rollout.max_completion_length;"),
        # sized in tokens: the budget halves while a micro-batch holds several completions
        ("optim.max_tokens_per_micro_batch", 4096, 8, True, "set optim.max_tokens_per_micro_batch=2048 (now"),
        ("optim.max_tokens_per_micro_batch", 4096, 1, True, "set a lower rollout.max_completion_length;"),
    ],
)
def test_out_of_memory_line_names_only_the_settings_that_are_left(key, size, rows, checkpointing, fixes):
    from grpokit.policy.optim import TrainingError, out_of_memory_said

    with pytest.raises(TrainingError, match=re.escape(fixes)):
        with out_of_memory_said(key, size, checkpointing, rows, 4):
            raise RuntimeError(CPU_OOM)
    with pytest.raises(RuntimeError, match="shapes"):  # other errors pass through as they are
        with out_of_memory_said(key, size, checkpointing, rows, 4):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_in_the_training_pass_stops_with_one_line_and_resumes(env, monkeypatch, where):
    """The allocator failing in step 2's training pass: one line naming the micro-batch and the settings
    that shrink it; step 1's checkpoint is kept, and the command with either setting the line names resumes
    from it (they change only how the same math is laid out in memory)."""
    import grpokit.distributed.sequence_turns as passes
    import grpokit.trainer

    calls, real = [], passes.completion_logprobs
    if where == "forward":

        def forward(model, tokens, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the training pass of step 2
                raise RuntimeError(CPU_OOM)
            return real(model, tokens, **kwargs)

        monkeypatch.setattr(passes, "completion_logprobs", forward)  # the training pass's (policy_logprobs)
    else:
        real_backward = grpokit.trainer.World.backward

        def backward(self, loss):
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real_backward(self, loss)

        monkeypatch.setattr(grpokit.trainer.World, "backward", backward)
    user_error(
        train(env, "optim.max_steps=2", "checkpoint.save_every=1"),
        "the training pass ran out of memory on a micro-batch of 8 completions x",
        "optim.micro_batch_size=4 (now 8) or model.gradient_checkpointing=true",
        "the same command resumes from the newest",
    )
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [1]
    monkeypatch.undo()
    advice = "optim.micro_batch_size=4" if where == "forward" else "model.gradient_checkpointing=true"
    r = train(env, "optim.max_steps=2", "checkpoint.save_every=1", advice)
    assert r.exit_code == 0, r.output
    assert "allow_changes" not in r.output
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [1, 2]


# ----------------------------------------------------------------------------- disk


def test_disk_full_during_a_save(env, monkeypatch):
    """ENOSPC inside a save: one line, the previous checkpoint intact, the rerun resumes from it."""
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    user_error(
        train(env, "optim.max_steps=3", "checkpoint.save_every=1"),
        "could not save to",
        "step-000002",
        "No space left on device",
        "earlier checkpoints are untouched",
    )
    ckpts = env[0] / "run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [1]
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".")]  # the half-written save is gone
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpts / "step-000001")
    monkeypatch.setattr(torch, "save", real_save)
    r = train(env, "optim.max_steps=3", "checkpoint.save_every=1")
    assert r.exit_code == 0 and "resuming from checkpoint step 1" in r.stdout, r.output
    assert [row["step"] for row in metrics(env)] == [1, 2, 3]


def test_a_second_ctrl_c_says_where_to_resume(env, monkeypatch):
    """Two Ctrl-C 0.1 s apart: the run stops at once (no save of the step under way) with the line a single
    Ctrl-C prints: the newest checkpoint and how to resume."""
    import os
    import signal
    import time

    from grpokit.trainer import Trainer

    real = Trainer.update

    def update_then_two_ctrl_c(self, batch):
        stats = real(self, batch)
        if self.step == 1:  # during step 2
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)
        return stats

    monkeypatch.setattr(Trainer, "update", update_then_two_ctrl_c)
    r = train(env, "optim.max_steps=3", "checkpoint.save_every=1")
    step_1 = env[0] / "run" / "checkpoints" / "step-000001"
    assert r.exit_code == 130, r.output
    assert f"SIGINT: saved step 1 to {step_1}; run the same command to resume" in r.output, r.output
    assert [s for s, _ in list_checkpoints(env[0] / "run")] == [1]


def _whole_lines(path: Path) -> list[int]:
    """The steps of a metrics.jsonl whose every line is whole (parses, ends with a newline)."""
    text = path.read_text() if path.exists() else ""
    assert not text or text.endswith("\n"), text[-200:]
    return [json.loads(line)["step"] for line in text.splitlines()]


def test_disk_full_while_writing_the_logs(env, monkeypatch):
    """The disk fills in the middle of a metrics line (the kernel writes what fits, then ENOSPC): one line,
    exit 2, a metrics.jsonl of whole lines, and the same command resumes from the newest checkpoint."""
    import os

    real_write, metrics_writes = os.write, []

    def full_disk(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            return real_write(fd, data)
        metrics_writes.append(len(data))
        if len(metrics_writes) == 2:  # step 2's line: half of it fits
            return real_write(fd, bytes(data[: len(data) // 2]))
        if len(metrics_writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    run = env[0] / "run"
    user_error(
        train(env, "optim.max_steps=3", "checkpoint.save_every=1"),
        f"could not write to '{run}': No space left on device",
        "every line of metrics.jsonl is whole",
        "the same command resumes from the newest",
    )
    assert _whole_lines(run / "metrics.jsonl") == [1]  # step 2's half line is gone
    assert [s for s, _ in list_checkpoints(run)] == [1]
    monkeypatch.setattr(os, "write", real_write)
    r = train(env, "optim.max_steps=3", "checkpoint.save_every=1")
    assert r.exit_code == 0 and "resuming from checkpoint step 1" in r.stdout, r.output
    assert _whole_lines(run / "metrics.jsonl") == [1, 2, 3]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_disk_full_while_writing_the_logs_on_a_small_tmpfs(env):
    """The same on a real full disk: output_dir on a 12 KiB tmpfs (needs root and mount; skipped without).
    TensorBoard's writer thread, which meets the full disk too, prints no traceback of its own (pytest would
    turn one into a warning, an error here)."""
    small = env[0] / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(small)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 12 KiB tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        run = small / "run"
        user_error(  # with TensorBoard, whose writer thread hits the full disk too: still one line
            train(env, "optim.max_steps=40", f"output_dir={run}", "logging.tensorboard=true"),
            f"could not write to '{run}': No space left on device",
        )
        assert _whole_lines(run / "metrics.jsonl")  # some steps were logged before the disk filled
    finally:
        subprocess.run(["umount", str(small)], check=True)


# ---------------------------------------------------------------- reading a run: grpokit show, grpokit report


def test_show_or_report_a_run_that_does_not_exist(tmp_path):
    for command in ("show", "report"):
        user_error(
            CliRunner().invoke(app, [command, str(tmp_path / "nope")]),
            "no run at",
            "nope: no such folder",
            "give a run's output_dir (the folder with metrics.jsonl)",
        )


def test_show_a_step_that_was_not_recorded(tmp_path):
    from grpokit.records.table import append_step

    for step in (2, 4):
        append_step(tmp_path, step, [{"prompt": "p", "completion": "c", "reward": 0.0}])
    user_error(
        CliRunner().invoke(app, ["show", str(tmp_path), "--step", "3"]),
        "step 3 has no recorded completions; recorded steps: 2, 4 (pick one with --step)",
    )


def test_show_a_run_that_recorded_no_completions(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    user_error(
        CliRunner().invoke(app, ["show", str(tmp_path)]),
        "has no completions.parquet: the run recorded no completions",
        "logging.sample_every=N",
        "logging.num_samples=K",
    )


def test_report_a_folder_without_metrics(tmp_path):
    user_error(
        CliRunner().invoke(app, ["report", str(tmp_path)]),
        "has no metrics.jsonl",
        "grpokit train writes metrics.jsonl there",
    )
    (tmp_path / "metrics.jsonl").write_text('{"time": 1.0}\n')
    user_error(
        CliRunner().invoke(app, ["report", str(tmp_path)]),
        "has no metric lines",
        "train at least one step first",
    )
    assert not (tmp_path / "report.html").exists()


# --------------------------------------------------------------------------- the console script and the table


def test_console_script_one_line(env):
    """The real `grpokit train` process, on a row that goes through model loading and Trainer setup."""
    tmp_path, base = env
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit.cli",
            "train",
            str(tmp_path / "config.yaml"),
            *base,
            rewards(tmp_path, "needs_answer"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: reward 'needs_answer'"), r.stderr


def test_the_only_rollout_server_gone_is_one_line_with_one_fix():
    """The server stops mid-run (here a socket that reads the request and closes): the run's line lists it
    with what went wrong and gives the fix once."""
    from grpokit.rollout.server import ServerClient, ServerError, VLLMServerEngine

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        def hang_up():
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.close()

        import threading

        threading.Thread(target=hang_up, daemon=True).start()
        client = ServerClient(url, timeout=30)
        with pytest.raises(ServerError) as dropped:
            client.request("/generate", {})
    engine = VLLMServerEngine.__new__(VLLMServerEngine)  # the fleet's bookkeeping, without a vLLM server
    engine.servers, engine.gone, engine.group = [client], [], None
    with pytest.raises(ServerError) as gone:
        engine._drop(client, dropped.value, "its prompts go to the others")
    line = str(gone.value)
    assert line == (
        f"no rollout server is left (rollout.vllm_server_url): {url} (the rollout server at {url} dropped "
        "the connection during POST /generate (RemoteDisconnected('Remote end closed connection without "
        "response'))); start them again with `grpokit serve` and resume the run"
    )
    assert line.count("again") == 1 and line.count("resume") == 1


def _sigint_once_importing(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Start cmd and send it SIGINT as soon as it loads torch's own libraries (the import of torch, which
    takes a second or more, has begun): a new user's Ctrl-C in the first seconds of a command. On a loaded
    machine the signal may still land after the start-up (the run then takes it as a stop request and, at
    one step, ends normally): such a miss is started again, up to three times."""
    for _ in range(3):
        p = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # as a shell starts a command: Ctrl-C's default action, whatever this process inherited (a
            # suite's worker may ignore SIGINT, and an ignored SIGINT is inherited across exec)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        maps = Path(f"/proc/{p.pid}/maps")
        while p.poll() is None and not any(
            "site-packages/torch/lib/" in line for line in maps.read_text().splitlines()
        ):
            time.sleep(0.005)
        assert p.poll() is None, p.communicate()  # still importing when the signal goes
        p.send_signal(signal.SIGINT)
        out, err = p.communicate()
        if not (p.returncode == 0 and "done: step" in out):  # not a signal that came after the start-up
            break
        shutil.rmtree(cwd / "run", ignore_errors=True)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_ctrl_c_while_starting_is_one_line(env):
    """A real `python -m grpokit train` process interrupted while it imports: one line, exit status 130."""
    tmp_path, base = env
    r = _sigint_once_importing(
        [sys.executable, "-m", "grpokit", "train", str(tmp_path / "config.yaml"), *base], tmp_path
    )
    assert r.returncode == 130, (r.stdout, r.stderr)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert lines == [
        "SIGINT (Ctrl-C): stopped while grpokit was starting up; nothing was saved: run the same command to "
        "start again"
    ], lines
    assert not (tmp_path / "run").exists()


def test_every_row_has_a_test():
    table = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / "errors.md").read_text()))
    tests = {  # a row may name a test of any file (the row says which when it is not this one)
        name
        for f in sorted((ROOT / "tests").glob("test_*.py"))
        for name in re.findall(r"^def (test_\w+)", f.read_text(), re.M)
    }
    assert len(table) >= 40 and table <= tests, sorted(table - tests)  # every row names a test that exists
    here = {name for name in globals() if name.startswith("test_")}
    untabled = here - table - {"test_every_row_has_a_test", "test_console_script_one_line"}
    assert not untabled, sorted(untabled)  # every bad input tested here is in the table


# ----------------------------------------------------------------------------- tools (docs/agentic.md)


def test_tool_function_not_found(env):
    user_error(
        train(env, "tools.functions=[no_such_module:f]"),
        "tools.functions='no_such_module:f': loading 'no_such_module' failed",
    )


def test_tool_without_type_hints(env):
    (env[0] / "my_tools.py").write_text('def lookup(key):\n    """Look a key up."""\n    return key\n')
    user_error(
        train(env, f"tools.functions=[{env[0] / 'my_tools.py'}:lookup]"),
        "tools: tool 'lookup': parameter 'key' has no type hint; tools need one per parameter",
    )


def test_tool_environment_without_reset(env):
    (env[0] / "my_env.py").write_text(
        'class Env:\n    def act(self, x: int) -> int:\n        """Act."""\n        return x\n'
    )
    user_error(
        train(env, f"tools.environment={env[0] / 'my_env.py'}:Env"),
        "tools.environment: environment Env: needs a reset(**row) method",
    )


def test_tool_reward_without_tools(env):
    user_error(
        train(env, "rewards=[{function: tool_call_valid}]"),
        "reward 'tool_call_valid' (tool_call_valid) needs argument 'episodes', which only multi-turn "
        "rollouts with tools pass: add a tools section",
    )


def test_unknown_builtin_tool(env):
    user_error(
        train(env, "tools.builtin=[calc]"),
        "bad value for 'tools.builtin.0': 'calc': Input should be 'calculator' or 'python'",
    )


# -------------------------------------------------------- LoRA, reward models (docs/lora.md, docs/rewards.md)


@pytest.mark.parametrize(
    "key", ["algorithm.ref_policy=reset", "algorithm.advantage_estimator=gae", "model.compile=true"]
)
def test_lora_with_a_setting_it_does_not_support(env, key):
    extra = ["algorithm.ref_reset_every=2"] if "reset" in key else []
    user_error(
        train(env, "model.lora.r=4", key, *extra),
        f"model.lora does not work with {key} yet; drop model.lora or change that key",
    )


def test_lora_in_an_sft_config(env):
    result = CliRunner().invoke(app, ["sft", str(env[0] / "config.yaml"), "model.lora.r=4"])
    user_error(result, "model.lora is for `grpokit train`; `grpokit sft` trains every weight")


def test_lora_without_peft(env, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails as if it were not installed
    user_error(train(env, "model.lora.r=4"), "model.lora needs the peft package: pip install 'grpokit[lora]'")


def test_lora_target_modules_that_match_nothing(env):
    require("peft")
    user_error(
        train(env, "model.lora.target_modules=[qkv_proj]"),
        "model.lora.target_modules=['qkv_proj']: Target modules",
    )


def test_lora_resume_without_the_adapter(env):
    require("peft")
    assert train(env, "model.lora.r=4").exit_code == 0
    (env[0] / "run" / "checkpoints" / "step-000001" / "adapter_model.safetensors").unlink()
    user_error(
        train(env, "model.lora.r=4", "optim.max_steps=2", "checkpoint.allow_changes=[optim.max_steps]"),
        "step-000001' has no adapter_model.safetensors, but model.lora is set",
    )


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            "{weight: 1.0}",
            "a reward needs exactly one of `function` (a reward function) and `model` (a reward model); this "
            "one has neither",
        ),
        ("{function: math, model: x}", "this one has both"),
    ],
)
def test_reward_with_neither_or_both_function_and_model(env, spec, words):
    user_error(train(env, f"rewards=[{spec}]"), "bad value for 'rewards.0'", words)


def test_reward_model_that_cannot_be_loaded(env):
    user_error(
        train(env, f"rewards=[{{model: '{env[0]}'}}]"),
        f"rewards[0].model='{env[0]}': could not load a sequence-classification reward model",
    )


def test_reward_model_with_several_labels(env):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(env[1][0].split("=", 1)[1])
    rm = env[0] / "rm2"
    LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=2,
        )
    ).save_pretrained(rm)
    tok.save_pretrained(rm)
    user_error(
        train(env, f"rewards=[{{model: '{rm}'}}]"),
        "rewards[0].model=",
        "has num_labels=2; a reward model gives one score per text",
    )
    user_error(
        train(env, f"rewards=[{{model: '{rm}', kwargs: {{batch: 4}}}}]"),
        "rewards[0].kwargs: ['batch'] are not settings of a reward model; allowed: batch_size, max_length, "
        "device",
    )
