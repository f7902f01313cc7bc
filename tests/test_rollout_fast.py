"""The fast rollout engine: same tokens as transformers' generate, same sampling distribution, log-probs
equal to the trainer's, EOS / length handling and prompt-major order.

The model is a tiny random Llama (GQA, untied head) saved and loaded with from_pretrained; its weights
are drawn with a larger std than usual (0.15) so that greedy completions vary with the prompt and
some of them stop at EOS within a few tokens while others run to the length limit.
"""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import grpokit.rollout.fast as fast
from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs
from grpokit.rollout import make_engine
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.fast import FastEngine, process_logits
from grpokit.rollout.hf import HFEngine
from grpokit.tasks import get_task
from grpokit.tasks.tokenizer import build_tokenizer

TEXTS = ["1 2>3=", "45 6 7>99=", "8>8=", "12 34 5 6>100=", "7", "3 3 3 3 3 3 3 3 3 3 3>1="]  # ragged


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 64-wide model gains nothing from intra-op threads, and on a loaded machine their barriers cost
    10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast_engine_model")
    build_tokenizer(get_task("countdown"), path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.15,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()  # as the trainer hands it over
    return model, tok


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, model_and_tok):
    """Learned absolute positions: unlike RoPE, a wrong position shifted by a constant changes the output."""
    _, tok = model_and_tok
    path = tmp_path_factory.mktemp("fast_engine_gpt2")
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        initializer_range=0.15,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


@pytest.fixture(scope="module")
def prompts(model_and_tok):
    _, tok = model_and_tok
    return [tok(t)["input_ids"] for t in TEXTS]


def test_make_engine_routes_fast(model_and_tok):
    model, tok = model_and_tok
    assert isinstance(make_engine("fast", model, tok, batch_size=8), FastEngine)


@pytest.mark.parametrize("compact_fraction", [0.0, fast.COMPACT_FRACTION], ids=["at_first_eos", "default"])
def test_greedy_matches_hf_generate(model_and_tok, prompts, monkeypatch, compact_fraction):
    """Ragged prompts, n=3: the same tokens and finish reasons as generate, prompt-major."""
    monkeypatch.setattr(fast, "COMPACT_FRACTION", compact_fraction)  # 0.0: rows leave at their EOS
    model, tok = model_and_tok
    greedy = SamplingParams(max_tokens=20, greedy=True)
    n = 3
    # generate refuses num_return_sequences > 1 without sampling, so it gets each prompt n times.
    ref = HFEngine(model, tok).generate([p for p in prompts for _ in range(n)], 1, greedy)
    out = FastEngine(model, tok).generate(prompts, n, greedy)
    assert out.token_ids == ref.token_ids
    assert out.finish_reasons == ref.finish_reasons
    assert out.texts == ref.texts
    assert {"stop", "length"} <= set(out.finish_reasons)  # both paths exercised
    assert len({tuple(out.token_ids[i * n]) for i in range(len(prompts))}) == len(prompts)  # prompt-dependent
    # One prompt per call (batch_size caps sequences), and n=1, change nothing.
    assert FastEngine(model, tok, batch_size=n).generate(prompts, n, greedy).token_ids == ref.token_ids
    assert FastEngine(model, tok).generate(prompts, 1, greedy).token_ids == ref.token_ids[::n]


def test_greedy_matches_hf_generate_absolute_positions(gpt2, model_and_tok, prompts):
    """Left padding must not shift positions (position = cumsum(mask) - 1), which only a model with
    absolute position embeddings can see."""
    _, tok = model_and_tok
    greedy = SamplingParams(max_tokens=12, greedy=True)
    ref = HFEngine(gpt2, tok).generate([p for p in prompts for _ in range(2)], 1, greedy)
    out = FastEngine(gpt2, tok).generate(prompts, 2, greedy)
    assert out.token_ids == ref.token_ids
    assert out.finish_reasons == ref.finish_reasons


def test_train_mode_restored(model_and_tok, prompts):
    model, tok = model_and_tok
    assert model.training
    FastEngine(model, tok).generate(prompts[:2], 2, SamplingParams(max_tokens=3))
    assert model.training
    model.eval()
    FastEngine(model, tok).generate(prompts[:2], 2, SamplingParams(max_tokens=3))
    assert not model.training
    model.train()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (3, 0.5), (50, 0.95)])
