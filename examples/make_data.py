"""Writes examples/prompts.jsonl (two-digit additions with their answers: prompt, answer columns) for
`grpokit train`, and examples/sft.jsonl (other additions with the solution: prompt, completion columns)
for the `grpokit sft` warm-start.

    python examples/make_data.py
"""

import json
import random
from pathlib import Path

here = Path(__file__).parent
rng = random.Random(0)
rows = []
for _ in range(400):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
(here / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} rows to {here / 'prompts.jsonl'}")

# SFT pairs: problems that are not among the RL prompts, so the RL held-out set stays unseen.
taken = {r["prompt"] for r in rows}
pairs = []
while len(pairs) < 2000:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if f"{a}+{b}=" not in taken:
        taken.add(f"{a}+{b}=")
        pairs.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
(here / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
print(f"wrote {len(pairs)} rows to {here / 'sft.jsonl'}")
