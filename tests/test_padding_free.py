"""model.padding_free: a micro-batch's sequences back to back in one row give the padded pass's log-probs,
gradients and training step; models that would let packed sequences see each other are refused."""

import pytest
import torch
from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

from grpokit.algo import policy_loss
from grpokit.config import SFTConfig
from grpokit.data.batch import one_row, pack_sequences
from grpokit.policy import check_padding_free, completion_logprobs, load_model
from grpokit.policy.attention import ATTENTION, segments, use_segment_attention
from grpokit.trainer import Trainer
from tests.helpers import read_metrics, require, tiny_config

# Very different lengths: prompts of 1 to 14 tokens, completions of 0 to 12.
PROMPTS = [[1, 5], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1], [1, 2, 3, 4]]
COMPS = [[3, 4, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14], [12], [13, 14, 15, 16, 17], []]


@pytest.fixture(scope="module")
def batch():
    return pack_sequences(PROMPTS, COMPS, pad_id=0)


def model_of(model_dir, attn="sdpa"):
    """The tiny model with `attn`; grpokit_sdpa: loaded with sdpa, then switched as padding-free runs do."""
    model = load_model(str(model_dir), attn_implementation="sdpa" if attn == ATTENTION else attn).eval()
    if attn == ATTENTION:
        assert use_segment_attention(model) and model.config._attn_implementation == ATTENTION
    return model


def test_one_row_drops_every_pad(batch):
    row = one_row(batch)
    real = sum(len(p) + len(c) for p, c in zip(PROMPTS, COMPS, strict=True))  # 39 real tokens
    assert row.positions == real and batch.input_ids.numel() == 4 * (14 + 12)  # 104 positions padded
    assert row.position_ids[0, :16].tolist() == [*range(14), 0, 1]  # restart at each sequence
    assert row.targets[0].tolist() == [t for c in COMPS for t in c]


@pytest.mark.parametrize(
    "attn, fused", [("sdpa", False), ("eager", False), ("sdpa", True), (ATTENTION, False), (ATTENTION, True)]
)
def test_padding_free_logprobs_equal_padded(tiny_model_dir, batch, attn, fused):
    model = model_of(tiny_model_dir, attn)
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        padded = completion_logprobs(model, batch, with_entropy=True, fused=fused, share_prompts=False)
        packed = completion_logprobs(model, batch, with_entropy=True, fused=fused, padding_free=True)
    for a, b in zip(packed, padded, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a[mask], b[mask], rtol=1e-5, atol=1e-5)
        assert (a[~mask] == 0).all()  # nothing on padding


