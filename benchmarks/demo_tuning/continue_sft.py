"""Control for the GRPO trials: continue SFT of a saved model on fresh reference solutions.

    .venv/bin/python benchmarks/demo_tuning/continue_sft.py LR STEPS BATCH WARMUP   (model /tmp/sft_G)
"""
import sys, torch
sys.path.insert(0, "benchmarks/demo_tuning")
from common import evaluate
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpokit.sft import train_sft
from grpokit.tasks.countdown import CountdownTask
torch.set_num_threads(1)
lr = float(sys.argv[1]); steps = int(sys.argv[2]); bs = int(sys.argv[3])
tok = AutoTokenizer.from_pretrained("/tmp/sft_G"); model = AutoModelForCausalLM.from_pretrained("/tmp/sft_G")
task = CountdownTask()
test = task.make_rows("test", 500, seed=1000)
train = task.make_rows("train", 10000, seed=7)
train_sft(model, tok, train, steps=steps, batch_size=bs, lr=lr, warmup=int(sys.argv[4]), schedule="constant", weight_decay=0.0, seed=3)
ev = evaluate(model, tok, task, test, max_new_tokens=16)
print("cont-sft", lr, steps, bs, {k: v for k, v in ev.items() if k != "examples"})
