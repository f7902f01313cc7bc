"""rollout.vllm_mode=server, for real: `grpokit serve` started as a subprocess on the tiny Llama of
test_rollout_vllm.py (head size 64), once for the module, and VLLMServerEngine talking to it over HTTP.

The must-show (issue 13), server mode: after a weight push (through /dev/shm) the server's per-token sampling
log-probs equal the trainer's recomputed ones (fp32, max |diff| < 1e-3), and before the push they differ.
"""

import ctypes
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from grpokit.cli import app
from grpokit.rollout import SamplingParams
from grpokit.rollout.server import VLLMServerEngine
from grpokit.rollout.vllm import RolloutError, VLLMEngine
from grpokit.tasks.tiny_model import build_tiny_llama
from tests.helpers import read_metrics, require, tiny_config
from tests.test_rollout_vllm import (
    assert_learned_and_every_push_took,
    grpo_config,
    load,
    logprobs_differ_before_a_push_and_match_after,
    prompts,
)

START_TIMEOUT_S = 300  # vLLM's start on a busy 2-core machine: 20-50 s


def _die_with_parent():
    ctypes.CDLL(None).prctl(
        1, signal.SIGTERM
    )  # PR_SET_PDEATHSIG: the server goes when pytest goes, however it ends


def start_server(model_dir, log: Path) -> tuple[subprocess.Popen, str]:
    """A `grpokit serve` subprocess on model_dir, listening on a free loopback port, its output in `log`:
    (the process, its URL) once it listens (vLLM then still loads: the client waits for it)."""
    argv = [sys.executable, "-m", "grpokit", "serve", str(model_dir), "--port", "0", "--threads", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv + ["--max-num-seqs", "64"], stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    deadline, url = time.monotonic() + 60, None
    while url is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"grpokit serve did not listen within 60 s:\n{log.read_text()[-3000:]}")
        found = re.search(r"listening on (http://\S+)", log.read_text())
        url = found and found.group(1)
        time.sleep(0.2)
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    """(url, log path) of a `grpokit serve` subprocess on vllm_model_dir (start_server); terminated at the
    end."""
    require("vllm")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, url = start_server(vllm_model_dir, log)
    try:
        yield url, log
    finally:
        stop_server(proc)


def connect(server, model, tok):
    return VLLMServerEngine(model, tok, url=server[0], timeout=START_TIMEOUT_S)