@pytest.mark.parametrize("attn", ["sdpa", ATTENTION])
def test_padding_free_gradient_equals_padded(tiny_model_dir, batch, attn):
    model = model_of(tiny_model_dir, attn).train()
    mask = batch.completion_mask.float()
    torch.manual_seed(0)
    advantages = torch.randn(len(PROMPTS))
    old = torch.randn(mask.shape) * 0.1  # offsets of pi_old from pi_theta: some ratios clip
    grads = {}
    for padding_free in (False, True):
        model.zero_grad()
        logp, _ = completion_logprobs(model, batch, padding_free=padding_free, share_prompts=False)
        loss, _ = policy_loss(logp, logp.detach() + old, advantages, mask, eps_low=0.05, loss_type="dapo")
        loss.backward()
        grads[padding_free] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 0
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("lora", [False, True])
def test_one_training_step_is_the_same_padding_free(tiny_model_dir, tmp_path, monkeypatch, lora):
    """pi_theta (two micro-batches, two passes), pi_old and pi_ref (beta > 0) all run padding-free; with LoRA
    too (pi_ref: the adapter off)."""
    adapters = ["model.lora={r: 4, alpha: 8, target_modules: all-linear}"] if lora else []
    if lora:
        require("peft")
    import grpokit.policy.logprobs as logprobs

    rows = []  # the padding-free rows the passes ran: [1, L] each
    monkeypatch.setattr(logprobs, "one_row", lambda b: rows.append(one_row(b)) or rows[-1])
    # these short prompts would run once on shared prompts (cheaper: see the next test); here every pass packs
    monkeypatch.setattr(logprobs, "_sharing_is_cheaper", lambda batch, shared: False)
    weights, padding = {}, {}
    for padding_free in (False, True):
        cfg = tiny_config(
            tiny_model_dir,
            tmp_path / str(padding_free),
            "optim.max_steps=1",
            "checkpoint.save_every=0",
            "optim.micro_batch_size=16",
            "algorithm.num_iterations=2",
            "algorithm.beta=0.04",
            # Adam's first steps are sign(g) where |g| >> eps: float noise in a gradient that is ~0 (1e-7 of
            # the largest) would flip a whole step. A larger eps keeps those steps in proportion to it.
            "optim.adam_epsilon=1e-4",
            f"model.padding_free={str(padding_free).lower()}",
            *adapters,
        )
        trainer = Trainer(cfg)
        trainer.train()
        padding[padding_free] = read_metrics(tmp_path / str(padding_free))[-1]["perf/padding_frac"]
        weights[padding_free] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    # 2 micro-batches x (pi_old + pi_ref + 2 training passes), each one row of real tokens only
    assert len(rows) == 8 and all(r.input_ids.shape[0] == 1 for r in rows)
    assert padding[True] == 0 < padding[False]
    for name, w in weights[False].items():
        torch.testing.assert_close(weights[True][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_padding_free_passes_take_shared_prompts_where_those_compute_fewer_positions(tiny_model_dir):
    """With model.padding_free on, a pass whose rows share prompts runs them once (padded, on their KV cache)
    when U x P + N x T is below the real tokens, else the padding-free row; the log-probs are the same."""
    import grpokit.policy.logprobs as logprobs

    model = model_of(tiny_model_dir)
    long_prompt = list(range(3, 23))  # 20 tokens
    G = 4
    short = pack_sequences(
        [long_prompt] * G, [[5, 6], [7, 8, 9], [5], [6, 7]], pad_id=0
    )  # 1 x 20 + 4 x 3 < 88
    tail = pack_sequences([[3, 4]] * G, [[5] * 30, [6], [7], [8]], pad_id=0)  # 2 + 4 x 30 > 4 x 2 + 33
    assert logprobs.runs_packed(model, short, True) is False and logprobs.runs_packed(model, tail, True)
    assert logprobs.runs_packed(model, short, True, share_prompts=False)  # no sharing: the row
    assert not logprobs.runs_packed(model, tail, False)  # padding_free off: padded rows
    for batch in (short, tail):
        packed, _ = completion_logprobs(model, batch, padding_free=True)
        padded, _ = completion_logprobs(model, batch, share_prompts=False)
        mask = batch.completion_mask.bool()
        torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ppo_step_is_the_same_padding_free(tiny_model_dir, tmp_path):
    """The PPO critic's passes (V_old, its update) padding-free too: the values and, after a PPO step, the
    policy's and the critic's weights are the padded run's."""
    weights, values = {}, {}
    for padding_free in (False, True):
        cfg = tiny_config(
            tiny_model_dir,
            tmp_path / str(padding_free),
            "optim.max_steps=2",
            "checkpoint.save_every=0",
            "optim.micro_batch_size=16",
            "algorithm.advantage_estimator=gae",
            "ppo.critic_learning_rate=1e-3",
            "optim.adam_epsilon=1e-4",  # as above: float noise must not flip Adam's first sign steps
            f"model.padding_free={str(padding_free).lower()}",
        )
        torch.manual_seed(0)
        trainer = Trainer(cfg)
        assert trainer.critic is not None and trainer.critic.model.padding_free is padding_free
        trainer.train()
        tokens = pack_sequences(PROMPTS, COMPS, pad_id=0)
        values[padding_free] = trainer.critic.values(tokens)
        modules = {"policy": trainer.model, "critic": trainer.critic.model}
        weights[padding_free] = {
            f"{k}.{n}": p.detach().clone() for k, m in modules.items() for n, p in m.named_parameters()
        }
    mask = pack_sequences(PROMPTS, COMPS, pad_id=0).completion_mask.bool()
    assert values[False][mask].abs().max() > 0  # the head has learned something after two steps
    torch.testing.assert_close(values[True][mask], values[False][mask], rtol=1e-5, atol=1e-6)
    for name, w in weights[False].items():
        torch.testing.assert_close(weights[True][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_refused_where_attention_crosses_sequences(tiny_model_dir):
    torch.manual_seed(0)  # ALiBi and no position ids: the second sequence attends to the first
    bloom = BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(
        ValueError, match=r"^model\.padding_free=true: BloomForCausalLM .* see the ones before"
    ):
        check_padding_free(bloom)
    llama = model_of(tiny_model_dir)
    check_padding_free(llama)  # sdpa: accepted
    llama.config._attn_implementation = "paged|sdpa"  # continuous batching's: no packed-sequence masks
    with pytest.raises(
        ValueError, match=r"^model\.padding_free=true: packed sequences .* this model runs 'paged\|sdpa'"
    ):
        check_padding_free(llama)


def test_auto_is_on_where_exact_and_padded_with_one_line_where_not(tiny_model_dir):
    from grpokit.policy.padding_free import resolve_padding_free

    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=4))
    llama = model_of(tiny_model_dir)
    assert resolve_padding_free(llama, "auto") == (True, None)
    assert resolve_padding_free(bloom, False) == (False, None)  # false: not even checked
    on, line = resolve_padding_free(bloom, "auto")
    assert not on and line.count("\n") == 0
    assert line.startswith(
        "model.padding_free=auto: padded rows, since BloomForCausalLM (eager) lets a packed"
    )
    with pytest.raises(
        ValueError, match=r"^distributed.sequence_parallel=2 needs padding-free rows, but Bloom"
    ):
        resolve_padding_free(bloom, "auto", required="distributed.sequence_parallel=2")
    with pytest.raises(ValueError, match=r"^model\.padding_free=true: BloomForCausalLM"):
        resolve_padding_free(bloom, True)


def test_sft_padding_free_gives_the_padded_loss_gradient_and_run(tiny_model_dir):
    """SFT's pairs back to back in one row: the padded batch's loss, token count and gradients; and a few
    steps of train_sft end on the padded run's weights."""
    from grpokit.sft import collate, completion_loss, train_sft

    examples = [(p + c, [-100] * len(p) + c) for p, c in zip(PROMPTS, COMPS, strict=True)]
    packed = collate(examples, 0, packed=True)
    assert packed["input_ids"].shape == (1, 39) and "attention_mask" not in packed  # 39 real tokens
    model = model_of(tiny_model_dir).train()
    out = {}
    for is_packed in (False, True):
        model.zero_grad()
        loss, n = completion_loss(model, collate(examples, 0, packed=is_packed))
        loss.backward()
        out[is_packed] = loss, n, {k: p.grad.clone() for k, p in model.named_parameters()}
    assert out[True][1] == out[False][1] == sum(len(c) for c in COMPS)  # the completion tokens only
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    for name, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], g, rtol=1e-4, atol=1e-7, msg=name)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(6) for b in range(4)]
    weights, stats = {}, {}
    for is_packed in (False, True):
        torch.manual_seed(0)
        m = model_of(tiny_model_dir).train()
        stats[is_packed] = train_sft(
            m, tok, pairs, max_steps=3, batch_size=8, learning_rate=1e-3, padding_free=is_packed
        )
        weights[is_packed] = {k: p.detach().clone() for k, p in m.named_parameters()}
    assert stats[True]["first_loss"] == pytest.approx(stats[False]["first_loss"], rel=1e-6)
    assert stats[True]["final_loss"] == pytest.approx(stats[False]["final_loss"], rel=1e-4)
    # SFT's AdamW has eps 1e-8: an element whose gradient is float rounding moves +-lr whichever way the
    # rounding falls, so the weights agree in norm, not to the last element
    for name, w in weights[False].items():
        assert (weights[True][name] - w).norm() <= 1e-3 * w.norm(), name
    assert SFTConfig.model_validate({"model": {"padding_free": True}}).model.padding_free


def test_segment_attention_keeps_no_row_by_row_mask(tiny_model_dir, batch):
    """With grpokit_sdpa a padding-free row runs each sequence alone: autograd keeps no [L, L] tensor (sdpa on
    transformers' block-causal mask keeps one a layer), and the segments are where the positions restart."""
    row = one_row(batch)
    L = row.positions
    assert segments(row.position_ids[0]) == [(0, 14), (14, 29), (29, 35), (35, 39)]
    for attn, kept in (("sdpa", True), (ATTENTION, False)):
        model = model_of(tiny_model_dir, attn).train()
        shapes: list[tuple[int, ...]] = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            completion_logprobs(model, batch, padding_free=True)
        square = [s for s in shapes if len(s) >= 2 and s[-2:] == (L, L)]
        assert bool(square) == kept, (attn, square)
