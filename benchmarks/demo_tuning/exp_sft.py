"""One demo-tuning run: build the char tokenizer + tiny Llama, SFT on countdown, eval on 500
held-out problems (greedy pass@1, pass@8 at T=1.0). Appends a JSON line to results.jsonl.

    .venv/bin/python benchmarks/demo_tuning/exp_sft.py --num-count 4 --max-number 9 --n-train 20000 --epochs 2
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import evaluate  # noqa: E402

from grpokit.sft import train_sft
from grpokit.tasks import DEFAULT_CHARSET
from grpokit.tasks.countdown import CountdownTask
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer

p = argparse.ArgumentParser()
p.add_argument("--num-count", type=int, default=4)
p.add_argument("--min-count", type=int)
p.add_argument("--min-number", type=int, default=1)
p.add_argument("--max-number", type=int, default=9)
p.add_argument("--max-target", type=int, default=99)
p.add_argument("--ops", default="+-*")
p.add_argument("--format", default="expression")
p.add_argument("--max-new", type=int, default=24)
p.add_argument("--size", default="demo")
p.add_argument("--hidden", type=int)
p.add_argument("--layers", type=int)
p.add_argument("--inter", type=int)
p.add_argument("--n-train", type=int, default=20000)
p.add_argument("--epochs", type=float)
p.add_argument("--steps", type=int)
p.add_argument("--bs", type=int, default=64)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"])
p.add_argument("--wd", type=float, default=0.01)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--n-test", type=int, default=500)
p.add_argument("--save")
p.add_argument("--tag", default="")
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)

task = CountdownTask(num_count=a.num_count, min_count=a.min_count, min_number=a.min_number, max_number=a.max_number,
                     max_target=a.max_target, ops=a.ops, solution_format=a.format)
tok = build_tokenizer(DEFAULT_CHARSET)
model = build_tiny_llama(tok, size=a.size, hidden_size=a.hidden, num_layers=a.layers, intermediate_size=a.inter, seed=a.seed)
n_params = sum(p.numel() for p in model.parameters())
t0 = time.perf_counter()
train = task.make_rows("train", a.n_train, seed=a.seed)
test = task.make_rows("test", a.n_test, seed=1000 + a.seed)
t_data = time.perf_counter() - t0
print(f"params {n_params/1e6:.2f}M  data {t_data:.1f}s", flush=True)
c0 = time.process_time()
stats = train_sft(model, tok, train, epochs=a.epochs, steps=a.steps, batch_size=a.bs, lr=a.lr, schedule=a.schedule, weight_decay=a.wd,
                  seed=a.seed, log_every=100, log_fn=lambda m: print({k: round(v, 4) for k, v in m.items()}, flush=True))
sft_cpu = time.process_time() - c0
print("sft", stats, flush=True)
c0 = time.process_time()
ev = evaluate(model, tok, task, test, max_new_tokens=a.max_new)
eval_cpu = time.process_time() - c0
print("eval", ev, flush=True)
res = {"tag": a.tag, "args": vars(a), "params_M": round(n_params / 1e6, 2), "data_s": round(t_data, 1),
       "sft_s": round(stats["time_s"], 1), "sft_cpu_s": round(sft_cpu, 1), "eval_cpu_s": round(eval_cpu, 1), "sft_steps": stats["steps"], "final_loss": round(stats["final_loss"], 4),
       **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in ev.items() if k != "examples"}}
print("RESULT", json.dumps(res), flush=True)
with open(Path(__file__).parent / "results.jsonl", "a") as f:
    f.write(json.dumps(res) + "\n")
if a.save:
    model.save_pretrained(a.save)
    tok.save_pretrained(a.save)
