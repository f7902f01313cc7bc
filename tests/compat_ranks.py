"""Cells of the compatibility table (grpokit/rollout/compat.py) at world size 2, for tests/test_compat.py:
under torchrun every rank trains each named cell for two steps with its real engine, one after another:

    torchrun --standalone --nproc_per_node 2 tests/compat_ranks.py MODEL_DIR OUT_DIR SLUG,... [SERVER_URL]

SERVER_URL: the `grpokit serve` process (on MODEL_DIR) of the cells in server mode.

Each cell's run goes to OUT_DIR/SLUG (rank 0 writes its metrics.jsonl); rank 0 also writes OUT_DIR/SLUG.json:
how many of the LoRA adapters' B matrices moved (they start at 0), and whether the policy's forward is
compiled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from grpokit.rollout.compat import CELLS
from grpokit.trainer import Trainer
from tests.helpers import tiny_config


def run(model_dir: str, out: Path, slug: str, server_url: str = "") -> Trainer:
    cell = next(c for c in CELLS if c.slug == slug)
    server = [f"rollout.vllm_server_url={server_url}"] if cell.mode == "vllm, vllm_mode=server" else []
    cfg = tiny_config(
        model_dir, out / slug, *cell.overrides(), *server, "optim.max_steps=2", "checkpoint.save_every=0"
    )
    trainer = Trainer(cfg)
    trainer.train()
    whole = trainer.world.parallel.full_model()  # every rank takes part (FSDP2 gathers the shards)
    moved = [n for n, p in whole.named_parameters() if ".lora_B" in n and p.abs().max() > 0]
    if trainer.world.is_main:
        # torch.compile of a module (the model, or DDP's wrapper of it) is an OptimizedModule
        compiled = isinstance(trainer.policy.forward, torch._dynamo.eval_frame.OptimizedModule)
        (out / f"{slug}.json").write_text(json.dumps({"lora_B_moved": len(moved), "compiled": compiled}))
    return trainer


def main(model_dir: str, out_dir: str, slugs: str, server_url: str = "") -> None:
    torch.set_num_threads(1)
    trainer = None
    for slug in slugs.split(","):
        trainer = run(model_dir, Path(out_dir), slug, server_url)
    if trainer is not None:
        trainer.world.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
