"""GRPO on top of a saved SFT model with the demo's settings (grpokit.demo.FULL), to check the
SFT point leaves GRPO something to win. Prints the eval rows (pass@1 / pass@8) before and after.

    .venv/bin/python benchmarks/demo_tuning/grpo_trial.py SFT_DIR OUT_DIR [--threads 1] [key=value ...]
"""
import argparse
import json
import time
from pathlib import Path

import torch

from grpokit.config import load_config
from grpokit.demo import FULL
from grpokit.trainer import Trainer

p = argparse.ArgumentParser()
p.add_argument("sft_dir")
p.add_argument("out_dir")
p.add_argument("--threads", type=int, default=2)
p.add_argument("overrides", nargs="*")
a = p.parse_intermixed_args()
torch.set_num_threads(a.threads)
cfg = load_config(None, [f"model.name_or_path={a.sft_dir}", "data.task=countdown", f"output_dir={a.out_dir}",
                         "seed=0", *FULL["grpo"], *a.overrides])
t0, c0 = time.perf_counter(), time.process_time()
Trainer(cfg).train()
print(f"GRPO wall {time.perf_counter() - t0:.0f}s cpu {time.process_time() - c0:.0f}s")
for line in (Path(a.out_dir) / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row.get("eval/pass@1") is not None:
        print({k: v for k, v in row.items() if k.startswith("eval/") or k in ("step", "perf/elapsed_s")})
