"""Writes examples/prompts.jsonl: two-digit additions with their answers (prompt, answer columns).

    python examples/make_data.py
"""
import json
import random
from pathlib import Path

rng = random.Random(0)
rows = []
for _ in range(400):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
out = Path(__file__).parent / "prompts.jsonl"
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} rows to {out}")
