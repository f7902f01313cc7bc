"""A minimal, independent GRPO loop (on-policy, mu=1, no KL, per-sequence mean loss) over a saved
SFT model: a cross-check of how much GRPO can win from a given SFT point, independent of
grpokit.trainer. Evaluates greedy pass@1 / pass@8 on the same 500 held-out problems as exp_sft.py.

    .venv/bin/python benchmarks/demo_tuning/mini_grpo.py SFT_DIR --steps 150 --lr 1e-4
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import evaluate, generate  # noqa: E402

from grpokit.tasks.countdown import CountdownTask

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--steps", type=int, default=150)
p.add_argument("--prompts", type=int, default=16)
p.add_argument("--G", type=int, default=8)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--max-new", type=int, default=16)
p.add_argument("--save")
p.add_argument("--format", default="expression")
p.add_argument("--num-count", type=int, default=4)
p.add_argument("--min-count", type=int, default=3)
p.add_argument("--max-number", type=int, default=20)
p.add_argument("--temp", type=float, default=1.0, help="rollout temperature (log-probs use the same)")
p.add_argument("--n-train", type=int, default=10000)
p.add_argument("--eval-every", type=int, default=100)
p.add_argument("--adv", default="grpo", choices=["grpo", "positive", "nostd"], help="positive: only A>0 (rejection-sampling fine-tuning)")
p.add_argument("--schedule", default="constant", choices=["constant", "cosine", "linear"])
p.add_argument("--warmup", type=int, default=0)
p.add_argument("--beta2", type=float, default=0.999)
p.add_argument("--partial", type=float, default=0.1, help="countdown partial reward of a well-formed miss")
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
task = CountdownTask(num_count=a.num_count, min_count=a.min_count or None, max_number=a.max_number,
                     solution_format=a.format, partial_reward=a.partial)
tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model)
test = task.make_rows("test", 500, seed=1000)
train = task.make_rows("train", 10000, seed=0)[: a.n_train]
ev = evaluate(model, tok, task, test, max_new_tokens=a.max_new)
print("before", {k: v for k, v in ev.items() if k != "examples"}, flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, a.beta2), weight_decay=0.0)
g = torch.Generator().manual_seed(0)
import math
decay = {"constant": lambda f: 1.0, "cosine": lambda f: 0.5 * (1 + math.cos(math.pi * f)), "linear": lambda f: 1 - f}[a.schedule]
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / (a.warmup + 1)) * decay(min(i / a.steps, 1.0)))
t0 = time.perf_counter()
for step in range(1, a.steps + 1):
    rows = [train[i] for i in torch.randint(len(train), (a.prompts,), generator=g).tolist()]
    tok.padding_side = "left"
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        seq = model.generate(**enc, do_sample=True, temperature=a.temp, top_k=0, top_p=1.0, max_new_tokens=a.max_new,
                             num_return_sequences=a.G, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    P = enc["input_ids"].shape[1]
    comp = seq[:, P:]  # [N, T]
    is_eos = comp == tok.eos_token_id
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    cmask = (~after_eos).float()  # completion tokens up to and including the first EOS
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    reps = [r for r in rows for _ in range(a.G)]
    rewards = torch.tensor(task.reward(texts, numbers=[r["numbers"] for r in reps], target=[r["target"] for r in reps]))
    rg = rewards.view(a.prompts, a.G)
    adv = rg - rg.mean(1, keepdim=True)
    if a.adv != "nostd":
        adv = adv / (rg.std(1, unbiased=False, keepdim=True) + 1e-6)
    adv = adv.view(-1)  # [N]
    if a.adv == "positive":
        adv = adv.clamp(min=0)
    attn = torch.cat([enc["attention_mask"].repeat_interleave(a.G, 0), cmask.long()], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    model.train()
    logits = model(input_ids=seq, attention_mask=attn, position_ids=pos).logits[:, P - 1:-1].float() / a.temp  # [N, T, V]
    logp = torch.log_softmax(logits, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)  # [N, T]
    per_seq = (logp * cmask).sum(1) / cmask.sum(1).clamp(min=1)
    loss = -(adv * per_seq).mean()
    opt.zero_grad()
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % 10 == 0:
        print(f"step {step} reward {rewards.mean():.3f} acc {(rewards == 1).float().mean():.3f} gn {gn:.2f} "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    if step % a.eval_every == 0 and step < a.steps:
        greedy = generate(model, tok, [r["prompt"] for r in test], max_new_tokens=a.max_new)
        print(f"  step {step} greedy pass@1 {sum(task.is_correct(x[0], r) for x, r in zip(greedy, test)) / len(test):.3f}",
              flush=True)
print(f"GRPO {time.perf_counter() - t0:.0f}s")
ev = evaluate(model, tok, task, test, max_new_tokens=a.max_new)
print("after", {k: v for k, v in ev.items() if k != "examples"}, flush=True)
if a.save:
    model.save_pretrained(a.save)
    tok.save_pretrained(a.save)
