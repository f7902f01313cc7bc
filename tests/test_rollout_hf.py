"""The hf engine samples from the distribution the trainer scores, and handles greedy groups."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpokit.rollout.base import SamplingParams
from grpokit.rollout.hf import HFEngine


class CharTok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def uniform_model(vocab=200):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.zero_()  # every next token equally likely
    return m


def test_top_k_zero_means_no_top_k():
    # transformers' default top_k=50 must not sneak in: 400 uniform draws over 200 tokens hit ~175 of them.
    torch.manual_seed(0)
    comps = HFEngine(uniform_model(), CharTok()).generate([[2, 3]], 400, SamplingParams(max_tokens=1))
    assert len({t[0] for t in comps.token_ids}) > 100


def test_greedy_with_several_samples_and_prompt_major_order():
    comps = HFEngine(uniform_model(), CharTok()).generate(
        [[2, 3], [4]], 3, SamplingParams(max_tokens=2, greedy=True)
    )
    assert len(comps) == 6 and comps.finish_reasons == ["length"] * 6
    assert comps.token_ids[0] == comps.token_ids[1] == comps.token_ids[2]
