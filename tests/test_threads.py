"""Threads: the count every command uses (threads=N / --threads N; 0 = auto), and the helpers a user brings
their own vocabulary with (grpokit.tasks.tokenizer / tiny_model parameters)."""

import pytest
import torch

from grpokit.config import threads
from grpokit.config.threads import choose_threads, use_threads
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer
from tests.helpers import read_metrics, tiny_config


@pytest.mark.parametrize(
    "requested,env,cores,busy,expected",
    [
        (3, {"OMP_NUM_THREADS": "4"}, 2, 0.0, 3),  # the setting wins
        (0, {"OMP_NUM_THREADS": "4"}, 2, 0.0, 4),  # then OMP_NUM_THREADS
        (0, {"OMP_NUM_THREADS": "x"}, 2, 0.0, 2),  # a value that is not a count is ignored
        (0, {}, 2, 0.1, 2),  # an idle machine: every core
        (0, {}, 2, 1.0, 1),  # one other busy process on 2 cores: 1 thread
        (0, {}, 2, 0.6, 1),  # most of a core busy: that core is left to it
        (0, {}, 2, 0.4, 2),
        (0, {}, 2, 7.5, 1),  # never below 1
        (0, {}, 16, 3.2, 13),
        (0, {}, 4, -1.0, 4),  # not measurable (no /proc/stat): every core
    ],
)
def test_choose_threads(requested, env, cores, busy, expected):
    n, why = choose_threads(requested, environ=env, cores=cores, busy=busy)
    assert n == expected and why


def test_auto_counts_the_cores_busy_now_not_the_load_average(monkeypatch):
    """A run that has just ended still shows in the 1-minute load average (1.9 on 2 cores) while the cores are
    idle: auto takes every core. One core busy now, whatever the load average says: one fewer."""
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.9, 1.5, 1.0), raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.02)
    assert choose_threads(0, environ={}, cores=2) == (2, "auto: 2 cores, 0.02 busy with other processes")
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.97)
    assert choose_threads(0, environ={}, cores=2)[0] == 1
    assert choose_threads(0, environ={}, cores=4)[0] == 3
    monkeypatch.setattr(threads, "busy_cores", lambda: None)  # /proc/stat missing
    assert choose_threads(0, environ={}, cores=2)[0] == 2


def test_busy_cores_sees_a_process_spinning_on_a_core():
    """The real measurement: a child process spinning on one core counts as (about) one busy core, however
    little of the last minute it has run. Other jobs on the machine can only add to it; so the check is a
    lower bound."""
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/stat").is_file():
        pytest.skip("busy_cores reads /proc/stat (Linux)")
    spin = subprocess.Popen(
        [sys.executable, "-c", "import sys; print(1, flush=True)\nwhile True: pass"], stdout=subprocess.PIPE
    )
    try:
        assert spin.stdout is not None and spin.stdout.readline().strip() == b"1"  # it is spinning now
        busy = threads.busy_cores()
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and 0.8 <= busy <= threads.available_cores() + 0.05