def test_process_logits_matches_transformers_warpers(top_k, top_p):
    """Temperature -> top-k -> top-p, with transformers' tie and boundary rules (ties at the k-th value
    kept)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 23)
    logits[:8] = torch.randint(-2, 3, (8, 23)).float()  # many exact ties
    sp = SamplingParams(max_tokens=1, temperature=0.7, top_k=top_k, top_p=top_p)
    ref = TemperatureLogitsWarper(0.7)(None, logits)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(process_logits(logits, sp), ref, rtol=0, atol=0)


def test_first_token_frequencies_match_processed_distribution(model_and_tok, prompts):
    """4000 samples of the first token at T=0.7, top_k=5 and a top_p chosen so that it keeps 3 of those 5,
    against the exact distribution, built by hand: softmax(logits / T), keep the 5 most likely, renormalize,
    keep the smallest most-likely set whose mass reaches top_p, renormalize. Chi-square at the 0.1% level,
    fixed seed."""
    model, tok = model_and_tok
    prompt = prompts[0]
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    model.train()
    p, order = torch.softmax(logits / 0.7, -1).sort(descending=True)
    p = p[:5] / p[:5].sum()
    mass = p.cumsum(0)
    top_p = float(mass[1] + mass[2]) / 2  # strictly between the mass of the top 2 and the top 3
    keep = int((mass < top_p).sum()) + 1  # smallest prefix with mass >= top_p
    support, p = order[:keep], p[:keep] / p[:keep].sum()
    assert keep == 3 and len(logits) > 5  # both filters cut something; otherwise the test would not test them

    N = 4000
    torch.manual_seed(1234)
    out = FastEngine(model, tok).generate(
        [prompt], N, SamplingParams(max_tokens=1, temperature=0.7, top_k=5, top_p=top_p)
    )
    first = torch.tensor([ids[0] for ids in out.token_ids])
    assert torch.isin(first, support).all(), "sampled a token outside the top-k / top-p support"
    # the engine's log-probs are those of this distribution, the one the tokens were drawn from
    lp = torch.tensor([lps[0] for lps in out.logprobs])
    by_hand = p.log()[(first[:, None] == support[None]).int().argmax(-1)]
    torch.testing.assert_close(lp, by_hand, rtol=0, atol=1e-5)
    counts = torch.stack([(first == t).sum() for t in support]).double()
    chi2 = float(((counts - N * p.double()) ** 2 / (N * p.double())).sum())
    critical = 13.82  # chi-square 0.999 quantile, df = keep - 1 = 2
    assert chi2 < critical, (chi2, counts.tolist(), (N * p).tolist())


def test_eos_and_length(model_and_tok, prompts):
    """A stopped completion ends with its only EOS ("stop"); otherwise it has max_tokens tokens and no EOS
    ("length")."""
    model, tok = model_and_tok
    torch.manual_seed(0)
    out = FastEngine(model, tok).generate(prompts, 8, SamplingParams(max_tokens=10, temperature=1.0))
    eos = tok.eos_token_id
    assert len(out) == len(prompts) * 8
    for ids, why, lp, text in zip(out.token_ids, out.finish_reasons, out.logprobs, out.texts, strict=True):
        assert len(lp) == len(ids)
        assert text == tok.decode(ids, skip_special_tokens=True)
        if why == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert why == "length" and len(ids) == 10 and eos not in ids
    assert {"stop", "length"} <= set(out.finish_reasons)
    assert out.truncated == [r == "length" for r in out.finish_reasons]
    empty = FastEngine(model, tok).generate(prompts[:2], 2, SamplingParams(max_tokens=0))
    assert empty.token_ids == [[]] * 4 and empty.finish_reasons == ["length"] * 4


@pytest.mark.parametrize(
    "compact_fraction,top_k,top_p",
    [(0.0, 0, 1.0), (fast.COMPACT_FRACTION, 0, 1.0), (fast.COMPACT_FRACTION, 5, 0.9)],
    ids=["at_first_eos", "default", "filtered"],
)
def test_logprobs_equal_trainer_logprobs(model_and_tok, prompts, monkeypatch, compact_fraction, top_k, top_p):
    """Sampled completions (rows leaving the batch at different steps): the engine's log-probs are the ones
    completion_logprobs computes with the same temperature, so the prompt-major order, the shared prompt
    cache, positions and masks after compaction are all right. With top-k / top-p they are the renormalized
    sampler's, which completion_logprobs computes from the kept sets the engine records."""
    monkeypatch.setattr(fast, "COMPACT_FRACTION", compact_fraction)
    model, tok = model_and_tok
    n, T = 4, 0.8
    torch.manual_seed(3)
    out = FastEngine(model, tok).generate(
        prompts, n, SamplingParams(max_tokens=12, temperature=T, top_k=top_k, top_p=top_p, record_kept=True)
    )
    assert (
        len({len(ids) for ids in out.token_ids}) > 2
    )  # ragged completions: rows left the batch at different steps
    assert (out.kept is None) == (top_k == 0 and top_p == 1.0)  # recorded only where the sampler truncates
    batch = pack_sequences([p for p in prompts for _ in range(n)], out.token_ids, tok.pad_token_id, out.kept)
    model.eval()
    with torch.no_grad():
        ref, _ = completion_logprobs(model, batch, temperature=T)
    model.train()
    for i, lp in enumerate(out.logprobs):
        torch.testing.assert_close(torch.tensor(lp), ref[i, : len(lp)], rtol=1e-4, atol=1e-4)


