"""Sequence parallelism over 2 ranks against one process's padding-free pass, for test_sequence_parallel.py:

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 tests/sp_cases.py MODEL_DIR OUT_DIR

Every rank builds a data x sequence DeviceMesh (1 x 2, gloo), and for each model (the tests' tiny Llama, a
tiny Qwen2 with 1 and with 2 KV heads, one with 3 query heads), packed row and head (plain, fused) runs
grpokit.distributed.sequence's log-probs, entropy, a GRPO loss and its backward, the gradients summed over the
sequence ranks. The reference is completion_logprobs(padding_free=True) in the same process on a separate
copy of the model (its own config, never switched to the Ulysses attention, no collective in its pass). Rank
0 saves the largest differences, the tensors compared and each rank's share of tokens to OUT_DIR/results.pt.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpokit.algo import policy_loss
from grpokit.config.sections import LoraConfig
from grpokit.data.batch import pack_sequences
from grpokit.distributed.sequence import SequenceGroup, enable, sequence_parallel_logprobs, shard_row
from grpokit.policy import apply_lora, completion_logprobs, is_checkpointing, load_model

#: packed rows (prompts, completions) and where their sequence boundaries fall against the 2 shards
ROWS: dict[str, tuple[list[list[int]], list[list[int]]]] = {
    # 20 tokens: the second sequence starts exactly at the edge (token 10); an empty completion at the end
    "boundary_on_edge": (
        [[1, 5, 6, 7], [2, 8, 9], [3, 4]],
        [[10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20], []],
    ),
    # 21 tokens, padded to 22: the first completion crosses the edge (token 10 predicts token 11, on rank 1)
    "across_edge_odd": (
        [[1, 2, 3], [4, 5, 6, 7]],
        [[8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [18, 19, 20, 21]],
    ),
    # 17 tokens, padded to 18: rank 0 holds only prompt tokens and predicts nothing
    "rank0_predicts_nothing": ([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13]], [[14, 15], [16, 17]]),
}
QWEN2 = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)


def models(model_dir: str) -> dict[str, torch.nn.Module]:
    """The reference models (sdpa): the tiny Llama from disk, tiny Qwen2s with 1 (< N = 2) and 2 KV heads and
    one with 3 query heads (not a multiple of N),
    the Llama with LoRA adapters (nonzero: B drawn at random), and the Llama recomputing its layers in the
    backward (gradient checkpointing: the Ulysses attention runs again there)."""
    out = {"llama": load_model(model_dir, attn_implementation="sdpa")}
    for kv in (1, 2):
        torch.manual_seed(kv)
        out[f"qwen2_kv{kv}"] = Qwen2ForCausalLM(
            Qwen2Config(**QWEN2, num_key_value_heads=kv, attn_implementation="sdpa")
        )
    torch.manual_seed(3)  # 3 query heads over N = 2 (SmolLM2: 9 and 3), GQA: zero heads pad them to 4
    odd = {**QWEN2, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    out["qwen2_heads3"] = Qwen2ForCausalLM(Qwen2Config(**odd, attn_implementation="sdpa"))
    lora = apply_lora(load_model(model_dir, attn_implementation="sdpa"), LoraConfig(r=4, alpha=8))
    torch.manual_seed(3)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    out["llama_lora"] = lora
    checkpointed = load_model(model_dir, attn_implementation="sdpa").train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    out["llama_checkpointed"] = checkpointed
    return out


def run_case(ref, model, sp: SequenceGroup, prompts, completions, fused: bool, loss_type: str) -> dict:
    """One row through both: the largest differences of log-probs, entropy, loss and (per tensor, relative)
    gradients."""
    vocab = ref.get_input_embeddings().weight.shape[0]
    batch = pack_sequences(
        [[t % vocab for t in p] for p in prompts], [[t % vocab for t in c] for c in completions], pad_id=0
    )
    mask = batch.completion_mask.float()
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(mask.shape[0], generator=generator)
    offsets = torch.randn(mask.shape, generator=generator) * 0.1  # pi_old off pi_theta: some ratios clip
    old = None  # the reference's log-probs plus the offsets, in both runs (a loss that depends on logp)
    results = []
    for net, run in (
        (ref, lambda m: completion_logprobs(m, batch, with_entropy=True, fused=fused, padding_free=True)),
        (model, lambda m: sequence_parallel_logprobs(m, batch, sp, with_entropy=True, fused=fused)),
    ):
        net.zero_grad()
        logp, entropy = run(net)
        old = logp.detach() + offsets if old is None else old
        loss, _ = policy_loss(logp, old, advantages, mask, eps_low=0.05, loss_type=loss_type)
        loss.backward()
        if net is model:
            sp.sum_gradients(model)
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy, loss.detach(), grads))
    (logp, entropy, loss, grads), (sp_logp, sp_entropy, sp_loss, sp_grads) = results
    assert sorted(grads) == sorted(sp_grads)
    on = mask.bool()
    return {
        "logp": (sp_logp - logp)[on].abs().max().item(),
        "entropy": (sp_entropy - entropy)[on].abs().max().item(),
        "loss": (sp_loss - loss).abs().item(),
        "grads": max(((sp_grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in grads.items()),
        "padding_zero": bool((sp_logp[~on] == 0).all()),
        "shard": shard_row_size(batch, sp),
    }


def shard_row_size(batch, sp: SequenceGroup) -> list[int]:
    """Every rank's count of tokens in its share (all_gather), and the row's length last."""
    from grpokit.data.batch import one_row

    row = one_row(batch)
    mine = torch.tensor([shard_row(row, sp.rank, sp.size).input_ids.shape[1]])
    parts = [torch.zeros_like(mine) for _ in range(sp.size)]
    dist.all_gather(parts, mine, group=sp.group)
    return [int(p) for p in parts] + [row.positions]


def unswitched_error(ref, sp: SequenceGroup, prompts, completions) -> str:
    """The error of a model whose attention was never switched to Ulysses (a silent no-op otherwise)."""
    batch = pack_sequences(prompts, completions, pad_id=0)
    try:
        with torch.no_grad():
            sequence_parallel_logprobs(copy.deepcopy(ref), batch, sp)
    except RuntimeError as e:
        return str(e)
    return ""


def main(model_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("data", "sequence"))
    sp = SequenceGroup.from_mesh(mesh, "sequence")
    results: dict = {}
    refs = models(model_dir)
    for name, ref in refs.items():
        model = copy.deepcopy(ref)  # its own config: switching it leaves the reference on sdpa
        enable(model)
        assert ref.config._attn_implementation == "sdpa"
        assert is_checkpointing(model) == (name == "llama_checkpointed")
        for row, (prompts, completions) in ROWS.items():
            for fused, loss_type in ((False, "grpo"), (True, "dapo")):
                key = f"{name}-{row}-{'fused' if fused else 'plain'}-{loss_type}"
                results[key] = run_case(ref, model, sp, prompts, completions, fused, loss_type)
    results["unswitched_error"] = unswitched_error(refs["qwen2_kv1"], sp, *ROWS["across_edge_odd"])
    if sp.rank == 0:
        torch.save(results, f"{out_dir}/results.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
