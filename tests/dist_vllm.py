"""The push check of rollout.engine=vllm on every rank, for tests/test_vllm_torchrun.py: under torchrun each
rank runs its own vLLM engine on the policy wrapped as the trainer wraps it (DDP's replica, or FSDP2's shards,
which the engine gathers as it pushes), and records, per strategy, how far the engine's log-probs are from
the trainer's before and after a push that follows a real optimizer step:

    torchrun --standalone --nproc_per_node 2 tests/dist_vllm.py MODEL_DIR OUT_DIR [lora]

lora: the policy has LoRA adapters (peft), pushed as merged weights.

Each rank writes OUT_DIR/rank-R.json: {strategy: {"first": .., "before": .., "after": .., "sampled_before":
.., "sampled_after": ..}} (max |diff|: the probe's prompt log-probs, and the log-probs of completions the
engine sampled on this rank's own prompts).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # torchrun runs this file as a script

from grpokit.distributed import World  # noqa: E402 (after the path)
from grpokit.rollout import SamplingParams  # noqa: E402 (after the path)
from grpokit.rollout.vllm import VLLMEngine  # noqa: E402 (after the path)
from grpokit.rollout.weights import probe_ids, push_error  # noqa: E402 (after the path)
from tests.test_rollout_vllm import load, max_diff, one_optimizer_step, prompts  # noqa: E402 (after the path)


def push_check(model_dir: str, strategy: str, lora: bool) -> dict[str, float]:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    world = World(rank, size, int(os.environ["LOCAL_RANK"]), strategy)
    world.parallel.whole_copy = False  # as World.from_env sets it for rollout.engine=vllm
    model, tok = load(model_dir)
    if lora:  # peft's adapters as model.lora puts them (apply_lora itself refuses several ranks for now)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    policy = world.wrap(model)
    engine = VLLMEngine(policy.whole, tok, max_model_len=64, max_seqs=8, kv_cache_mb=32)
    try:
        mine = [prompts(tok)[rank % 2]]  # each rank its own prompt, as world.share gives them
        ids = probe_ids(model, 99)
        n, sampling = 4, SamplingParams(max_tokens=8)
        out = {"first": engine.last_push_error}
        one_optimizer_step(model, tok)
        stale = engine.generate(mine, n, sampling)
        out["before"] = push_error(engine.prompt_logprobs(ids), model, ids)
        out["sampled_before"] = max_diff(model, mine, stale, n)
        engine.sync_weights(policy.full())
        out["after"] = push_error(engine.prompt_logprobs(ids), model, ids)
        out["sampled_after"] = max_diff(model, mine, engine.generate(mine, n, sampling), n)
        out["pushed_check"] = engine.last_push_error
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    lora = sys.argv[3:] == ["lora"]
    results = {s: push_check(model_dir, s, lora) for s in ("ddp", "fsdp2")}
    (out_dir / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(results))
    torch.distributed.barrier()  # no collective in flight when the process exits (World.teardown)
    torch.distributed.destroy_process_group()