def test_categorical_draw_has_the_distribution_and_never_draws_a_zero():
    from grpokit.rollout.fast import sample_categorical

    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    draws = torch.stack([sample_categorical(probs) for _ in range(20000)])  # [20000, 3]
    freq = torch.stack([torch.bincount(draws[:, r], minlength=5).float() / len(draws) for r in range(3)])
    assert freq[:, [0, 2]][0].sum() == 0 and (draws[:, 1] == 0).all() and (draws[:, 2] == 4).all()
    torch.testing.assert_close(freq[0], probs[0], rtol=0, atol=0.015)  # 4 sigma at n = 20000
    huge = torch.softmax(torch.randn(4, 151936), -1)  # a real vocabulary: indices in range, where the mass is
    idx = sample_categorical(huge)
    assert idx.shape == (4,) and (idx < 151936).all() and (huge.gather(1, idx[:, None]) > 0).all()


def test_stop_token_ids_end_a_row_like_eos_and_are_kept():
    """SamplingParams.stop_token_ids: a row ends right after its first stop sequence (kept) or at EOS, and the
    log-probs of what it kept are the model's (one scoring pass over prompt + completion)."""
    from grpokit.data.batch import pack_sequences
    from grpokit.policy import completion_logprobs
    from grpokit.rollout import SamplingParams
    from grpokit.rollout.fast import FastEngine
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    tok = build_tokenizer("0123456789+*=ab")
    model = build_tiny_llama(tok, size="test", seed=1).eval()
    engine, prompts = (
        FastEngine(model, tok),
        [tok.encode(p) for p in ("12*3", "7", "1", "99", "3*3", "+", "42", "8")],
    )
    stop = tuple(tok.encode("77", add_special_tokens=False))  # a frequent pair of this random model
    torch.manual_seed(3)
    out = engine.generate(prompts, 8, SamplingParams(max_tokens=40, stop_token_ids=(stop,)))
    stopped = 0
    for ids in out.token_ids:
        first = next((j + 2 for j in range(len(ids) - 1) if tuple(ids[j : j + 2]) == stop), None)
        assert tok.eos_token_id not in ids[:-1] and (first is None or first == len(ids))
        stopped += first is not None
    assert stopped >= 2 and any(len(ids) == 40 or ids[-1] == tok.eos_token_id for ids in out.token_ids)
    tokens = pack_sequences(
        [p for p in prompts for _ in range(8)], out.token_ids, tok.pad_token_id
    )  # 64 rows
    with torch.no_grad():
        logp, _ = completion_logprobs(model, tokens)
    for i, lps in enumerate(out.logprobs):
        torch.testing.assert_close(logp[i, : len(lps)], torch.tensor(lps), atol=2e-5, rtol=0)
