"""rollout.vllm_mode=server under torchrun, for real: two gloo ranks on this CPU, each a client of one real
`grpokit serve` process (tests/test_rollout_server.py's fixture, on the tiny Llama of
tests/test_rollout_vllm.py), for DDP and FSDP2. Every rank generates its own share of the prompts on the
server; rank 0 alone pushes the weights after each update (under FSDP2 gathered from the shards one tensor
at a time, every rank taking part) and checks the push; no rank samples again before the push took.

One process is not the reference: the server samples from the base seed its client sends, and each rank
draws that seed from its own generator, seeded with seed + rank (trainer.py: each rank samples its own
completions), so rank 1's prompts get other seeds than the same prompts get in one process, hence other
completions and other weights (the update itself on a fixed global batch equals one process's:
tests/test_distributed.py). The reference is the same 2-rank run with a colocated vLLM engine on each rank,
which samples with the seeds its rank draws, as the server does for that rank: the samples, the metrics and
the weights after the steps must be the same (weights within the distributed tests' 1e-6, per tensor,
relative). Asserted besides: the push check ran once per step (rank 0's) and passed, every sample of both
ranks carries the step's version and was sampled from the current weights (the trainer's recomputed
log-probs equal the server's), and the saved model is the trained one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import read_metrics, require
from tests.test_distributed import _output
from tests.test_rollout_server import server  # noqa: F401 (the module's `grpokit serve` fixture)
from tests.test_vllm_torchrun import _assert_final_is_the_end_state, _config, _launch

pytestmark = pytest.mark.slow  # a server plus two ranks (a minute or more here)
TESTS = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require("vllm")


def test_rank_0_pushes_and_no_rank_samples_before_the_push_took(
    vllm_model_dir,
    tmp_path,
    server,  # noqa: F811 (the fixture imported above)
):
    """tests/dist_vllm_server.py, for DDP's replica and FSDP2's shards: each rank a client of the server.
    Rank 0 alone checks its pushes (the other's check is None) and both ranks count them; after a real
    optimizer step each rank's samples are stale (log-probs > 0.05 from the trainer's, version 0) until the
    push, and the samples a rank asks for the moment sync_weights returns carry the pushed version and the
    new weights (< 1e-3): a rank that does not push waits for rank 0's push and check."""
    script = str(TESTS / "dist_vllm_server.py")
    proc = _launch(tmp_path, script, str(vllm_model_dir), str(tmp_path), server[0])
    assert proc.returncode == 0, _output(proc)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert set(results) == {"ddp", "fsdp2"}
        for strategy, r in results.items():
            where = (rank, strategy, r)
            if rank == 0:
                assert r["first"] < 1e-3 and r["checked"] < 1e-3, where
            else:
                assert r["first"] is None and r["checked"] is None, where
            assert r["pushes"] == 2 and r["version"] == 1, where
            assert r["sampled_before"] > 0.05 and set(r["versions_before"]) == {0}, where
            assert r["sampled_after"] < 1e-3 and set(r["versions_after"]) == {1}, where


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_trains_with_every_rank_a_client_of_one_server(
    vllm_model_dir,
    tmp_path,
    server,  # noqa: F811 (the fixture imported above)
    strategy,
):
    """`torchrun --nproc_per_node 2 -m grpokit train ... rollout.vllm_mode=server`: two steps. Per step,
    rollout/push_checks is 1 (summed over the ranks: rank 0 alone pushes and checks) with its error at fp32
    noise; rollout/version_lag is 0 in the mean over both ranks and at its max over both ranks, so every
    sample of each rank carries the version of the step it trains (no lag is negative: a server reports the
    version of the last push); rollout/logp_diff_max, over both ranks' samples, says each was sampled from
    the current weights. Rank 0 evaluates through the same server; the final model is the end state. The
    same run with a colocated engine per rank samples, scores and trains alike (the module docstring)."""
    rows = _train_on_the_server_as_colocated(tmp_path, vllm_model_dir, server[0], strategy)
    assert "eval/pass@1" in rows[0] and "eval/pass@1" in rows[-1]
    _assert_final_is_the_end_state(tmp_path / "run", vllm_model_dir)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_trains_lora_with_every_rank_a_client_of_one_server(
    vllm_model_dir,
    tmp_path,
    server,  # noqa: F811 (the fixture imported above)
    strategy,
):
    """The same with model.lora: rank 0 pushes the adapted layers with the adapters merged in (from FSDP2's
    shards, or DDP's replica) and checks the push once per step; every sample carries the step's version and
    was sampled from the current adapted policy; the run saves the adapter. The same run with a colocated
    engine per rank gives the same samples, metrics and adapter."""
    require("peft")
    _train_on_the_server_as_colocated(tmp_path, vllm_model_dir, server[0], strategy, lora=True)
    final = tmp_path / "run" / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()


def _train_on_the_server_as_colocated(
    tmp_path: Path, model_dir: Path, url: str, strategy: str, lora: bool = False
) -> list[dict]:
    """The 2-step torchrun run of _config on the server at `url` (into tmp_path/run), its per-step push,
    version and mismatch metrics checked, then the same run with a colocated engine per rank (into
    tmp_path/colocated), which must be the same run (_assert_same_run). The server run's metric rows."""
    config = _config(tmp_path, model_dir, strategy, lora=lora)
    served = ("rollout.vllm_mode=server", f"rollout.vllm_server_url={url}")
    proc = _launch(tmp_path, "-m", "grpokit", "train", str(config), *served)
    assert proc.returncode == 0, _output(proc)
    assert proc.stdout.count("done: step 2") == 1, proc.stdout
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/push_checks"] == 1 and r["rollout/push_error"] < 1e-3, r
        assert r["rollout/version_lag"] == 0 and r["rollout/version_lag_max"] == 0, r
        assert r["rollout/logp_diff_max"] < 1e-3, r
    colocated = tmp_path / "colocated"
    again = _launch(tmp_path, "-m", "grpokit", "train", str(config), f"output_dir={colocated}")
    assert again.returncode == 0, _output(again)
    _assert_same_run(tmp_path / "run", colocated)
    return rows


def _assert_same_run(run: Path, reference: Path) -> None:
    """The same completions at every step, the same per-step metrics, and weights (a LoRA run's: its adapter)
    equal per tensor within 1e-6 (relative)."""
    import pandas as pd
    from safetensors.torch import load_file

    ours, theirs = (
        pd.read_parquet(run / "completions.parquet"),
        pd.read_parquet(reference / "completions.parquet"),
    )
    assert ours[["step", "prompt", "completion"]].equals(theirs[["step", "prompt", "completion"]])
    for a, b in zip(read_metrics(run), read_metrics(reference), strict=True):
        for key in ("reward/mean", "policy/kl", "rollout/tokens"):
            assert (key in a) == (key in b), (key, a, b)
            assert key not in b or a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
    lora = (reference / "final" / "adapter_model.safetensors").is_file()
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    got, want = load_file(run / "final" / weights), load_file(reference / "final" / weights)
    assert set(got) == set(want)
    rel = {k: ((got[k] - v).norm() / v.norm().clamp_min(1e-30)).item() for k, v in want.items()}
    assert max(rel.values()) < 1e-6, max(rel.items(), key=lambda kv: kv[1])
