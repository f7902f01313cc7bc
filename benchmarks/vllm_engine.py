"""The vllm engine's own costs on the demo-shaped model: import, start, a weight push (with and without its
check), and one rollout of 16 prompts x 8 samples x up to 16 tokens against the fast engine.

    .venv/bin/python benchmarks/vllm_engine.py

The model is the demo's Llama with 3 attention heads of 64 (vLLM's CPU kernel has no head size 48), freshly
initialized: 1.78M parameters. Rollouts alternate vllm / fast, 5 calls each, twice; medians are printed.
--smoke: one call each, once, and one push with and without its check: a check that the benchmark runs.
"""

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one call of each (see above)")
    args = ap.parse_args()
    calls, rounds = (1, 1) if args.smoke else (5, 2)
    torch.set_num_threads(1)
    from grpokit.rollout import SamplingParams
    from grpokit.rollout.fast import FastEngine
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    tok = build_tokenizer(get_task("countdown"))
    model = build_tiny_llama(tok, size="demo", num_heads=3, seed=0).eval()
    print(f"parameters {sum(p.numel() for p in model.parameters()):,}")
    t = time.perf_counter()
    import vllm  # noqa: F401 (only whether it imports)

    from grpokit.rollout.vllm import VLLMEngine

    print(f"import vllm {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    engine = VLLMEngine(model, tok, max_model_len=256, max_seqs=128)
    print(f"engine start, first push and its check included {time.perf_counter() - t:.1f} s")
    prompts = [tok(r["prompt"])["input_ids"] for r in get_task("countdown").make_rows("test", 16, 0)]
    sampling, fast = SamplingParams(max_tokens=16), FastEngine(model, tok)
    for name, e in (("vllm", engine), ("fast", fast)) * rounds:
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            e.generate(prompts, 8, sampling)
            times.append(time.perf_counter() - t)
        print(f"{name}: 16 prompts x 8 x <= 16 tokens, median {sorted(times)[calls // 2]:.3f} s")
    for verify in (True, False):
        engine.verify, times = verify, []
        for _ in range(calls):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)
            t = time.perf_counter()
            engine.sync_weights(model)
            times.append(time.perf_counter() - t)
        print(f"push {'with' if verify else 'without'} its check: median {sorted(times)[calls // 2]:.3f} s")
    print(f"last check: max |vLLM - trainer| log-prob on the probe {engine.last_push_error:.2g}")
    engine.close()


if __name__ == "__main__":
    main()
