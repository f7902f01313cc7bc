"""Builds a tiny random Llama with a character tokenizer, so the example runs with no download.

    python examples/make_tiny_model.py runs/tiny-model

With a real model, skip this and set model.name_or_path to its hub id or folder instead.
"""

import sys
from pathlib import Path

from grpokit.tasks import DEFAULT_CHARSET
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-model")
tok = build_tokenizer(DEFAULT_CHARSET, out)
# 3 heads of 32: a head size every rollout engine runs (vLLM's CPU attention has no 24, the "test" preset's)
model = build_tiny_llama(tok, size="test", num_heads=3)
model.save_pretrained(out)
print(f"saved a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter model to {out}")
