"""The sampler's truncation replayed: top-k / top-p kept sets recorded by the fast engine, and log-probs of
the distribution truncated to them (grpokit/algo/truncation.py), against worked numbers, a direct reference
(values and gradients), the fused head, and the engine's own sampling log-probs."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.algo.fused import linear_logprobs
from grpokit.algo.truncation import encode_kept, kept_mask, truncated_logprobs
from grpokit.data.batch import pack_sequences
from grpokit.data.micro_batches import MicroBatching
from grpokit.policy import batched_logprobs, completion_logprobs
from grpokit.rollout.base import EngineCaps, SamplingParams
from grpokit.rollout.fast import FastEngine
from grpokit.rollout.pipeline import truncation_note


def test_worked_numbers():
    """logits [2, 1, 0, -1], top_k=2 keeps {0, 1}: token 1 has 1 - log(e^2 + e) = -1.3133 under the sampler,
    -1.4402 under the full softmax; they differ by log(kept mass) = log(0.8808)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    target = torch.tensor([1])
    kept = encode_kept(torch.tensor([[True, True, False, False]]))
    assert kept.tolist() == [[0, 1]]
    trunc = truncated_logprobs(logits, target, kept)
    full = truncated_logprobs(logits, target, None)
    assert trunc.item() == pytest.approx(1 - math.log(math.e**2 + math.e), abs=1e-6)
    assert trunc.item() == pytest.approx(-1.3133, abs=1e-4) and full.item() == pytest.approx(
        -1.4402, abs=1e-4
    )
    assert (full - trunc).item() == pytest.approx(math.log(0.8808), abs=1e-4)
    # at temperature 2 the set is the same, the logits halved: 0.5 - log(e + e^0.5)
    half = truncated_logprobs(logits, target, kept, temperature=2.0)
    assert half.item() == pytest.approx(0.5 - math.log(math.e + math.e**0.5), abs=1e-6)


def test_kept_sets_round_trip_and_stay_within_half_the_vocabulary():
    """encode_kept lists the kept ids, or the dropped ones past half the vocabulary; kept_mask gives the mask
    back; a row of -1 only keeps everything."""
    torch.manual_seed(0)
    V = 50
    fractions = torch.tensor([0.02, 0.3, 0.5, 0.52, 0.9, 1.0])[:, None]
    mask = torch.rand(6, V) < fractions
    mask[:, 7] = True  # never an empty set
    kept = encode_kept(mask)
    assert kept.shape[1] <= V // 2 + 1
    assert torch.equal(kept_mask(kept, V), mask)
    assert (kept[4] <= -2).any() and (kept[0] >= 0).any()  # both forms used
    assert kept_mask(torch.full((2, 3), -1), V).all()


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, sets: list[set[int]], tau: float):
    """The definition, one position at a time: z_y - log sum_{v in K} exp(z_v), z = logits / tau."""
    out = []
    for row, y, keep in zip(logits.float() / tau, targets.tolist(), sets, strict=True):
        ids = torch.tensor(sorted(keep))
        out.append(row[y] - torch.log(torch.exp(row[ids]).sum()))
    return torch.stack(out)


