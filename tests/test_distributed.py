"""Two processes on torch.distributed (gloo, CPU) train as one process does (grpokit/distributed.py,
docs/scaling.md).

Real process groups launched by torchrun (`python -m torch.distributed.run --standalone`), real FSDP2 and DDP;
no mocks of torch.distributed. One torchrun launch runs every case for both strategies (tests/dist_cases.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.data.batch import RolloutBatch, pack_sequences
from grpokit.distributed import World, cat_batches
from tests.helpers import read_metrics, require

sys.path.insert(0, str(Path(__file__).parent))
import dist_cases  # tests/ is not a package; torchrun runs the same file as a script

TESTS = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env() -> dict[str, str]:
    # One thread per rank on a busy 2-core machine; no distributed variables of an outer launcher leak in.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(TESTS.parent),
        "TORCH_SHOW_CPP_STACKTRACES": "1",
        # a rank that aborts prints every thread's Python stack
        "PYTHONFAULTHANDLER": "1",
    }


def _output(proc: subprocess.CompletedProcess) -> str:
    """The launcher's and the ranks' output without transformers' progress bars, for a failure message."""

    def keep(text):
        return "\n".join(
            ln for ln in text.splitlines() if "Loading weights" not in ln and "model shards" not in ln
        )

    return keep(proc.stdout)[-3000:] + "\n" + keep(proc.stderr)[-8000:]


def _rel(got: dict, want: dict) -> dict[str, float]:
    """Per tensor: |got - want| / |want| (norms)."""
    return {k: ((got[k] - v).norm() / v.norm().clamp_min(1e-30)).item() for k, v in want.items()}


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_process")
    results = {}
    for name, case in (dist_cases.CASES | dist_cases.FSDP2_CASES).items():
        result = dist_cases.one_step(
            tiny_model_dir, out / name, "fsdp2", case
        )  # world size 1: the distributed section is not used
        assert result.pop("world").size == 1
        results[name] = result
    return results


