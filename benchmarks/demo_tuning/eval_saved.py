"""Re-evaluate a saved SFT model on 500 held-out countdown problems (greedy pass@1, pass@8 at T=1).

    .venv/bin/python benchmarks/demo_tuning/eval_saved.py MODEL_DIR --num-count 4 --min-count 3 --max-number 20
"""
import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import evaluate  # noqa: E402

from grpokit.tasks.countdown import CountdownTask

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--num-count", type=int, default=4)
p.add_argument("--min-count", type=int)
p.add_argument("--max-number", type=int, default=9)
p.add_argument("--n-test", type=int, default=500)
p.add_argument("--seed", type=int, default=1000)
p.add_argument("--threads", type=int, default=1)
a = p.parse_args()
torch.set_num_threads(a.threads)
task = CountdownTask(num_count=a.num_count, min_count=a.min_count, max_number=a.max_number)
model = AutoModelForCausalLM.from_pretrained(a.model)
tok = AutoTokenizer.from_pretrained(a.model)
print(evaluate(model, tok, task, task.make_rows("test", a.n_test, seed=a.seed)))