def random_sets(logits: torch.Tensor, targets: torch.Tensor, gen: torch.Generator) -> list[set[int]]:
    """Per row a random set holding its target: small ones, and some over half the vocabulary."""
    V, sets = logits.shape[-1], []
    for i, y in enumerate(targets.tolist()):
        size = [3, V // 2 + 5, V - 1, V][i % 4]
        keep = set(torch.randperm(V, generator=gen)[:size].tolist()) | {y}
        sets.append(keep)
    return sets


def sets_tensor(sets: list[set[int]], V: int) -> torch.Tensor:
    mask = torch.zeros(len(sets), V, dtype=torch.bool)
    for i, keep in enumerate(sets):
        mask[i, sorted(keep)] = True
    return encode_kept(mask)


def test_values_and_gradients_equal_the_direct_reference():
    gen = torch.Generator().manual_seed(1)
    N, V, tau = 12, 40, 0.7
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (N,), generator=gen)
    sets = random_sets(logits, targets, gen)
    weights = torch.randn(N, generator=gen, dtype=torch.float64)

    mine_in = logits.clone().requires_grad_()
    mine = truncated_logprobs(mine_in, targets, sets_tensor(sets, V), temperature=tau)
    (mine * weights.float()).sum().backward()
    ref_in = logits.clone().float().requires_grad_()
    ref = reference_logprobs(ref_in, targets, sets, tau)
    (ref * weights.float()).sum().backward()

    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine_in.grad.float(), ref_in.grad, rtol=1e-5, atol=1e-6)
    outside = ~kept_mask(sets_tensor(sets, V), V)
    assert outside.any() and (mine_in.grad[outside] == 0).all()  # nothing flows outside the kept set
    full = truncated_logprobs(logits, targets, None, temperature=tau)
    assert (mine > full + 1e-6).sum() >= N // 2  # the rows that drop something: truncation raised them


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_head_equals_the_plain_path(entropy_grad):
    """linear_logprobs with kept sets, in chunks smaller than the rows: the plain truncated log-probs' values
    and gradients (hidden, weight, bias), the entropy the full distribution's."""
    gen = torch.Generator().manual_seed(2)
    N, H, V, tau = 10, 8, 30, 0.8
    hidden = torch.randn(N, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    bias = torch.randn(V, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=gen)
    kept = sets_tensor(random_sets(hidden.detach() @ weight.detach().T, targets, gen), V)
    g_logp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)

    logp, ent = linear_logprobs(
        hidden, weight, targets, bias=bias, temperature=tau, with_entropy=True, entropy_grad=entropy_grad,
        chunk=3, kept=kept,
    )  # fmt: skip
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy_grad else 0)
    mine = torch.autograd.grad(loss, (hidden, weight, bias))

    logits = torch.nn.functional.linear(hidden, weight, bias)
    ref_logp = truncated_logprobs(logits, targets, kept, temperature=tau)
    full = (logits / tau).log_softmax(-1)
    ref_ent = -(full.exp() * full).sum(-1)
    ref_loss = (ref_logp * g_logp).sum() + ((ref_ent * g_ent).sum() if entropy_grad else 0)
    ref = torch.autograd.grad(ref_loss, (hidden, weight, bias))

    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tok


PROMPTS = ["1 2>3=", "45 6 7>99=", "8>8=", "12 34 5 6>100="]


def sample(model, tok, record_kept: bool = True, **kw):
    prompts = [tok.encode(t) for t in PROMPTS]
    torch.manual_seed(5)
    sampling = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, record_kept=record_kept, **kw
    )
    out = FastEngine(model, tok).generate(prompts, 4, sampling)
    kept = out.kept if record_kept else None
    batch = pack_sequences([p for p in prompts for _ in range(4)], out.token_ids, tok.pad_token_id, kept=kept)
    sampler = torch.zeros(batch.completion_ids.shape)
    for i, lp in enumerate(out.logprobs):
        sampler[i, : len(lp)] = torch.tensor(lp)
    return out, batch, sampler


def test_engine_kept_sets_replay_the_sampler_logprobs(model_and_tok):
    """top_p=0.9, top_k=20: the engine returns one kept set per token, each holding its token and at most 20
    ids (the tiny vocabulary has 24: sets of more than 12 are stored as the ids dropped); completion_logprobs
    with them gives the engine's log-probs (plain, fused, padding-free, batched); without them it gives the
    full distribution's, lower by the log of the kept mass."""
    model, tok = model_and_tok
    V = model.config.vocab_size
    out, batch, sampler = sample(model, tok)
    mask = batch.completion_mask.bool()
    assert out.kept is not None and len(out.kept) == len(out.token_ids)
    for ids, kept in zip(out.token_ids, out.kept, strict=True):
        assert kept.shape[0] == len(ids) and 1 <= kept.shape[1] <= V // 2 + 1
        sets = kept_mask(kept, V)  # [len, V]
        assert sets[torch.arange(len(ids)), torch.tensor(ids)].all() and (sets.sum(-1) <= 20).all()
    sizes = kept_mask(batch.kept, V)[mask].sum(-1)
    assert sizes.float().mean() > 2 and (sizes < V).all()  # every step dropped something, kept several

    with torch.no_grad():
        replayed, _ = completion_logprobs(model, batch, temperature=0.9, fused=False)
        fused, _ = completion_logprobs(model, batch, temperature=0.9, fused=True)
        packed, _ = completion_logprobs(model, batch, temperature=0.9, padding_free=True, share_prompts=False)
        untruncated, _ = completion_logprobs(model, pack_sequences_without_kept(batch), temperature=0.9)
    old = batched_logprobs(model, batch, MicroBatching(size=5), temperature=0.9)
    for logp in (replayed, fused, packed, old):
        torch.testing.assert_close(logp[mask], sampler[mask], rtol=0, atol=2e-5)

    # before: the full distribution's log-probs are the sampler's plus log(kept mass) <= 0
    logits = full_logits(model, batch, 0.9)
    log_mass = torch.logsumexp(
        logits.masked_fill(~kept_mask(batch.kept, logits.shape[-1]), float("-inf")), -1
    ) - torch.logsumexp(logits, -1)
    torch.testing.assert_close((untruncated - sampler)[mask], log_mass[mask], rtol=0, atol=2e-5)
    assert log_mass[mask].mean() < -0.05  # the gap that replaying closes