@pytest.fixture(scope="module")
def two_processes(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_processes")
    proc = subprocess.run(
        [*TORCHRUN, str(TESTS / "dist_cases.py"), str(tiny_model_dir), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, _output(proc)
    return {f.stem: torch.load(f) for f in out.glob("*.pt")}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_one_step_on_two_ranks_equals_one_process(strategy, one_process, two_processes):
    """Same global batch (prompts_per_step x G = 4 x 4), one GRPO step: every loss type, scale_rewards group /
    batch / batch_centered, beta > 0, mu = 2 with 2 minibatches (rows of both ranks in each),
    micro-batches."""
    for name in dist_cases.CASES:
        want, got = one_process[name], two_processes[f"{strategy}-{name}"]
        grads = _rel(got["grads"], want["grads"])  # the first optimizer step's gradient: the global loss's
        assert max(grads.values()) < 1e-6, (name, max(grads.items(), key=lambda kv: kv[1]))
        params = _rel(
            got["params"], want["params"]
        )  # after the whole step (mu x minibatches AdamW steps, clipping)
        assert max(params.values()) < 1e-6, (name, max(params.items(), key=lambda kv: kv[1]))
        print(f"{strategy} {name}: gradient {max(grads.values()):.2e}, weights {max(params.values()):.2e}")
        for key in dist_cases.SAME_METRICS:  # whole-batch metrics, reduced over the ranks
            assert (key in got["metrics"]) == (key in want["metrics"]), (name, key)
            if key not in want["metrics"]:
                continue
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (name, key)
        # per-rank counts add up: the global batch's completion tokens; the perf times are the slower rank's
        assert got["metrics"]["rollout/tokens"] == want["metrics"]["rollout/tokens"]
        if "tokens" in name:  # the cases do exercise evening out: the ranks' own counts differ
            _assert_counts_differ(name, got)
    dapo = one_process["dapo-dynamic_sampling"]["metrics"]  # the case does exercise dynamic sampling's rounds
    assert dapo["rollout/groups_dropped"] > 0 and dapo["rollout/sampling_rounds"] > 1, dapo


@pytest.mark.slow
def test_fsdp2_activation_checkpointing_and_bf16(one_process, two_processes):
    """model.gradient_checkpointing under FSDP2 gives one process's step (recomputing activations changes no
    number that matters); distributed.mixed_precision=bf16 (bf16 all-gathers and compute, fp32 reductions and
    master weights) gives one fp32 process's gradient and weights up to bf16's rounding, and its weights stay
    fp32."""
    want, got = (
        one_process["grpo-activation_checkpointing"],
        two_processes["fsdp2-grpo-activation_checkpointing"],
    )
    assert max(_rel(got["grads"], want["grads"]).values()) < 1e-6
    assert max(_rel(got["params"], want["params"]).values()) < 1e-6
    want, got = one_process["grpo-bf16"], two_processes["fsdp2-grpo-bf16"]
    grads, params = _rel(got["grads"], want["grads"]), _rel(got["params"], want["params"])
    print(
        f"bf16 against fp32: gradient {max(grads.values()):.2e}, weights {max(params.values()):.2e} (max "
        "relative, per tensor)"
    )
    assert (
        1e-6 < max(grads.values()) < 5e-2
    )  # bf16 does round (it is on), by about its precision (2^-8 = 3.9e-3)
    assert max(params.values()) < 5e-2 and all(v.dtype == torch.float32 for v in got["params"].values())
    assert got["metrics"]["policy/kl"] == pytest.approx(want["metrics"]["policy/kl"], abs=1e-3)


@pytest.mark.slow
def test_fsdp2_engine_copy_is_empty_in_the_update_and_bf16_halves_it(one_process, two_processes):
    """FSDP2 with the fast / hf engine: the engine's whole copy of the policy holds no weights during the
    update (emptied after the rollout) and is filled again after it (4 bytes per parameter);
    distributed.engine_copy=bf16 fills it with 2 bytes per parameter. On the same samples the bf16 copy's
    step is one fp32 process's: training and the saved weights stay fp32."""
    P = sum(v.numel() for v in one_process["grpo-group-beta"]["params"].values())
    assert two_processes["fsdp2-grpo-group-beta"]["engine_bytes"] == {"update": 0, "after": 4 * P}
    got, want = two_processes["fsdp2-grpo-engine_bf16"], one_process["grpo-engine_bf16"]
    assert got["engine_bytes"] == {"update": 0, "after": 2 * P}
    assert max(_rel(got["grads"], want["grads"]).values()) < 1e-6
    assert max(_rel(got["params"], want["params"]).values()) < 1e-6
    assert all(v.dtype == torch.float32 for v in got["params"].values())


def _launch(model_dir, out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*TORCHRUN, str(TESTS / "dist_cases.py"), str(model_dir), str(out), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, _output(proc)
    return proc


def _combos(tiny_model_dir, tmp_path_factory, names: list[str]) -> tuple[dict, dict]:
    """dist_cases.COMBO_CASES `names`: (one process's results, 2 ranks' results by strategy-name)."""
    out = tmp_path_factory.mktemp("combos")
    one = {}
    for name in names:
        result = dist_cases.one_step(
            tiny_model_dir, out / "one" / name, "fsdp2", dist_cases.COMBO_CASES[name]
        )
        assert result.pop("world").size == 1
        one[name] = result
    _launch(tiny_model_dir, out, "combos", ",".join(names))
    return one, {f.stem: torch.load(f) for f in out.glob("*.pt")}


def _assert_equal_step(name: str, want: dict, got: dict, prefix: str = "") -> dict[str, float]:
    """The first optimizer step's gradient and the weights after the step (of the policy, or of the critic:
    prefix "critic_") within the tolerance of the full-model cases; returns the largest differences."""
    grads, params = (
        _rel(got[f"{prefix}grads"], want[f"{prefix}grads"]),
        _rel(got[f"{prefix}params"], want[f"{prefix}params"]),
    )
    assert sorted(got[f"{prefix}grads"]) == sorted(want[f"{prefix}grads"]), name  # the same trainable tensors
    assert max(grads.values()) < 1e-6, (name, prefix, max(grads.items(), key=lambda kv: kv[1]))
    assert max(params.values()) < 1e-6, (name, prefix, max(params.items(), key=lambda kv: kv[1]))
    return {f"{prefix}grads": max(grads.values()), f"{prefix}params": max(params.values())}


def _assert_counts_differ(name: str, got: dict) -> None:
    """A token-budget case split some pass into more micro-batches on one rank than on the other (which then
    evened out: split a micro-batch or ran a filler)."""
    counts = got["micro_batch_counts"]  # [rank][pass]
    assert any(a != b for a, b in zip(*counts, strict=True)), (name, counts)


def _assert_same_metrics(name: str, want: dict, got: dict, keys) -> None:
    for key in keys:
        assert (key in got) == (key in want), (name, key)
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (name, key)


def _runs_here(name: str) -> bool:
    """Whether this machine runs COMBO_CASES `name`: LoRA needs peft, model.compile a C++ compiler."""
    if name.startswith("lora-"):
        return importlib.util.find_spec("peft") is not None
    if name.startswith("compile-"):
        return shutil.which("g++") is not None  # inductor builds C++ kernels on CPU
    return True


@pytest.fixture(scope="module")
def combo_runs(tiny_model_dir, tmp_path_factory):
    """Every COMBO_CASES case this machine runs, in one torchrun launch (each launch starts two ranks)."""
    return _combos(tiny_model_dir, tmp_path_factory, [n for n in dist_cases.COMBO_CASES if _runs_here(n)])


def _of(combo_runs, prefix: str) -> tuple[dict, dict]:
    """combo_runs' one-process results of the cases named `prefix`..., and every 2-rank result."""
    one, two = combo_runs
    mine = {n: r for n, r in one.items() if n.startswith(prefix)}
    assert mine, (prefix, list(one))
    return mine, two


@pytest.fixture(scope="module")
def lora_runs(combo_runs):
    require("peft")
    return _of(combo_runs, "lora-")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_lora_on_two_ranks_equals_one_process(strategy, lora_runs):
    """model.lora at W = 2 (FSDP2: the frozen base and the adapters sharded together per decoder layer; DDP)
    gives one process's step on the same global batch: the adapters' gradient and every weight after the
    step (the base unchanged: frozen), with pi_ref the adapter-off base (beta > 0)."""
    one, two = lora_runs
    for name, want in one.items():
        got = two[f"{strategy}-{name}"]
        assert all(".lora_" in n for n in got["grads"]), name  # only the adapters train
        print(strategy, name, _assert_equal_step(name, want, got))
        _assert_same_metrics(name, want["metrics"], got["metrics"], dist_cases.SAME_METRICS)
        assert want["metrics"]["policy/kl"] > 0 or "mu2" not in name  # pi_ref is the base: KL once it moved


@pytest.fixture(scope="module")
def critic_runs(combo_runs):
    return _of(combo_runs, "critic-")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_ppo_critic_on_two_ranks_equals_one_process(strategy, critic_runs):
    """algorithm.advantage_estimator=gae at W = 2: the value model wrapped as the policy (FSDP2 / DDP, its
    own AdamW), GAE whitened over every rank's tokens, the value loss normalized by the global minibatch's
    tokens, minibatches of every rank's rows (mu = 2, 2 minibatches, micro-batches). One PPO step equals one
    process's: the policy's and the critic's gradients and weights, and the advantage / value metrics."""
    one, two = critic_runs
    for name, want in one.items():
        got = two[f"{strategy}-{name}"]
        print(
            strategy,
            name,
            _assert_equal_step(name, want, got),
            _assert_equal_step(name, want, got, "critic_"),
        )
        keys = [k for k in want["metrics"] if k.startswith(("value/", "advantage/")) and "time" not in k]
        assert "value/explained_variance" in keys and "value/loss" in keys, keys
        _assert_same_metrics(name, want["metrics"], got["metrics"], [*dist_cases.SAME_METRICS, *keys])
        assert max(v.abs().max() for v in want["critic_grads"].values()) > 0  # the value head learns
        if "tokens" in name:
            _assert_counts_differ(name, got)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_ppo_critic_saved_at_two_ranks_resumes(strategy, combo_resumes):
    """The critic's weights and AdamW moments go into the sharded checkpoint with the policy's
    (torch.distributed.checkpoint); its step-1 checkpoint resumed at W = 2 trains to the uninterrupted run's
    step-2 policy and critic."""
    import torch.distributed.checkpoint as dcp

    from grpokit.checkpoint import DCP_DIR, checkpoint_dir

    step1 = checkpoint_dir(combo_resumes / f"{strategy}-critic-whole", 1)
    saved = dcp.FileSystemReader(step1 / DCP_DIR).read_metadata().state_dict_metadata
    assert {k.split(".", 1)[0] for k in saved} >= {"model", "optim", "critic", "critic_optim"}
    runs = torch.load(combo_resumes / f"{strategy}-critic.pt")
    for key in ("params", "critic_params"):
        rel = _rel(runs["resumed"][key], runs["whole"][key])
        print(strategy, key, f"{max(rel.values()):.2e}")
        assert max(rel.values()) < 1e-6, (key, max(rel.items(), key=lambda kv: kv[1]))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_sequence_parallel_saved_at_two_ranks_resumes(strategy, combo_resumes):
    """distributed.sequence_parallel=2: a step-1 checkpoint resumed at W = 2 trains to the uninterrupted
    run's step-2 weights, bit for bit."""
    runs = torch.load(combo_resumes / f"{strategy}-sp.pt")
    for name, w in runs["whole"]["params"].items():
        assert torch.equal(runs["resumed"]["params"][name], w), name


@pytest.mark.slow
def test_lag_saved_at_two_ranks_resumes(combo_resumes, tiny_model_dir, tmp_path, caplog):
    """rollout.max_policy_lag=1 under DDP on the fast engine: the step-1 checkpoint holds each rank's own
    batch 1, generated ahead from its share of the prompts (rank_states-R.pt), and resumed at W = 2 the run
    trains to the uninterrupted run's step-3 weights, bit for bit. Resumed in one process, the batches in
    flight are another world's: they are generated again, a line says so, and the run finishes."""
    import logging
    import shutil

    from grpokit.checkpoint import checkpoint_dir

    step1 = checkpoint_dir(combo_resumes / "ddp-lag-whole", 1)
    in_flight = [torch.load(step1 / f"rank_states-{r}.pt", weights_only=False)["pipeline"] for r in (0, 1)]
    rows = [[r.prompt_text for r in state["batches"][1][0]] for state in in_flight]
    assert all(sorted(state["batches"]) == [1] for state in in_flight) and rows[0] != rows[1], rows
    runs = torch.load(combo_resumes / "ddp-lag.pt")
    for name, w in runs["whole"]["params"].items():
        assert torch.equal(runs["resumed"]["params"][name], w), name

    shutil.copytree(step1, checkpoint_dir(tmp_path / "one", 1))
    with caplog.at_level(logging.WARNING):
        one = dist_cases.train(tiny_model_dir, tmp_path / "one", "ddp", dist_cases.COMBO_RESUME_CASES["lag"])
    assert one.pop("world").size == 1
    assert "was written at world size 2 and resumes at 1" in caplog.text
    assert "the checkpoint holds no batches generated ahead" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_partial_rollouts_saved_at_two_ranks_resume(strategy, combo_resumes):
    """rollout.partial_rollouts at W = 2: the step-1 checkpoint holds each rank's own groups in flight (its
    share of the prompts, completions under way), and resumed at W = 2 the run trains to the uninterrupted
    run's step-4 weights, bit for bit (the ranks draw and run rounds in step)."""
    from grpokit.checkpoint import checkpoint_dir

    def groups(step: int) -> list[list]:  # per rank, the groups in flight and waiting (a file a rank)
        at = checkpoint_dir(combo_resumes / f"{strategy}-partial-whole", step)
        kept = [torch.load(at / f"rank_states-{r}.pt", weights_only=False)["pipeline"] for r in (0, 1)]
        return [state["partial"]["flying"] + state["partial"]["done"] for state in kept]

    prompts = [[g.row.prompt_text for g in rank] for rank in groups(1)]
    assert all(prompts) and not set(prompts[0]) & set(prompts[1]), prompts  # each rank its own share
    # after step 2 the fresh groups of its one round are under way: 2 of their 6 tokens
    assert any(s.tokens and s.finish is None for rank in groups(2) for g in rank for s in g.samples)
    runs = torch.load(combo_resumes / f"{strategy}-partial.pt")
    for name, w in runs["whole"]["params"].items():
        assert torch.equal(runs["resumed"]["params"][name], w), name


@pytest.fixture(scope="module")
def compile_runs(combo_runs):
    if not _runs_here("compile-"):
        pytest.skip("torch.compile needs inductor and a C++ compiler")
    return _of(combo_runs, "compile-")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_compile_on_two_ranks_equals_one_process(strategy, compile_runs):
    """model.compile=true at W = 2: the training and pi_ref forwards through torch.compile of the DDP wrapper
    or the FSDP2 root (beta > 0; mu = 2 with 2 minibatches) give one compiled process's step."""
    one, two = compile_runs
    for name, want in one.items():
        got = two[f"{strategy}-{name}"]
        assert got["compiled"] and want["compiled"], name
        print(strategy, name, _assert_equal_step(name, want, got))
        _assert_same_metrics(name, want["metrics"], got["metrics"], dist_cases.SAME_METRICS)


@pytest.fixture(scope="module")
def combo_resumes(tiny_model_dir, tmp_path_factory):
    require("peft")
    out = tmp_path_factory.mktemp("combo_resumes")
    _launch(tiny_model_dir, out, "combo_checkpoints", ",".join(dist_cases.COMBO_RESUME_CASES))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_lora_saved_at_two_ranks_is_the_adapter_and_resumes(
    strategy, combo_resumes, tiny_model_dir, tmp_path
):
    """model.lora at W = 2 saves what one process saves, from rank 0: the adapter (adapter_model.safetensors,
    no base weights, no shards) and AdamW's moments by parameter order. Its step-1 checkpoint resumed at
    W = 2, and in this process at W = 1, trains to the uninterrupted run's step-2 weights."""
    import shutil

    from grpokit.checkpoint import DCP_DIR, checkpoint_dir

    step1 = checkpoint_dir(combo_resumes / f"{strategy}-lora-whole", 1)
    assert (step1 / "adapter_model.safetensors").is_file() and (step1 / "adapter_config.json").is_file()
    assert not (step1 / "model.safetensors").exists() and not (step1 / DCP_DIR).exists()
    runs = torch.load(combo_resumes / f"{strategy}-lora.pt")
    whole = runs["whole"]["params"]
    rel = _rel(runs["resumed"]["params"], whole)
    assert max(rel.values()) < 1e-6, max(rel.items(), key=lambda kv: kv[1])
    shutil.copytree(step1, checkpoint_dir(tmp_path / "one", 1))
    one = dist_cases.train(tiny_model_dir, tmp_path / "one", strategy, dist_cases.COMBO_RESUME_CASES["lora"])
    assert one.pop("world").size == 1
    rel_one = _rel(one["params"], whole)
    print(f"{strategy}: resumed at 2 ranks {max(rel.values()):.2e}, at 1 {max(rel_one.values()):.2e}")
    assert max(rel_one.values()) < 1e-6, max(rel_one.items(), key=lambda kv: kv[1])
    moved = [n for n, v in whole.items() if ".lora_B" in n and v.abs().max() > 0]
    assert moved, "the adapters trained"  # B starts at 0


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1])
def test_torchrun_trains_end_to_end(tiny_model_dir, tmp_path, lag):
    """`torchrun --nproc_per_node 2 -m grpokit train`: 2 steps (FSDP2, DAPO dynamic sampling); rank 0 logs
    each step once, evaluates, writes the final model; the ranks save the end state as one sharded checkpoint.
    lag=1: each rank's background sampler generates step 2's batch with step 1's weights
    (rollout.max_policy_lag)."""
    reward = f"{TESTS / 'reward_fns.py'}:count_sevens"
    (tmp_path / "config.yaml").write_text(f"""
model: {{name_or_path: "{tiny_model_dir}"}}
data: {{task: countdown, task_train_size: 64}}
rewards: [{{function: "{reward}"}}]
rollout: {{engine: fast, prompts_per_step: 4, num_generations: 4, max_completion_length: 6, \
max_policy_lag: {lag}}}
algorithm: {{beta: 0.04, dynamic_sampling: true, max_sampling_rounds: 2}}
optim: {{max_steps: 2, learning_rate: 1.0e-3}}
eval: {{max_samples: 4, k: 1}}
logging: {{sample_every: 1}}
checkpoint: {{save_every: 0}}
output_dir: "{tmp_path / "run"}"
""")
    proc = subprocess.run(
        [*TORCHRUN, "-m", "grpokit", "train", str(tmp_path / "config.yaml")],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, _output(proc)
    assert proc.stdout.count("done: step 2") == 1, proc.stdout
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]  # eval at start, then each step once: rank 0 alone writes
    assert "eval/pass@1" in rows[0] and "eval/pass@1" in rows[2]
    assert rows[1]["rollout/groups_drawn"] >= 4 and rows[1]["rollout/tokens"] > 0
    # step 2's first round comes from step 1's weights at lag 1 (dynamic sampling's extra rounds from the
    # current ones)
    assert rows[1]["rollout/version_lag"] == 0 and (
        0 < rows[2]["rollout/version_lag"] <= 1 if lag else rows[2]["rollout/version_lag"] == 0
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "final"
    )  # whole weights, loadable as usual
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters()
    )
    from grpokit.checkpoint import is_sharded_checkpoint, latest_checkpoint

    step, path = latest_checkpoint(tmp_path / "run")  # the end state, saved by both ranks together
    assert step == 2 and is_sharded_checkpoint(path)


def _train_yaml(tmp_path, model_dir, reward: str, *, max_steps: int, extra: str = "") -> Path:
    (tmp_path / "config.yaml").write_text(f"""
model: {{name_or_path: "{model_dir}"}}
data: {{task: countdown, task_train_size: 64, eval_size: 0}}
rewards: [{{function: "{TESTS / "reward_fns.py"}:{reward}"}}]
rollout: {{engine: fast, prompts_per_step: 4, num_generations: 4, max_completion_length: 6}}
optim: {{max_steps: {max_steps}, learning_rate: 1.0e-3}}
eval: {{at_start: false}}
output_dir: "{tmp_path / "run"}"
{extra}
""")
    return tmp_path / "config.yaml"


@pytest.mark.slow
def test_an_exception_on_one_rank_stops_every_rank_with_its_message(tiny_model_dir, tmp_path):
    """Rank 1's reward function raises in step 2 (reward_errors=raise) while rank 0 goes on into the step's
    collectives: the launcher exits non-zero within 60 s of the raise, and its output carries rank 1's
    message."""
    import time

    cfg = _train_yaml(tmp_path, tiny_model_dir, "fails_on_rank_1", max_steps=5, extra="reward_errors: raise")
    failed_at = tmp_path / "failed_at"
    proc = subprocess.run(
        [*TORCHRUN, "-m", "grpokit", "train", str(cfg)],
        env={**_env(), "GRPOKIT_TEST_FAILED_AT": str(failed_at)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    ended = time.time()
    assert proc.returncode != 0, _output(proc)
    assert failed_at.is_file(), _output(proc)  # the raise happened (and not some other failure)
    assert "rank 1 fails on purpose in its second reward call" in proc.stdout + proc.stderr, _output(proc)
    print(f"the launcher exited {ended - float(failed_at.read_text()):.1f} s after rank 1 raised")
    assert ended - float(failed_at.read_text()) < 60, _output(proc)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_a_sharded_checkpoint_that_resumes(tiny_model_dir, tmp_path):
    """SIGTERM to torchrun: every rank finishes its step, the ranks save one sharded checkpoint together, and
    the same command (here in one process) resumes from it."""
    import signal
    import time

    cfg = _train_yaml(
        tmp_path, tiny_model_dir, "count_sevens", max_steps=10_000, extra="checkpoint: {save_every: 0}"
    )
    proc = subprocess.Popen(
        [*TORCHRUN, "-m", "grpokit", "train", str(cfg)],
        env=_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while (
        not (metrics.is_file() and metrics.read_text().strip())
        and proc.poll() is None
        and time.time() < deadline
    ):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    from grpokit.checkpoint import is_sharded_checkpoint, latest_checkpoint

    found = latest_checkpoint(tmp_path / "run")
    assert found is not None, out[-3000:] + err[-5000:]
    step, path = found
    assert step >= 1 and is_sharded_checkpoint(path), path
    assert f"SIGTERM: saved step {step} to {path}" in out, out[-3000:] + err[-5000:]
    from typer.testing import CliRunner

    from grpokit.cli import app

    resumed = CliRunner().invoke(
        app, ["train", str(cfg), f"optim.max_steps={step + 1}", "checkpoint.allow_changes=[optim.max_steps]"]
    )
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming from checkpoint step {step}" in resumed.output


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "model.name_or_path=x",
            "rollout.prompts_per_step=4",
            "rollout.num_generations=4",
            "checkpoint.save_every=0",
            f"output_dir={tmp_path}",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["rollout.prompts_per_step=3"], "rollout.prompts_per_step=3 is not a multiple of the world size 2"),
        (["distributed.strategy=none"], "distributed.strategy=none is for one process"),
        (
            ["distributed.strategy=ddp", "distributed.mixed_precision=bf16"],
            "distributed.mixed_precision=bf16 is FSDP2's MixedPrecisionPolicy; with "
            "distributed.strategy=ddp use model.autocast=bfloat16 instead",
        ),
        (
            ["optim.num_minibatches=16"],
            "the minibatch of 1 completions (rollout batch / optim.num_minibatches=16) does not split into 2 "
            "equal",
        ),
        (
            ["optim.num_minibatches=2", "optim.micro_batch_size=8"],
            "optim.micro_batch_size=8 must divide each rank's share of a minibatch, 4",
        ),
        (
            ["algorithm.advantage_estimator=gae", "distributed.mixed_precision=bf16"],
            "distributed.mixed_precision=bf16 does not cover the PPO critic "
            "(algorithm.advantage_estimator=gae) yet: its value head runs in fp32; use "
            "distributed.mixed_precision=none",
        ),
        (
            ["rollout.engine=vllm", "rollout.max_policy_lag=1"],
            "rollout.max_policy_lag=1 with rollout.engine=vllm under distributed.strategy=fsdp2 at world "
            "size 2",
        ),
        (
            ["rollout.engine=vllm", "rollout.vllm_mode=server", "rollout.max_policy_lag=1"],
            "rollout.max_policy_lag=1 with rollout.vllm_mode=server at world size 2 (WORLD_SIZE from "
            "torchrun) would have each rank's background sampler push",
        ),
        (
            ["distributed.strategy=ddp", "distributed.engine_copy=bf16"],
            "distributed.engine_copy=bf16 is the dtype of the whole copy of the policy that "
            "rollout.engine=fast or hf keeps under distributed.strategy=fsdp2; with "
            "distributed.strategy=ddp and rollout.engine=fast there is none: leave it at fp32",
        ),
        (
            ["distributed.sequence_parallel=4", "model.padding_free=true"],
            "distributed.sequence_parallel=4 must divide the world size 2",
        ),
        (
            ["distributed.sequence_parallel=2", "model.padding_free=false"],
            "distributed.sequence_parallel=2 splits padding-free rows over the ranks: set "
            "model.padding_free=auto or true",
        ),
        (
            [
                "distributed.sequence_parallel=2",
                "model.padding_free=true",
                "algorithm.advantage_estimator=gae",
            ],
            "distributed.sequence_parallel=2 does not cover the PPO critic yet",
        ),
        (
            ["distributed.sequence_parallel=2", "model.padding_free=true", "model.compile=true"],
            "distributed.sequence_parallel=2 does not run under model.compile yet: set model.compile=false",
        ),
    ],
)
def test_what_two_ranks_cannot_run_is_one_line(tmp_path, monkeypatch, extra, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as err:
        World.from_env(_config(tmp_path, *extra))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra, whole",
    [
        (["rollout.engine=fast"], True),
        (["rollout.engine=hf"], True),
        (["rollout.engine=vllm"], False),
        (["rollout.engine=vllm", "rollout.vllm_mode=server"], False),
    ],
)
def test_only_an_engine_that_gathers_as_it_pushes_goes_without_a_whole_copy(
    tmp_path, monkeypatch, extra, whole
):
    """Under FSDP2 the fast and hf engines generate with an unsharded copy of the policy; vLLM takes the
    weights from the shards as it pushes, colocated (each rank into its engine) and in server mode (rank 0 to
    the server), so no rank keeps a whole copy for it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (
        World.from_env(_config(tmp_path, "distributed.strategy=fsdp2", *extra)).parallel.whole_copy is whole
    )


@pytest.fixture(scope="module")
def checkpoint_runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoints")
    one = dist_cases.train(
        tiny_model_dir, out / "one-whole", "fsdp2", dist_cases.RESUME_CASE
    )  # one process, 2 steps
    torch.save(one["params"], out / "one-whole.pt")
    _launch(tiny_model_dir, out, "checkpoints")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_saved_by_one_process_resumed_at_two_ranks(strategy, checkpoint_runs):
    """A one-process run's step-1 checkpoint (model.safetensors; AdamW's moments by parameter index, pi_ref
    after a reset, in trainer_state.pt) resumed at world size 2: every rank reads the whole tensors and keeps
    its part, and the step-2 weights are the one-process run's."""
    runs, one = torch.load(checkpoint_runs / f"{strategy}.pt"), torch.load(checkpoint_runs / "one-whole.pt")
    rel = _rel(runs["from_one"], one)
    print(f"{strategy}: one-process checkpoint resumed at 2 ranks {max(rel.values()):.2e}")
    assert max(rel.values()) < 1e-6, max(rel.items(), key=lambda kv: kv[1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_saved_at_two_ranks_resumed_at_one_and_at_two(
    strategy, checkpoint_runs, tiny_model_dir, tmp_path, monkeypatch
):
    """A run of 2 steps at world size 2 writes sharded checkpoints (torch.distributed.checkpoint) after steps
    1 and 2. Its step-1 checkpoint, resumed at world size 2 and, in this process, at world size 1, trains to
    the same step-2 weights as the uninterrupted run: the weights, AdamW's moments, the schedule, the data
    position and rank 0's generator (it draws the minibatch split) all came back. Without the moments the
    second AdamW step differs."""
    import shutil

    from grpokit.checkpoint import MARKER, STATE_FILE, checkpoint_dir, is_sharded_checkpoint

    runs = torch.load(checkpoint_runs / f"{strategy}.pt")
    step1 = checkpoint_dir(checkpoint_runs / f"{strategy}-whole", 1)
    assert is_sharded_checkpoint(step1) and (step1 / MARKER).is_file() and (step1 / STATE_FILE).is_file()
    assert sorted(p.name for p in step1.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
    assert not (step1 / "model.safetensors").exists() and not list(step1.parent.glob(".tmp-*"))
    rel = _rel(runs["resumed"], runs["whole"])
    assert max(rel.values()) < 1e-6, max(rel.items(), key=lambda kv: kv[1])

    shutil.copytree(step1, checkpoint_dir(tmp_path / "one", 1))
    one = dist_cases.train(tiny_model_dir, tmp_path / "one", strategy, dist_cases.RESUME_CASE)
    assert one.pop("world").size == 1
    rel = _rel(one["params"], runs["whole"])
    print(
        f"{strategy}: resumed at 2 ranks {max(_rel(runs['resumed'], runs['whole']).values()):.2e}, at 1 "
        f"{max(rel.values()):.2e}"
    )
    assert max(rel.values()) < 1e-6, max(rel.items(), key=lambda kv: kv[1])

    # the control: the same resume without AdamW's moments (weights, schedule, data and generators only) parts
    # from it
    from grpokit.checkpoint import sharded

    load = sharded.load_sharded
    monkeypatch.setattr(
        "grpokit.checkpoint.checkpointer.load_sharded",
        lambda path, modules, **kw: load(path, {k: (m, None) for k, (m, _) in modules.items()}, **kw),
    )
    shutil.copytree(step1, checkpoint_dir(tmp_path / "no_moments", 1))
    rel = _rel(
        dist_cases.train(tiny_model_dir, tmp_path / "no_moments", strategy, dist_cases.RESUME_CASE)["params"],
        runs["whole"],
    )
    print(f"{strategy}: resumed at 1 without the moments {max(rel.values()):.2e}")
    assert max(rel.values()) > 1e-3, max(rel.values())


def test_one_process_is_left_alone(tmp_path, monkeypatch):
    """WORLD_SIZE unset or 1: no process group, and every method returns what the one process has."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    world = World.from_env(_config(tmp_path, "checkpoint.save_every=50", "rollout.prompts_per_step=3"))
    model = torch.nn.Linear(2, 2)
    policy = world.wrap(model)
    assert policy.module is model and policy.forward is model and policy.full() is model
    assert world.parallel.full_model() is model
    assert not torch.distributed.is_initialized()
    assert world.share([5, 6, 7]) == [5, 6, 7] and world.sum(3, 7.5) == (3, 7.5) and world.sum(4) == 4
    x = torch.arange(6.0)
    assert (
        world.all_rows(x) is x and world.cat_rows(x, 8) == (x, 8) and world.all(True) and not world.all(False)
    )
    assert [i.tolist() for i in world.minibatches(4, 1)] == [[0, 1, 2, 3]]
    torch.manual_seed(0)
    order = torch.randperm(8)
    torch.manual_seed(0)
    assert torch.cat(world.minibatches(8, 2)).tolist() == order.tolist()  # the split one process draws
    assert world.is_main and world.reduce_metrics({"a": 1.0}) == {"a": 1.0}


def test_every_ranks_rows_repacked_as_one_batch():
    """cat_batches (what gather_batch does with every rank's batch) lays rows out as pack_sequences lays out
    the whole, the sampler's kept sets (top-k / top-p, each of its own width) included."""
    prompts = [[3, 4], [3, 4], [5, 6, 7], [5, 6, 7]]
    completions = [[1], [1, 2, 9], [2, 2], [9]]
    kept = [torch.tensor(k) for k in ([[1, 4, 5]], [[1, -1], [2, 3], [9, -1]], [[2], [2]], [[0, 9, 11, 12]])]

    def batch(rows):
        tokens = pack_sequences(
            [prompts[i] for i in rows], [completions[i] for i in rows], pad_id=0, kept=[kept[i] for i in rows]
        )
        n, T = tokens.completion_ids.shape
        f = torch.tensor(rows, dtype=torch.float32)
        return RolloutBatch(
            tokens,
            tokens.completion_mask.clone(),
            f > 1,
            f,
            f * 2,
            tokens.completion_mask.float() * f[:, None],
            None,
            None,
        )

    whole, parts = batch([0, 1, 2, 3]), cat_batches([batch([0, 1]), batch([2, 3])], pad_id=0)
    for field in ("input_ids", "attention_mask", "position_ids", "completion_ids", "completion_mask", "kept"):
        assert torch.equal(getattr(parts.tokens, field), getattr(whole.tokens, field)), field
    assert whole.tokens.kept is not None and whole.tokens.kept.shape == (4, 3, 4)
    for field in ("loss_mask", "truncated", "rewards", "advantages", "old_logp"):
        assert torch.equal(getattr(parts, field), getattr(whole, field)), field
    assert parts.ref_logp is None


# ------------------------------------------------------------------------------------------ two nodes
from tests.helpers import skip_or_fail  # noqa: E402
from tests.test_rollout_fleet import TAG, Hosts, _ip  # noqa: E402  (the fleet test's network namespaces)
from tests.test_rollout_server import _die_with_parent  # noqa: E402

RDZV_PORT = 29400


class Nodes(Hosts):
    """Two hosts for torchrun's two nodes: the fleet test's namespaces, each joined to one bridge by a veth
    pair, on a subnet and with interface names of their own (10.78.0.x: the fleet test, 10.77.0.x, may run
    at the same time). `interfaces`: each namespace's end of its veth pair."""

    SUBNET, NAMES = "10.78.0", "gkn"

    def _make(self, n: int) -> None:
        self.bridge, self.addresses, self.interfaces = f"{self.NAMES}b{TAG}", [], []
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise OSError("needs root and iproute2's `ip`")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.SUBNET}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(1, n + 1):
            ns, host_end, ns_end = (
                f"{self.NAMES}node{TAG}_{i}",
                f"{self.NAMES}{TAG}h{i}",
                f"{self.NAMES}{TAG}n{i}",
            )
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.SUBNET}.{i + 1}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.addresses.append(f"{self.SUBNET}.{i + 1}")
            self.interfaces.append(ns_end)


def _node_argv(nodes: Nodes, i: int, model_dir, out: Path, *args: str) -> list[str]:
    """torchrun on node i of 2, one rank, in its namespace; c10d rendezvous hosted by node 0, at its address.
    Each flag is needed where the namespaces share the host's name (here `vm`, 127.0.0.1 in /etc/hosts):
    is_host: node 0 hosts the rendezvous store (torchrun guesses it by matching the endpoint to the host's
    name and addresses, and misses a namespace's own address); --local_addr: rank 0's address becomes the
    ranks' MASTER_ADDR (by default its FQDN, which the other node resolves to itself). --node_rank is what
    the static rendezvous reads; c10d orders the nodes by --local_addr, so 10.78.0.2 is rank 0 either way."""
    return nodes.command(
        i,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(i),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{nodes.addresses[0]}:{RDZV_PORT}",
            "--rdzv_id",
            f"grpokit-nodes-{TAG}",
            "--rdzv_conf",
            f"is_host={int(i == 0)},join_timeout=300",
            "--local_addr",
            nodes.addresses[i],
            str(TESTS / "dist_cases.py"),
            str(model_dir),
            str(out),
            *args,
        ],
    )


def _launch_nodes(nodes: Nodes, model_dir, out: Path, *args: str, timeout: float = 900) -> None:
    """The two nodes' torchrun launches of dist_cases.py at once, each one's output in OUT/node<i>.log;
    asserts both exit 0. A node that fails leaves the other waiting in a collective: SIGTERM to it (torchrun
    stops its rank)."""
    import time

    procs, logs = [], [out / f"node{i}.log" for i in range(2)]
    for i, log in enumerate(logs):
        # GLOO_SOCKET_IFNAME: gloo binds to this interface's address and gives it to the other rank. Unset,
        # gloo binds to the address of the host's name, 127.0.0.1 here, and the other node cannot connect.
        env = {**_env(), "GLOO_SOCKET_IFNAME": nodes.interfaces[i]}
        with open(log, "w") as sink:
            procs.append(
                subprocess.Popen(
                    _node_argv(nodes, i, model_dir, out, *args),
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            )
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    outputs = [
        f"node {i}, exit {p.returncode}:\n"
        + _output(subprocess.CompletedProcess(p.args, p.returncode, log.read_text(), ""))
        for i, (p, log) in enumerate(zip(procs, logs, strict=True))
    ]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dir, tmp_path_factory):
    """One pair of torchrun launches, one per network namespace (dist_cases.py's `nodes` mode): both
    strategies, every CASES case's one step, and RESUME_CASE's 2-step run with its checkpoints. The
    namespaces share this machine's file system, as two machines share an NFS output_dir."""
    import time

    if os.geteuid() != 0 or shutil.which("ip") is None:
        skip_or_fail("two nodes need network namespaces: run as root, with iproute2's `ip`")
    nodes = Nodes(2)
    try:
        if nodes.reason:
            skip_or_fail(f"two nodes: {nodes.reason}")
        out = tmp_path_factory.mktemp("two_nodes")
        started = time.monotonic()
        _launch_nodes(nodes, tiny_model_dir, out, "nodes", ",".join(dist_cases.CASES))
        print(f"\ntwo nodes: both launches took {time.monotonic() - started:.0f} s")
        return out
    finally:
        nodes.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_one_step_on_two_nodes_equals_one_process(strategy, two_nodes, one_process):
    """torchrun --nnodes 2 --nproc_per_node 1 with c10d rendezvous, each node in a network namespace of its
    own (10.78.0.2 and 10.78.0.3 on a bridge), so the two ranks talk only over the veth pairs: every CASES
    case's step (the one-host test's) gives one process's first gradient and weights after the step within
    1e-6, and its whole-batch metrics."""
    where = torch.load(two_nodes / "nodes.pt")
    assert [w["GROUP_RANK"] for w in where] == ["0", "1"], where  # two nodes, one rank each
    assert all(w["MASTER_ADDR"] == "10.78.0.2" for w in where), where
    assert len({w["netns"] for w in where} | {os.readlink("/proc/self/ns/net")}) == 3, where
    worst = {"grads": 0.0, "params": 0.0}
    for name in dist_cases.CASES:
        want, got = one_process[name], torch.load(two_nodes / f"{strategy}-{name}.pt")
        rel = _assert_equal_step(name, want, got)
        print(f"two nodes, {strategy}, {name}: gradient {rel['grads']:.2e}, weights {rel['params']:.2e}")
        worst = {k: max(v, rel[k]) for k, v in worst.items()}
        _assert_same_metrics(name, want["metrics"], got["metrics"], dist_cases.SAME_METRICS)
    print(f"two nodes, {strategy}, every case: gradient {worst['grads']:.2e}, weights {worst['params']:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", dist_cases.STRATEGIES)
def test_saved_on_two_nodes_resumed_in_one_process(strategy, two_nodes, tiny_model_dir, tmp_path):
    """The two nodes' 2-step run (dr_grpo, beta = 0.04, pi_ref reset every step, mu = 2, 2 minibatches) writes
    one sharded checkpoint per step, each rank its shards and its generators; its step-1 checkpoint resumed in
    this process trains to the two-node run's step-2 weights."""
    from grpokit.checkpoint import checkpoint_dir, is_sharded_checkpoint

    step1 = checkpoint_dir(two_nodes / f"{strategy}-whole", 1)
    assert is_sharded_checkpoint(step1), step1
    assert sorted(p.name for p in step1.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
    shutil.copytree(step1, checkpoint_dir(tmp_path / "one", 1))
    one = dist_cases.train(tiny_model_dir, tmp_path / "one", strategy, dist_cases.RESUME_CASE)
    assert one.pop("world").size == 1
    rel = _rel(one["params"], torch.load(two_nodes / f"{strategy}-whole.pt"))
    print(f"two nodes, {strategy}: step-1 checkpoint resumed in one process {max(rel.values()):.2e}")
    assert max(rel.values()) < 1e-6, max(rel.items(), key=lambda kv: kv[1])
