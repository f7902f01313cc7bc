"""Server mode's own costs against the colocated engine, on the demo-shaped model
(benchmarks/vllm_engine.py's): the server's start, a weight push through /dev/shm (with and without its
check), and one rollout of 16 prompts x 8 samples x up to 16 tokens over HTTP.

    .venv/bin/python benchmarks/vllm_server.py

`grpokit serve` runs as a subprocess with 1 thread; this process (the trainer's side, and the colocated
engine) uses 1 thread too. Rollouts alternate server / colocated, 5 calls each, twice; pushes 5 each; medians
are printed. --smoke: one call of each, once: a check that the benchmark runs.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str, float]:
    t = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "grpokit",
                "serve",
                str(model_dir),
                "--port",
                "0",
                "--threads",
                "1",
                "--max-num-seqs",
                "128",
                "--max-model-len",
                "256",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    while not (ready := re.search(r"ready on (http://\S+):", log.read_text())):
        if proc.poll() is not None:
            raise SystemExit(log.read_text()[-3000:])
        time.sleep(0.1)
    return proc, ready.group(1), time.perf_counter() - t


def median_time(fn, calls: int = 5) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[calls // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one call of each (see above)")
    args = ap.parse_args()
    calls, rounds = (1, 1) if args.smoke else (5, 2)
    torch.set_num_threads(1)
    from grpokit.rollout import SamplingParams
    from grpokit.rollout.server import VLLMServerEngine
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="grpokit-bench-server-"))
    tok = build_tokenizer(get_task("countdown"), folder)
    model = build_tiny_llama(tok, size="demo", num_heads=3, seed=0).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"parameters {sum(p.numel() for p in model.parameters()):,}")
    proc, url, started = start_server(folder, folder / "serve.log")
    try:
        print(f"grpokit serve: process start to 'ready' {started:.1f} s")
        t = time.perf_counter()
        server = VLLMServerEngine(model, tok, url=url)
        print(f"client: model check and first push (all tensors, checked) {time.perf_counter() - t:.2f} s")
        t = time.perf_counter()
        colocated = VLLMEngine(model, tok, max_model_len=256, max_seqs=128)
        print(f"colocated engine start, first push and its check included {time.perf_counter() - t:.1f} s")
        prompts = [tok(r["prompt"])["input_ids"] for r in get_task("countdown").make_rows("test", 16, 0)]
        sampling = SamplingParams(max_tokens=16)
        for name, e in (("server", server), ("colocated", colocated)) * rounds:
            print(
                f"{name}: 16 prompts x 8 x <= 16 tokens, median "
                f"{median_time(lambda e=e: e.generate(prompts, 8, sampling), calls):.3f} s"
            )

        def push(e):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)
            e.sync_weights(model)

        for verify in (True, False):
            for name, e in (("server", server), ("colocated", colocated)):
                e.verify = verify
                print(
                    f"{name}: push {'with' if verify else 'without'} its check, median "
                    f"{median_time(lambda e=e: push(e), calls):.3f} s"
                )
        server.verify = True
        push(server)
        print(f"last server check: max |vLLM - trainer| log-prob on the probe {server.last_push_error:.2g}")
        colocated.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