def pack_sequences_without_kept(batch):
    from dataclasses import replace

    return replace(batch, kept=None)


def full_logits(model, batch, tau: float) -> torch.Tensor:
    """[N, T, V] logits / tau predicting each completion token (one plain pass)."""
    T = batch.completion_width
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
    return out[:, -T - 1 : -1].float() / tau


def test_without_record_kept_the_engine_still_reports_the_sampled_distribution(model_and_tok):
    """record_kept off (rollout.replay_truncation=false): no kept sets, and the engine's log-probs are still
    those of the distribution it drew from, the same tokens and log-probs as with the record."""
    model, tok = model_and_tok
    with_sets, _, lp_with = sample(model, tok)
    without, batch, lp_without = sample(model, tok, record_kept=False)
    assert without.kept is None and batch.kept is None
    assert without.token_ids == with_sets.token_ids
    torch.testing.assert_close(lp_without, lp_with, rtol=0, atol=0)


def test_engines_without_kept_sets_say_so_at_start():
    class Cfg:
        engine, top_k, top_p, replay_truncation = "hf", 20, 0.9, True

    line = truncation_note(Cfg, EngineCaps())
    assert line is not None and "untruncated distribution" in line and "rollout.engine=hf" in line
    assert truncation_note(Cfg, FastEngine.caps) is None
    Cfg.replay_truncation = False
    assert truncation_note(Cfg, EngineCaps()) is None
    Cfg.replay_truncation, Cfg.top_k, Cfg.top_p = True, 0, 1.0
    assert truncation_note(Cfg, EngineCaps()) is None


@pytest.mark.slow
def test_the_trainers_pi_old_is_the_distribution_the_engine_sampled_from(tiny_model_dir, tmp_path):
    """A GRPO run on the fast engine at top_p=0.9, top_k=20 with pi_old recomputed (num_iterations=2) and a
    KL term (pi_ref): with the kept sets replayed, rollout/logp_diff_max (|log pi_old - log pi_sampler| over
    the step's tokens) is float noise; with rollout.replay_truncation=false it is the log of the kept mass."""
    from grpokit.trainer import Trainer
    from tests.helpers import read_metrics, tiny_config

    def run(name, *extra):
        out = tmp_path / name
        cfg = tiny_config(
            tiny_model_dir,
            out,
            "rollout.engine=fast",
            "rollout.top_p=0.9",
            "rollout.top_k=20",
            "rollout.temperature=0.9",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "algorithm.num_iterations=2",
            "algorithm.beta=0.04",
            "optim.max_steps=2",
            "checkpoint.save_every=0",
            *extra,
        )
        Trainer(cfg).train()
        return [row for row in read_metrics(out) if "rollout/logp_diff_max" in row]

    full = run("full", "rollout.replay_truncation=false")
    # without the sets: |log pi_old - log pi_sampler| is the log of the kept mass
    assert len(full) == 2 and all(r["rollout/logp_diff_mean"] > 0.05 for r in full)
    replayed = run("replayed")
    assert len(replayed) == 2 and all(r["rollout/logp_diff_max"] < 1e-4 for r in replayed)


@pytest.mark.slow
def test_the_fast_engine_in_its_own_process_returns_the_kept_sets(model_and_tok):
    """rollout.async_sampler=process: the child's kept sets cross the pipe; they replay its log-probs."""
    from grpokit.rollout.process import ProcessEngine

    model, tok = model_and_tok
    prompts = [tok.encode(t) for t in PROMPTS]
    engine = ProcessEngine(model, tok)
    try:
        sampling = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, record_kept=True)
        out = engine.generate(prompts, 2, sampling)
    finally:
        engine.close()
    assert out.kept is not None and [len(k) for k in out.kept] == [len(ids) for ids in out.token_ids]
    batch = pack_sequences([p for p in prompts for _ in range(2)], out.token_ids, tok.pad_token_id, out.kept)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, temperature=0.9)
    for i, lp in enumerate(out.logprobs):
        torch.testing.assert_close(logp[i, : len(lp)], torch.tensor(lp), rtol=0, atol=2e-5)