@pytest.mark.slow
def test_sampling_logprobs_match_the_trainer_after_a_push_and_differ_before(server, vllm_model_dir):
    model, tok = load(vllm_model_dir)
    engine = connect(
        server, model, tok
    )  # waits for the server's "ready", checks its model, pushes the trainer's weights
    stale, comps = logprobs_differ_before_a_push_and_match_after(
        engine, model, tok
    )  # through /dev/shm and HTTP
    assert stale.versions == [0] * len(stale) and comps.versions == [1] * len(
        comps
    )  # the version that sampled each
    assert comps.texts == tok.batch_decode(comps.token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_each_sample_carries_the_version_of_the_push_before_it(server, vllm_model_dir):
    model, tok = load(vllm_model_dir)
    engine = connect(server, model, tok)  # the trainer's first push is version 0
    p, sampling = prompts(tok), SamplingParams(max_tokens=4)
    assert engine.generate(p, 2, sampling).versions == [0] * 4
    engine.sync_weights(model)  # no version named: one more than the last
    assert engine.version == 1 and engine.generate(p, 2, sampling).versions == [1] * 4
    engine.sync_weights(model, version=7)  # the trainer names its step
    assert engine.generate(p, 3, sampling).versions == [7] * 6
    engine.sync_weights(model)
    assert engine.generate(p, 1, sampling).versions == [8, 8]


@pytest.mark.slow
def test_the_runs_generator_decides_the_samples_as_in_the_colocated_engine(server, vllm_model_dir):
    model, tok = load(vllm_model_dir)
    engine = connect(server, model, tok)
    p, sampling = prompts(tok), SamplingParams(max_tokens=12)
    torch.manual_seed(7)
    a = engine.generate(p, 4, sampling)
    torch.manual_seed(7)
    b = engine.generate(p, 4, sampling).token_ids
    torch.manual_seed(8)
    c = engine.generate(p, 4, sampling).token_ids
    assert a.token_ids == b and a.token_ids != c
    assert (
        len({tuple(x) for x in a.token_ids[:4]}) > 1
    )  # the n samples of a prompt are not copies of each other

    def own():
        return SamplingParams(max_tokens=12, generator=torch.Generator().manual_seed(7))

    state = torch.random.get_rng_state()
    assert engine.generate(p, 4, own()).token_ids == engine.generate(p, 4, own()).token_ids
    assert torch.equal(
        torch.random.get_rng_state(), state
    )  # a generator of its own leaves the run's stream alone
    colocated = VLLMEngine(model, tok, max_model_len=256, max_seqs=32)  # the same weights in this process
    try:
        torch.manual_seed(7)
        here = colocated.generate(p, 4, sampling)
    finally:
        colocated.close()
    assert here.token_ids == a.token_ids and here.finish_reasons == a.finish_reasons
    assert (
        max(
            abs(x - y)
            for u, v in zip(here.logprobs, a.logprobs, strict=True)
            for x, y in zip(u, v, strict=True)
        )
        < 1e-5
    )


@pytest.mark.slow
def test_greedy_and_stop_sequences_mean_what_they_mean_in_the_colocated_engine(server, vllm_model_dir):
    from grpokit.rollout.fast import FastEngine

    model, tok = load(vllm_model_dir)
    engine = connect(server, model, tok)
    p, greedy = prompts(tok), SamplingParams(max_tokens=12, greedy=True)
    fast = FastEngine(model, tok).generate(p, 2, greedy)
    ours = engine.generate(p, 2, greedy)
    assert ours.token_ids == fast.token_ids and ours.finish_reasons == fast.finish_reasons
    row = max(fast.token_ids, key=len)
    stop = SamplingParams(max_tokens=12, greedy=True, stop_token_ids=((row[2], row[3]),))
    assert engine.generate(p, 1, stop).token_ids == FastEngine(model, tok).generate(p, 1, stop).token_ids


@pytest.mark.slow
def test_a_push_that_did_not_take_is_caught(server, vllm_model_dir):
    model, tok = load(vllm_model_dir)
    engine = connect(server, model, tok)
    other = build_tiny_llama(tok, size="test", seed=1, config={"head_dim": 64})
    # Only some tensors of another model reach the server: it now runs neither model.
    engine.push([(k, v) for k, v in other.state_dict().items() if ".layers.1." in k])
    with pytest.raises(RolloutError, match=r"vLLM server \(http://.*\) weight push 2 did not take"):
        engine.verify_push(model)
    engine.sync_weights(model)  # a full push repairs it
    assert engine.last_push_error < 1e-3


@pytest.mark.slow
def test_a_server_on_another_model_is_a_clear_error(server, tiny_model_dir, tmp_path):
    """`grpokit train` on the tests' tiny model (4 heads of 24) against the server's (4 heads of 64): one
    line, before any push."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # as grpokit.cli.main does; the test runner skips main()
    (tmp_path / "config.yaml").write_text("{}\n")
    result = CliRunner().invoke(
        app,
        [
            "train",
            str(tmp_path / "config.yaml"),
            f"model.name_or_path={tiny_model_dir}",
            "data.task=countdown",
            "data.task_train_size=50",
            "threads=1",
            "rollout.max_completion_length=8",
            "rollout.engine=vllm",
            "rollout.vllm_mode=server",
            f"rollout.vllm_server_url={server[0]}",
            f"output_dir={tmp_path / 'run'}",
            f"rewards=[{{function: '{__file__.rsplit('/', 1)[0]}/reward_fns.py:count_sevens'}}]",
        ],
    )
    assert result.exit_code == 2, (result.output, result.exception)
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.output, result.output
    assert line.startswith(f"error: the rollout server at {server[0]} serves another model"), line
    assert re.search(
        r"tensor model\.layers\.0\.self_attn\.q_proj\.weight is \[256, 96\] there, \[96, 96\] here \(and \d+ "
        r"more\)",
        line,
    ), line
    assert f"`grpokit serve {tiny_model_dir}`" in line, line


@pytest.mark.slow
def test_grpo_on_a_vllm_server_learns_and_every_push_takes(server, vllm_model_dir, tmp_path):
    """The loop with rollout.vllm_mode=server, as test_grpo_on_vllm_learns_and_every_push_takes runs it
    colocated: the reward rises, and the mismatch stays at float noise at every step (each step's samples came
    from the weights pushed after the step before)."""
    from grpokit.trainer import Trainer

    cfg = grpo_config(
        vllm_model_dir,
        tmp_path / "run",
        "optim.max_steps=30",
        "rollout.engine=vllm",
        "rollout.vllm_mode=server",
        f"rollout.vllm_server_url={server[0]}",
        f"rollout.vllm_server_timeout={START_TIMEOUT_S}",
        "rollout.importance_correction=token_truncate",
    )
    Trainer(cfg).train()
    assert_learned_and_every_push_took(tmp_path / "run", 30)


@pytest.mark.slow
def test_grpo_with_lora_on_a_vllm_server_every_push_takes(server, vllm_model_dir, tmp_path):
    """model.lora with rollout.vllm_mode=server: each push sends the adapted layers with the adapters merged
    in (after the first, only those layers and their fused siblings), the server's check holds at every step,
    every sample came from the current adapted policy, and only the adapter trained. The same run with the
    colocated engine samples, scores and trains alike: the same completions, metrics and adapter."""
    from grpokit.trainer import Trainer
    from tests.test_vllm_lora import LORA_VLLM_RUN
    from tests.test_vllm_server_torchrun import _assert_same_run

    require("peft")
    common = [*LORA_VLLM_RUN, "logging.sample_every=1"]  # completions.parquet, compared below
    server_mode = [
        "rollout.vllm_mode=server",
        f"rollout.vllm_server_url={server[0]}",
        f"rollout.vllm_server_timeout={START_TIMEOUT_S}",
    ]
    Trainer(tiny_config(vllm_model_dir, tmp_path / "run", *common, *server_mode)).train()
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["rollout/push_checks"] == 1 and r["rollout/push_error"] < 1e-3, r
        assert r["rollout/version_lag"] == 0 and r["rollout/logp_diff_max"] < 1e-3, r
    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    Trainer(tiny_config(vllm_model_dir, tmp_path / "colocated", *common)).train()
    _assert_same_run(tmp_path / "run", tmp_path / "colocated")


def test_a_run_resumes_against_a_server_at_another_url():
    """A server restarted after a crash may listen elsewhere (--port 0): its URL and the timeout are plumbing,
    not the run's settings, so a resume does not refuse them (the model check and the first push guard the
    rest)."""
    from grpokit.checkpoint import config_changes
    from grpokit.config import load_config

    server = ["rollout.engine=vllm", "rollout.vllm_mode=server"]
    saved = load_config(None, [*server, "rollout.vllm_server_url=http://127.0.0.1:8000"]).model_dump()
    now = load_config(
        None, [*server, "rollout.vllm_server_url=http://10.0.0.2:9000", "rollout.vllm_server_timeout=30"]
    ).model_dump()
    assert config_changes(saved, now, []) == ([], [])
    colocated = load_config(None, ["rollout.engine=vllm"]).model_dump()
    assert config_changes(colocated, now, [])[0] == ["rollout.vllm_mode: 'colocate' -> 'server'"]
