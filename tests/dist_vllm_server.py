"""rollout.vllm_mode=server under torchrun at the engine's level, for tests/test_vllm_server_torchrun.py:
every rank builds a client of one `grpokit serve` process on the policy wrapped as the trainer wraps it (DDP's
replica, or FSDP2's shards with no whole copy), and records, per strategy, what its samples say before and
right after a push that follows a real optimizer step:

    torchrun --standalone --nproc_per_node 2 tests/dist_vllm_server.py MODEL_DIR OUT_DIR URL

Each rank writes OUT_DIR/rank-R.json: {strategy: {"first": .., "checked": .., "sampled_before": ..,
"sampled_after": .., "versions_before": [..], "versions_after": [..], "version": .., "pushes": ..}} (first /
checked: the engine's own push check of its first and second push, None where this rank ran none; sampled_*:
max |the server's sampling log-probs - the trainer's| on this rank's own prompt).
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
from grpokit.rollout.server import VLLMServerEngine  # noqa: E402 (after the path)
from tests.test_rollout_vllm import load, max_diff, one_optimizer_step, prompts  # noqa: E402 (after the path)


def push_and_sample(model_dir: str, url: str, strategy: str) -> dict:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    world = World(rank, size, int(os.environ["LOCAL_RANK"]), strategy)
    world.parallel.whole_copy = False  # as World.from_env sets it for rollout.engine=vllm
    model, tok = load(model_dir)
    policy = world.wrap(model)
    engine = VLLMServerEngine(policy.whole, tok, url=url, timeout=300)  # every rank; rank 0 pushes
    mine = [prompts(tok)[rank % 2]]  # each rank its own prompt, as world.share gives them
    n, sampling = 4, SamplingParams(max_tokens=8)
    out: dict = {"first": engine.last_push_error}
    one_optimizer_step(model, tok)
    stale = engine.generate(mine, n, sampling)
    out["sampled_before"], out["versions_before"] = max_diff(model, mine, stale, n), stale.versions
    engine.sync_weights(policy.full(), version=1)
    comps = engine.generate(mine, n, sampling)  # at once: sync_weights returned, so the push took
    out["sampled_after"], out["versions_after"] = max_diff(model, mine, comps, n), comps.versions
    out.update(checked=engine.last_push_error, version=engine.version, pushes=engine.pushes)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_dir, out_dir, url = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    results = {s: push_and_sample(model_dir, url, s) for s in ("ddp", "fsdp2")}
    (out_dir / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(results))
    torch.distributed.barrier()  # no collective in flight when the process exits (World.teardown)
    torch.distributed.destroy_process_group()
