"""Which held-out problems flip between two saved models under greedy decoding (right -> wrong, wrong -> right).

    .venv/bin/python benchmarks/demo_tuning/greedy_flips.py BEFORE_DIR AFTER_DIR
"""
import sys, torch
sys.path.insert(0, "benchmarks/demo_tuning")
from common import generate
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpokit.tasks.countdown import CountdownTask, parse_expression
torch.set_num_threads(1)
A, B = sys.argv[1], sys.argv[2]
task = CountdownTask(); test = task.make_rows("test", 500, seed=1000)
outs = {}
for name in [A, B]:
    tok = AutoTokenizer.from_pretrained(name); m = AutoModelForCausalLM.from_pretrained(name)
    outs[name] = [g[0] for g in generate(m, tok, [r["prompt"] for r in test], max_new_tokens=16)]
a, b = outs[A], outs[B]
from collections import Counter
cat = Counter()
def kind(t, r):
    try:
        v, used = parse_expression(t.strip(), "+-*")
    except ValueError:
        return "malformed"
    if sorted(used) != sorted(r["numbers"]): return "wrong-numbers"
    return "correct" if v == r["target"] else f"miss"
for x, y, r in zip(a, b, test):
    cat[(kind(x, r), kind(y, r))] += 1
for k, v in sorted(cat.items(), key=lambda kv: -kv[1]): print(k, v)
n = 0
for x, y, r in zip(a, b, test):
    if kind(x, r) == "correct" and kind(y, r) != "correct" and n < 15:
        n += 1; print(r["prompt"], "|", x, "|", y, "|", kind(y, r))
