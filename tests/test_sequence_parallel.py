"""Sequence parallelism (grpokit/distributed/sequence.py): a packed row's tokens split over 2 ranks give one
process's padding-free log-probs, entropy, loss and gradients, for a Llama and GQA Qwen2 models.

The sharding itself is checked here on its own (which tokens each rank holds and predicts); the equality runs
under torchrun on a real 2-process gloo world (tests/sp_cases.py, one launch for every case).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpokit.data.batch import one_row, pack_sequences
from grpokit.distributed.sequence import shard_row

sys.path.insert(0, str(Path(__file__).parent))
import sp_cases  # tests/ is not a package; torchrun runs the same file as a script
from test_distributed import TORCHRUN, _env, _output

TESTS = Path(__file__).parent


@pytest.mark.parametrize("size", [2, 3])
def test_shards_hold_ceil_l_over_n_tokens_and_predict_the_whole_row(size):
    """Each rank holds ceil(L / N) tokens of the padded row; its predictions, rank after rank, are the row's,
    with targets from the whole row: the token after a shard's last position sits on the next rank."""
    row = one_row(pack_sequences(*sp_cases.ROWS["across_edge_odd"], pad_id=0))  # 21 tokens
    shards = [shard_row(row, r, size) for r in range(size)]
    S = -(-21 // size)
    assert [s.input_ids.shape[1] for s in shards] == [S] * size
    assert torch.cat([s.input_ids[0] for s in shards])[:21].tolist() == row.input_ids[0].tolist()
    assert [int(s.predicts.numel()) for s in shards] == shards[0].counts
    predicted = torch.cat([s.predicts + r * S for r, s in enumerate(shards)])
    assert predicted.tolist() == row.predicts.tolist()
    assert torch.cat([s.targets for s in shards], dim=1).tolist() == row.targets.tolist()
    assert all(s.kept is None for s in shards)
    sets = [
        torch.arange(len(c))[:, None].repeat(1, 2) + 100 * i
        for i, c in enumerate(sp_cases.ROWS["across_edge_odd"][1])
    ]
    kept_row = one_row(pack_sequences(*sp_cases.ROWS["across_edge_odd"], pad_id=0, kept=sets))
    kept_shards = [
        shard_row(kept_row, r, size).kept for r in range(size)
    ]  # the targets' kept sets travel too
    assert torch.cat(kept_shards, dim=1).tolist() == kept_row.kept.tolist()
    if size == 2:  # position 10 (rank 0's last) predicts token 11, the first of rank 1
        assert shards[0].predicts[-1] == S - 1 and shards[0].targets[0, -1] == row.input_ids[0, S]


def test_shard_sequence_ids_keep_the_whole_rows_sequences_and_padding_apart():
    """The attention segments come from the whole row's positions: a sequence that continues on the next rank
    stays one sequence, and the padding that makes the row a multiple of N is a sequence of its own."""
    row = one_row(pack_sequences(*sp_cases.ROWS["across_edge_odd"], pad_id=0))  # sequences of 13 and 8 tokens
    shard = shard_row(row, 1, 2)
    assert shard.sequence_ids.tolist() == [0] * 13 + [1] * 8 + [2]
    assert shard.position_ids[0].tolist() == [*range(11, 13), *range(8), 0]  # rank 1: tokens 11..21
    assert shard.segments() == [(0, 13), (13, 21), (21, 22)]  # attention runs causal within each


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence_parallel")
    proc = subprocess.run(
        [*TORCHRUN, str(TESTS / "sp_cases.py"), str(tiny_model_dir), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, _output(proc)
    return torch.load(out / "results.pt")


@pytest.mark.slow
def test_two_sequence_ranks_equal_one_process(two_ranks):
    """Llama, Qwen2 with 1 KV head (< N = 2: repeated) and with 2, Qwen2 with 3 query heads (zero heads pad
    them to 4), Llama with LoRA, Llama with gradient
    checkpointing; rows with a sequence boundary on the
    shard edge, a completion across it (odd length, padded), a rank that predicts nothing; plain and fused
    head; GRPO and DAPO losses: log-probs, entropy, loss and every parameter's gradient (summed over the
    sequence ranks) equal one process's padding-free pass."""
    cases = {k: v for k, v in two_ranks.items() if k != "unswitched_error"}
    expected = {
        f"{m}-{r}-{h}"
        for m in ("llama", "qwen2_kv1", "qwen2_kv2", "qwen2_heads3", "llama_lora", "llama_checkpointed")
        for r in sp_cases.ROWS
        for h in ("plain-grpo", "fused-dapo")
    }
    assert set(cases) == expected
    for key, got in cases.items():
        print(
            f"{key}: logp {got['logp']:.1e}, entropy {got['entropy']:.1e}, loss {got['loss']:.1e}, "
            f"gradient {got['grads']:.1e} (max relative per tensor); tokens per rank {got['shard'][:2]} of "
            f"{got['shard'][2]}"
        )
        assert got["logp"] < 1e-5 and got["entropy"] < 1e-5 and got["loss"] < 1e-6, (key, got)
        assert got["grads"] < 1e-5, (key, got)
        assert got["padding_zero"], key
        L = got["shard"][2]
        assert got["shard"][:2] == [-(-L // 2)] * 2, key  # each rank held ceil(L / 2) tokens


@pytest.mark.slow
def test_a_model_not_switched_to_ulysses_fails_naming_its_class(two_ranks):
    """A split that silently ran local attention only (the model's attention never switched to Ulysses)
    fails after the forward, naming the model class."""
    message = two_ranks["unswitched_error"]
    assert "Qwen2ForCausalLM ran the Ulysses attention in 0 of its 2 layers" in message