def test_busy_cores_leaves_out_this_process(monkeypatch):
    """Two jiffy counts that say every core was busy throughout, all of it this process's own CPU time (a
    thread spinning here): nothing left for the other processes."""
    samples = iter([(0, 0), (50, 50)])  # 50 of 50 jiffies busy: 2 cores x 0.25 s at 100 Hz
    monkeypatch.setattr(threads, "_cpu_jiffies", lambda cpus: next(samples))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    clock = iter([10.0, 10.5])  # the process used 0.5 s of CPU in the 0.25 s window: both cores
    monkeypatch.setattr(threads.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert threads.busy_cores(0.25) == 0.0


def test_use_threads_sets_torch_and_says_so():
    before = torch.get_num_threads()
    try:
        line = use_threads(1)
        assert torch.get_num_threads() == 1 and line.startswith("threads: 1 (threads setting")
    finally:
        torch.set_num_threads(before)


def test_trainer_takes_the_threads_setting_and_logs_it(tiny_model_dir, tmp_path):
    from grpokit.trainer import Trainer

    before = torch.get_num_threads()
    try:
        cfg = tiny_config(
            tiny_model_dir,
            tmp_path,
            "data.task_train_size=50",
            "rewards=[]",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=4",
            "optim.learning_rate=1e-6",  # the default (TINY_RUN's is 3e-3)
            "logging.sample_every=10",  # the default (TINY_RUN's is 0)
            "optim.max_steps=1",
            "threads=1",
            "checkpoint.save_every=0",
            "logging.tensorboard=false",
        )
        Trainer(cfg).train()
        assert torch.get_num_threads() == 1
        rows = read_metrics(tmp_path)
        assert rows[-1]["perf/threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_tokenizer_takes_special_tokens_order_and_bos():
    tok = build_tokenizer(
        "cab+=", special_tokens={"pad_token": "[PAD]", "eos_token": "[EOS]"}, sort=False, add_bos=False
    )
    assert [tok.convert_ids_to_tokens(i) for i in range(len(tok))] == [
        "[PAD]",
        "[EOS]",
        "c",
        "a",
        "b",
        "+",
        "=",
    ]
    assert tok("ab=")["input_ids"] == [3, 4, 6]  # no BOS in front
    assert tok.bos_token_id is None and tok.unk_token_id is None and tok.eos_token_id == 1
    default = build_tokenizer("ba")
    assert [default.convert_ids_to_tokens(i) for i in range(len(default))] == [
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
        "a",
        "b",
    ]
    with pytest.raises(ValueError, match="eos_token"):
        build_tokenizer("ab", special_tokens={"pad_token": "[PAD]"}, add_bos=False)
    with pytest.raises(ValueError, match="bos_token"):
        build_tokenizer("ab", special_tokens={"eos_token": "[EOS]"})
    with pytest.raises(ValueError, match="distinct"):
        build_tokenizer("ab", special_tokens={"eos_token": "a"}, add_bos=False)


def test_tiny_llama_takes_any_config_field():
    tok = build_tokenizer("ab")
    model = build_tiny_llama(
        tok,
        size="test",
        max_position_embeddings=64,
        tie_word_embeddings=False,
        config={"rms_norm_eps": 1e-6, "num_key_value_heads": 2},
    )
    c = model.config
    assert (c.max_position_embeddings, c.tie_word_embeddings, c.rms_norm_eps, c.num_key_value_heads) == (
        64,
        False,
        1e-6,
        2,
    )
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


# ---------------------------------------------------------------- bit-identical runs at one thread count
def _grouped_batch(prompts=8, G=8, prompt_len=12, completion_len=8):
    """prompts x G rows, each prompt's G completions after it: what a GRPO step's log-prob passes see."""
    from grpokit.data.batch import pack_sequences

    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 24, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    comps = [torch.randint(3, 24, (completion_len,), generator=g).tolist() for _ in range(prompts * G)]
    return pack_sequences([p for p in ps for _ in range(G)], comps, pad_id=0)


@pytest.mark.parametrize("threads", [3, 5])
def test_shared_prompt_pass_gives_the_same_gradients_every_time(threads):
    """The shared-prompt pass copies each prompt's KV cache to its G rows. As x[index], its backward is
    index_put_(accumulate=True), which torch on CPU runs with atomic float adds from several threads once
    the gradient has 32768 elements: at 3 and 5 threads the G rows were summed in a different order from one
    call to the next, and two runs of one config parted from step 2 on. index_select's backward does not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpokit.policy import completion_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=24,
            hidden_size=96,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
    )
    batch = _grouped_batch()  # the cache's gradient per layer: 64 x 4 x 12 x 24 = 73728 elements
    weights = torch.linspace(-1, 1, batch.completion_ids.shape[0])[:, None] * batch.completion_mask

    def grads():
        model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(model, batch)
        (logp * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        first = grads()
        for _ in range(8):
            again = grads()
            assert [n for n in first if not torch.equal(first[n], again[n])] == []
    finally:
        torch.set_num_threads(before)


def _train(model_dir, out, *extra, env_threads=None):
    """`grpokit train` on the README example in its own process, default threads (threads=0: auto), with
    OMP_NUM_THREADS=env_threads in its environment (or none). Returns (stdout, the final weights)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = str(env_threads)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit.cli",
            "train",
            "examples/config.yaml",
            f"model.name_or_path={model_dir}",
            f"output_dir={out}",
            "optim.max_steps=4",
            "eval.at_start=false",
            "eval.every=0",
            "checkpoint.save_every=0",
            "logging.tensorboard=false",
            *extra,
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, load_file(Path(out) / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def example_model(tmp_path_factory):
    """The README's tiny model (examples/make_tiny_model.py): the character tokenizer of every task."""
    from grpokit.tasks import DEFAULT_CHARSET

    path = tmp_path_factory.mktemp("example_model")
    tok = build_tokenizer(DEFAULT_CHARSET, path)
    build_tiny_llama(tok, size="test").save_pretrained(path)
    return path


@pytest.mark.slow
def test_two_runs_at_the_same_thread_count_end_bit_identical(example_model, tmp_path):
    """docs/threads.md, 'Reproducing a run exactly': two uninterrupted `grpokit train` processes with the same
    config and seed, default threads, at the same count (here 3, from OMP_NUM_THREADS as auto reads it: a
    count at which the shared-prompt pass used to race) end with torch.equal weights."""
    out_a, a = _train(example_model, tmp_path / "a", env_threads=3)
    out_b, b = _train(example_model, tmp_path / "b", env_threads=3)
    assert "threads: 3 (OMP_NUM_THREADS" in out_a and "threads: 3 (OMP_NUM_THREADS" in out_b
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_auto_takes_the_count_of_the_run_being_resumed():
    assert choose_threads(0, environ={}, cores=2, busy=0.1, resumed=3) == (
        3,
        "auto: the count of the run being resumed",
    )
    assert (
        choose_threads(0, environ={"OMP_NUM_THREADS": "1"}, cores=2, busy=0.1, resumed=3)[0] == 1
    )  # the environment wins
    assert choose_threads(2, environ={}, cores=2, busy=0.1, resumed=3)[0] == 2  # and the setting
    assert (
        choose_threads(0, environ={}, cores=2, busy=0.1, resumed=0)[0] == 2
    )  # no run to resume: the free cores


@pytest.mark.slow
def test_a_resume_under_auto_runs_at_the_count_the_run_started_with(example_model, tmp_path):
    """config.yaml records the count a run used; `grpokit train` resumed with threads=0 (auto) takes it from
    there whatever OMP_NUM_THREADS and the load say now, so the resumed run ends bit for bit where an
    uninterrupted run does. 3 threads at the start: auto alone picks 3 only with 3 free cores."""
    import shutil

    import yaml

    out = tmp_path / "run"
    _, uninterrupted = _train(example_model, out, "checkpoint.save_every=2", env_threads=3)
    assert yaml.safe_load((out / "config.yaml").read_text())["threads"] == 3
    shutil.rmtree(out / "checkpoints" / "step-000004")  # as if killed after the save of step 2
    stdout, resumed = _train(example_model, out, "checkpoint.save_every=2")  # no OMP_NUM_THREADS now: auto
    assert "resuming from checkpoint step 2" in stdout
    assert "threads: 3 (auto: the count of the run being resumed" in stdout
    assert [k for k in uninterrupted if not torch.equal(uninterrupted[k], resumed[k])] == []
