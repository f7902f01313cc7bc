"""Tools (grpokit/tools/) and multi-turn rollouts with tools (grpokit/rollout/episodes.py).

    .venv/bin/python -m pytest tests/test_tools.py -q

Scripted engines play the model where a test needs exact turns; the tiny real Llama (fast and hf engines)
where log-probs and masks must hold for sampled tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from grpokit.algo import policy_loss, token_logprobs
from grpokit.algorithm import make_loss_mask
from grpokit.config import AlgorithmConfig, ConfigError, load_config
from grpokit.data.batch import pack_sequences, process_rewards
from grpokit.policy import completion_logprobs
from grpokit.rewards import RewardManager, RewardSpec, StepScores
from grpokit.rollout import SamplingParams, make_engine
from grpokit.rollout.base import Completions
from grpokit.rollout.episodes import ToolRollout
from grpokit.tasks import reward_registry
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer
from grpokit.tools import (
    ChatTemplateFormat,
    Episode,  # noqa: F401 (loaded by name below: tools.environment={__name__}:Episode)
    PlainFormat,
    ToolBox,
    as_tool,
    calculator,
    check_arguments,
    episode_metrics,
    function_schema,
)
from grpokit.tools.formats import ParsedCall
from grpokit.tools.rewards import step_cost, tool_args_valid, tool_call_valid, tool_result_used
from grpokit.tools.setup import environment_reward_spec, load_tools
from tests.helpers import NO_TASK, ScriptedEngine, tiny_config

CHARS = "0123456789+-*/=()<>_,.:;'\"{}[] abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CHARS)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_llama(tok, size="test", seed=0).eval()


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    A second line of description.

    Args:
        a: the first number
        b (int): the second number,
            which defaults to zero

    Returns:
        The sum.
    """
    return a + b


def test_schema_from_type_hints_and_google_docstring():
    assert function_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers. A second line of description.",
            "parameters": {
                "type": "object",
                "required": ["a"],
                "properties": {
                    "a": {"type": "integer", "description": "the first number"},
                    "b": {"type": "integer", "description": "the second number, which defaults to zero"},
                },
            },
        },
    }

    def untyped(x):
        """No hints."""

    with pytest.raises(ValueError, match="parameter 'x' has no type hint"):
        function_schema(untyped)


def test_arguments_are_checked_against_the_signature():
    schema = function_schema(add)
    assert check_arguments(schema, {"a": 1, "b": 2}) is None
    assert check_arguments(schema, {"a": 1}) is None
    assert "missing required argument(s) ['a']" in check_arguments(schema, {"b": 2})
    assert "unknown argument(s) ['c']" in check_arguments(schema, {"a": 1, "c": 2})
    assert "should be integer" in check_arguments(schema, {"a": "1"})
    assert "should be integer" in check_arguments(schema, {"a": True})  # a bool is not an int in JSON
    assert "must be an object" in check_arguments(schema, [1, 2])


def test_calculator_is_exact_and_evaluates_nothing_else():
    assert calculator("123*456") == "56088"
    assert calculator(" (7 - 10) * 3 ") == "-9"
    assert calculator("7/2") == "3.5"
    assert calculator("8/2") == "4"
    assert calculator("2**100") == str(2**100)
    for bad, why in [
        ("__import__('os')", "only numbers"),
        ("2**100000", "exponent"),
        ("1/0", "division by zero"),
        ("(10**200)**200", "more than 1000 digits"),
        ("9**250*9**250*9**250*9**250*9**250", "more than 1000 digits"),
        ("x+1", "only numbers"),
        ("1+", "not an arithmetic"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculator(bad)


def test_a_failing_call_returns_an_error_text_and_its_kind():
    def boom(x: int) -> int:
        """Always fails."""
        raise RuntimeError("kaput")

    def slow(x: int) -> int:
        """Sleeps."""
        time.sleep(5)
        return x

    async def twice(x: int) -> int:
        """Async double."""
        await asyncio.sleep(0)
        return 2 * x

    async def hang(x: int) -> int:
        """Async forever."""
        await asyncio.sleep(60)
        return x

    box = ToolBox([as_tool(f) for f in (calculator, boom, slow, twice, hang)], timeout=0.2)
    ok = box.call("calculator", {"expression": "6*7"})
    assert (ok.text, ok.error) == ("42", None)
    assert (box.call("twice", {"x": 21}).text, box.call("twice", {"x": 21}).error) == ("42", None)
    cases = [
        (
            "nope",
            {"x": 1},
            "unknown_tool",
            "error: unknown tool 'nope'; tools: calculator, boom, slow, twice, hang",
        ),
        (
            "boom",
            {"y": 1},
            "bad_args",
            "error: bad arguments for boom: unknown argument(s) ['y']; the tool takes ['x']",
        ),
        ("boom", {"x": 1}, "raised", "error: boom raised RuntimeError: kaput"),
        (
            "calculator",
            {"expression": "1/0"},
            "raised",
            "error: calculator raised ValueError: division by zero",
        ),
        ("slow", {"x": 1}, "timeout", "error: slow timed out after 0.2 s"),
        ("hang", {"x": 1}, "timeout", "error: hang timed out after 0.2 s"),
    ]
    for name, args, kind, text in cases:
        out = box.call(name, args)
        assert (out.error, out.text) == (kind, text)


def test_plain_format_parses_calls(tok):
    box = ToolBox([as_tool(calculator), as_tool(add)])
    fmt = PlainFormat()
    text = "think <tool>calculator(12*34)</tool><result>hallucinated</result>"
    cut, raws = fmt.split_turn(text)
    assert (text[:cut], raws) == ("think <tool>calculator(12*34)</tool>", ["calculator(12*34)"])
    assert fmt.split_turn("no call <tool>calculator(1") == (None, [])
    parsed = {
        raw: fmt.parse(raw, box)
        for raw in [
            "calculator(12*34)",
            "calculator('1+2')",
            "add(1, 2)",
            "add(a=3)",
            "add(1, 2, 3)",
            "add(x)",
            "nope(1)",
            "calculator",
        ]
    }
    assert parsed["calculator(12*34)"].arguments == {"expression": "12*34"}
    assert parsed["calculator('1+2')"].arguments == {"expression": "1+2"}
    assert parsed["add(1, 2)"].arguments == {"a": 1, "b": 2}
    assert parsed["add(a=3)"].arguments == {"a": 3}
    assert parsed["add(1, 2, 3)"].problem == "add takes 2 argument(s), got 3"
    assert parsed["add(x)"].problem.startswith("arguments must be Python literals")
    assert (
        parsed["nope(1)"].name == "nope" and parsed["nope(1)"].problem is None
    )  # reported as an unknown tool
    assert parsed["calculator"].name is None and parsed["calculator"].problem.startswith(
        "expected name(arguments)"
    )
    assert tok.decode(fmt.render_results([("calculator", "408")], tok)) == "<result>408</result>"


QWEN_LIKE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content "
    "}}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif "
    "%}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_format_renders_tool_messages_with_the_template():
    tok = build_tokenizer(
        CHARS + "|\n",
        special_tokens={"pad_token": "<pad>", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"},
        add_bos=False,
    )
    tok.chat_template = QWEN_LIKE
    fmt = ChatTemplateFormat()
    ids = fmt.render_results([("calculator", "408")], tok)
    # after the model's own <|im_end|>: the rest of the template up to the next assistant turn
    assert (
        tok.decode(ids)
        == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    box = ToolBox([as_tool(calculator)])
    turn = (
        'ok <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    )
    cut, raws = fmt.split_turn(turn)
    assert cut is None and [fmt.parse(r, box).arguments for r in raws] == [
        {"expression": "2*3"},
        {"expression": "1"},
    ]
    assert fmt.parse("{not json}", box).problem.startswith('expected {"name"')
    tok.chat_template = None
    with pytest.raises(ValueError, match="tools.format=chat_template needs a tokenizer with a chat template"):
        fmt.render_results([("calculator", "1")], tok)


class Scripted(ScriptedEngine):
    """Plays the model: turn k of every episode is texts[k] (then EOS unless it ends with a call), log-prob
    -0.5 each."""

    def __init__(self, tok, texts, eos=True):
        self.tok, self.texts, self.k, self.eos = tok, texts, 0, eos
        self.eos_ids = {tok.eos_token_id}
        self.calls = []

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n, sampling.max_tokens))
        text = self.texts[min(self.k, len(self.texts) - 1)]
        self.k += 1
        one = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if self.eos else [])
        ids = [one[: sampling.max_tokens] for _ in range(len(prompts) * n)]
        return Completions(
            ids,
            self.tok.batch_decode(ids, skip_special_tokens=True),
            ["stop"] * len(ids),
            [[-0.5] * len(i) for i in ids],
        )


def test_an_episode_interleaves_model_turns_and_tool_results(tok):
    engine = Scripted(tok, ["<tool>calculator(12*34)</tool>junk after the call", "=408"])
    rollout = ToolRollout(engine, tok, [as_tool(calculator)], fmt=PlainFormat(), max_turns=4)
    comps = rollout.generate([tok.encode("12*34")], 2, SamplingParams(max_tokens=64))
    call, result, answer = "<tool>calculator(12*34)</tool>", "<result>408</result>", "=408"
    assert comps.texts == [call + result + answer] * 2
    assert comps.model_mask[0] == [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)  # + EOS
    assert comps.logprobs[0] == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * (len(answer) + 1)
    assert comps.finish_reasons == ["stop", "stop"]
    assert engine.calls == [
        (1, 2, 64),
        (2, 1, 64 - len(call + result)),
    ]  # turn 1: n=G of the prompt; then each episode
    ep = comps.episodes[0]
    assert (ep.turns, ep.cut, ep.final) == (2, None, "=408")
    assert [(c.name, c.arguments, c.result, c.error, c.end) for c in ep.tool_calls] == [
        ("calculator", {"expression": "12*34"}, "408", None, len(call))
    ]
    assert ep.messages == [
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": "=408"},
    ]
    m = rollout.last_metrics
    assert (
        m["rollout/tools/calls_per_episode"],
        m["rollout/tools/turns"],
        m["rollout/tools/valid_call_rate"],
    ) == (1.0, 2.0, 1.0)


def test_errors_go_back_to_the_model_and_episodes_stop_at_max_turns_or_the_budget(tok):
    bad = "<tool>calc(1)</tool>"
    engine = Scripted(tok, [bad])
    comps = ToolRollout(engine, tok, [as_tool(calculator)], fmt=PlainFormat(), max_turns=3).generate(
        [tok.encode("1")], 1, SamplingParams(max_tokens=200)
    )
    error = "<result>error: unknown tool 'calc'; tools: calculator</result>"
    assert comps.texts == [bad + error + bad + error + bad]  # the third call, at max_turns, is not run
    ep = comps.episodes[0]
    assert (ep.turns, ep.cut, [c.error for c in ep.tool_calls]) == (3, "max_turns", ["unknown_tool"] * 3)
    assert episode_metrics([ep])["rollout/tools/errors"] == 3.0 and comps.finish_reasons == ["stop"]

    # budget 30: the call (20 tokens) fits, its result (19) would leave no room: cut before it, finish
    # "length"
    comps = ToolRollout(
        Scripted(tok, ["<tool>calculator(1)</tool>"]),
        tok,
        [as_tool(calculator)],
        fmt=PlainFormat(),
        max_turns=3,
    ).generate([tok.encode("1")], 1, SamplingParams(max_tokens=30))
    assert comps.texts == ["<tool>calculator(1)</tool>"] and comps.finish_reasons == ["length"]
    assert comps.episodes[0].cut == "budget" and comps.model_mask == [[1] * 26]
    # a turn that runs out of tokens without a call or EOS
    comps = ToolRollout(
        Scripted(tok, ["no end in sight"], eos=False),
        tok,
        [as_tool(calculator)],
        fmt=PlainFormat(),
        max_turns=3,
    ).generate([tok.encode("1")], 1, SamplingParams(max_tokens=5))
    assert (
        comps.texts == ["no en"] and comps.finish_reasons == ["length"] and comps.episodes[0].cut == "budget"
    )


def _episode(tok, texts, max_tokens=64):
    return ToolRollout(
        Scripted(tok, texts), tok, [as_tool(calculator)], fmt=PlainFormat(), max_turns=4
    ).generate([tok.encode("12*34")], 1, SamplingParams(max_tokens=max_tokens))


def test_tool_result_tokens_get_exactly_zero_gradient_and_are_never_counted(tok, model):
    """Worked numbers: row 0 = 30 model tokens (call), 20 tool tokens (result), 5 model tokens (=408 + EOS);
    row 1 has no call (6 model tokens). dapo (token mean) with pi_theta = pi_old: d loss / d logp_t = -A_i /
    (30 + 5 +
    6) on model tokens, exactly 0 on tool tokens; the normalizer counts 41 tokens, not 61."""
    with_call = _episode(tok, ["<tool>calculator(12*34)</tool>", "=408"])
    without = _episode(tok, ["=9999"])
    ids = with_call.token_ids + without.token_ids
    tokens = pack_sequences([tok.encode("12*34")] * 2, ids, tok.pad_token_id)
    mask = make_loss_mask(
        AlgorithmConfig(),
        tokens.completion_mask,
        torch.tensor([False, False]),
        with_call.model_mask + without.model_mask,
    )
    assert mask.sum(1).tolist() == [35, 6] and tokens.completion_mask.sum(1).tolist() == [55, 6]
    P = tokens.input_ids.shape[1] - tokens.completion_width
    logits = model(
        input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, position_ids=tokens.position_ids
    ).logits
    logits.retain_grad()
    logp = token_logprobs(logits[:, P - 1 : -1], tokens.completion_ids)  # [2, T]
    logp.retain_grad()
    A = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(logp, logp.detach(), A, mask, loss_type="dapo", num_tokens=mask.sum().item())
    loss.backward()
    tool = tokens.completion_mask.bool() & ~mask.bool()  # [2, T]
    assert tool.sum().item() == 20
    assert torch.equal(logp.grad[tool], torch.zeros(20))
    assert torch.equal(
        logits.grad[:, P - 1 : -1][tool], torch.zeros(20, logits.shape[-1])
    )  # logits at tool positions
    torch.testing.assert_close(logp.grad[0][mask[0].bool()], torch.full((35,), -1.0 / 41))
    torch.testing.assert_close(logp.grad[1][mask[1].bool()], torch.full((6,), 1.0 / 41))
    assert (logits.grad[:, P - 1 : -1][mask.bool()].abs().sum(-1) > 0).all()
    # grpo (per-sequence mean): row 0 divides by its 35 model tokens, not its 55 tokens
    logp2 = logp.detach().requires_grad_()
    policy_loss(logp2, logp2.detach(), A, mask, loss_type="grpo")[0].backward()
    torch.testing.assert_close(logp2.grad[0][mask[0].bool()], torch.full((35,), -1.0 / (2 * 35)))
    assert torch.equal(logp2.grad[tool], torch.zeros(20))


class MarkerFormat(PlainFormat):
    """Calls that a random tiny model writes by chance: anything between '*' and '=', to the tool `size`."""

    def __init__(self):
        super().__init__("*", "=", "{", "}")

    def parse(self, raw, box):
        return ParsedCall(raw, "size", {"x": raw})


def size(x: str) -> str:
    """The length of x, in digits.

    Args:
        x: any text
    """
    return str(len(x))


@pytest.mark.parametrize("engine_name", ["fast", "hf"])
def test_sampled_episodes_score_like_one_pass_on_the_whole_sequence(engine_name):
    tok = build_tokenizer("0123456789+*=ab{}")  # a small alphabet: a random model writes '*...=' often
    model = build_tiny_llama(tok, size="test", seed=0).eval()
    torch.manual_seed(0)
    rollout = ToolRollout(
        make_engine(engine_name, model, tok), tok, [as_tool(size)], fmt=MarkerFormat(), max_turns=4
    )
    prompts = [tok.encode(p) for p in ("12*34=", "7+8=", "1", "99", "3*3", "+", "42", "8")]
    comps = rollout.generate(prompts, 8, SamplingParams(max_tokens=48))
    eps = comps.episodes
    assert (
        sum(len(e.tool_calls) for e in eps) >= 4 and max(e.turns for e in eps) >= 2
    )  # multi-turn did happen
    for ids, mask, ep in zip(comps.token_ids, comps.model_mask, eps, strict=True):
        assert len(ids) == len(mask) <= 48
        ran = [c for c in ep.tool_calls if c.error != "not_run"][
            : ep.turns - 1
        ]  # the results that made it into the text
        assert sum(1 - m for m in mask) == sum(len("{" + c.result + "}") for c in ran)
    turns = [m["content"] for ep in eps for m in ep.messages if m["role"] == "assistant"]
    if engine_name == "fast":  # the engine stopped each turn at its first '=' (stop_token_ids)
        assert all("=" not in t[:-1] for t in turns)
    if engine_name == "hf":
        assert comps.logprobs is None
        return
    tokens = pack_sequences([p for p in prompts for _ in range(8)], comps.token_ids, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, tokens)  # one pass over prompt + every turn + every result
    for i, (mask, lps) in enumerate(zip(comps.model_mask, comps.logprobs, strict=True)):
        on = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(logp[i, : len(mask)][on], torch.tensor(lps)[on], atol=2e-5, rtol=0)


def test_process_rewards_on_calls_land_on_each_calls_tokens(tok):
    eps = [
        _episode(tok, ["<tool>calculator(12*34)</tool>", "=408"]),
        _episode(tok, ["<tool>calc(1)</tool>", "<tool>calculator(1, 2)</tool>", "=7"], max_tokens=300),
        _episode(tok, ["=9"]),
    ]
    comps = Completions(
        *[sum((getattr(c, f) for c in eps), []) for f in ("token_ids", "texts", "finish_reasons")]
    )
    episodes = [e.episodes[0] for e in eps]
    assert [[c.error for c in e.tool_calls] for e in episodes] == [[None], ["unknown_tool", "parse"], []]
    v = tool_call_valid(comps.texts, episodes)
    assert v[0] == StepScores([1.0], [30], 1.0) and v[2] is None
    assert v[1].scores == [0.0, 0.0]
    assert tool_args_valid(comps.texts, episodes)[0].scores == [1.0]
    assert tool_result_used(comps.texts, episodes) == [1.0, None, None]
    assert (
        step_cost(comps.texts, episodes, cost=0.25)[1].scores == [-0.25, -0.25]
        and step_cost(comps.texts, episodes)[2] == 0.0
    )
    manager = RewardManager(
        [RewardSpec("tool_call_valid"), RewardSpec("step_cost", kwargs={"cost": 0.5})],
        registry=reward_registry(),
    )
    out = manager(
        prompts=["p"] * 3, completions=comps.texts, completion_ids=comps.token_ids, episodes=episodes
    )
    assert out.per_function["tool_call_valid"][0].item() == 1.0 and out.per_function[
        "step_cost"
    ].tolist() == [-0.5, -1.0, 0.0]
    rewards, ends = process_rewards(out, comps.texts, comps.token_ids, tok)
    # episode 0: +1 (valid) - 0.5 (cost) at the call's last token (29, its '>'); episode 1: two calls, each 0
    # - 0.5
    assert ends[0].tolist() == [29] and rewards[0].tolist() == [0.5]
    second = episodes[1].tool_calls[1].end - 1
    assert ends[1].tolist() == [19, second] and rewards[1].tolist() == [-0.5, -0.5]
    assert ends[2].tolist() == [len(comps.token_ids[2]) - 1] and rewards[2].tolist() == [
        0.0
    ]  # step_cost's 0.0: one step at the end


def test_tool_result_used_compares_the_final_answer_with_the_results(tok):
    texts = ["408", "999", "so it is 408", "408408", "4080", "so 408 or 5"]
    eps = [_episode(tok, ["<tool>calculator(12*34)</tool>", t]).episodes[0] for t in texts]
    # the answer, or its last number, is the result; padding it with junk is not using it
    assert tool_result_used([""] * 6, eps) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


class CounterEnv:
    """A TRL-style environment (the shape of TRL's environment_factory examples): methods are tools."""

    def __init__(self):
        self.count = 0
        self.target = None

    def reset(self, **kwargs):
        self.count = 0
        self.target = int(kwargs["target"]) if "target" in kwargs else None
        return None

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0


def test_a_trl_environment_class_runs_unchanged(tok):
    engine = Scripted(tok, ["<tool>increment(2)</tool>", "<tool>increment(step=5)</tool>", "done"])
    rollout = ToolRollout(
        engine, tok, [as_tool(calculator)], fmt=PlainFormat(), max_turns=4, environment=CounterEnv
    )
    comps = rollout.generate(
        [tok.encode("7"), tok.encode("3")],
        2,
        SamplingParams(max_tokens=200),
        columns=[{"target": 7}, {"target": 3}],
    )
    envs = [e.environment for e in comps.episodes]
    assert len({id(e) for e in envs}) == 4  # one instance per episode
    assert [e.count for e in envs] == [7, 7, 7, 7] and [e.target for e in envs] == [7, 7, 3, 3]
    assert (
        comps.texts[0]
        == "<tool>increment(2)</tool><result>2</result><tool>increment(step=5)</tool><result>7</result>done"
    )
    spec = environment_reward_spec(CounterEnv)
    manager = RewardManager([spec])
    out = manager(
        prompts=["7", "7", "3", "3"],
        completions=comps.texts,
        completion_ids=comps.token_ids,
        episodes=comps.episodes,
    )
    assert out.per_function["CounterEnv"].tolist() == [1.0, 1.0, 0.0, 0.0]
    # as TRL passes them: `environments` to any reward function that asks
    seen = RewardManager(
        [
            RewardSpec(
                lambda completions, environments, **kw: [float(e.count) for e in environments], name="count"
            )
        ]
    )
    assert (
        seen(
            prompts=[""] * 4, completions=comps.texts, completion_ids=comps.token_ids, episodes=comps.episodes
        ).total.tolist()
        == [7.0] * 4
    )


def test_an_environment_with_get_reward_adds_its_reward_to_the_run():
    from grpokit.rewards.build import build_rewards

    cfg = load_config(
        None, [f"tools.environment={__name__}:CounterEnv", "rewards=[{function: tool_call_valid}]"]
    )
    manager = build_rewards(cfg, ["prompt", "target"], registry=reward_registry())
    assert manager.names == ["tool_call_valid", "CounterEnv"] and manager.weights["CounterEnv"] == 1.0


def test_tools_config_is_validated(tmp_path):
    cfg = load_config(
        None,
        [
            "tools.builtin=[calculator, python]",
            "rollout.max_turns=2",
            f"tools.environment={__name__}:CounterEnv",
        ],
    )
    tools, env = load_tools(cfg.tools)
    assert [t.name for t in tools] == ["calculator", "python"] and env is CounterEnv
    for override, message in [
        (
            "tools.builtin=[calc]",
            "bad value for 'tools.builtin.0': 'calc': Input should be 'calculator' or 'python'",
        ),
        (
            "tools.format=json",
            "bad value for 'tools.format': 'json': Input should be 'plain' or 'chat_template'",
        ),
        ("rollout.max_turns=0", "rollout.max_turns"),
    ]:
        with pytest.raises(
            ConfigError,
            match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
        ):
            load_config(None, [override])
    with pytest.raises(
        ConfigError, match="tools.functions='nowhere_module:f': loading 'nowhere_module' failed"
    ):
        load_tools(load_config(None, ["tools.functions=[nowhere_module:f]"]).tools)
    with pytest.raises(ConfigError, match="tools: two tools are named 'calculator'"):
        load_tools(
            load_config(
                None, ["tools.builtin=[calculator]", "tools.functions=[grpokit.tools.builtin:calculator]"]
            ).tools
        )
    with pytest.raises(ConfigError, match="tools.environment: .*needs a reset"):
        load_tools(load_config(None, [f"tools.environment={__name__}:Episode"]).tools)


# -- the python tool under attack: the code_tests hostile programs (tests/test_sandbox.py), sent as tool calls


def _sandbox_tests():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "grpokit_test_sandbox", Path(__file__).parent / "test_sandbox.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: what the python tool answers each hostile program: the sandbox's reason ("ok" for a program that ran to its
#: end)
PYTHON_TOOL_REASONS = {
    "fork_bomb": {"timeout", "cpu_limit"},
    "infinite_loop": {"timeout", "cpu_limit"},
    "memory_bomb": {"memory_limit"},
    "sleep_past_wall": {"timeout"},
    "write_outside": {"error"},
    "delete_files": {"error"},
    "read_secrets": {"ok"},
    "read_home": {"error", "ok"},
    "connect_loopback": {"error"},
    "signal_parent": {"ok", "killed:SIGKILL"},
    "kill_own_group": {"killed:SIGKILL"},
    "memory_by_forking": {"ok", "memory_limit", "timeout", "error"},
    "forge_verdict_from_frames": {"ok", "error"},
    "always_equal": {"ok"},
    "learn_the_verdict": {"ok"},
    "gigabytes_of_output": {"output_limit"},
    "gigabytes_to_disk": {"error", "file_size_limit"},
}


class PerPrompt(Scripted):
    """Turn 1 of prompt i's episodes is texts[i]; then every episode answers 'done'."""

    def generate(self, prompts, n, sampling):
        if self.k == 0:
            self.k += 1
            ids = [
                self.tok.encode(t, add_special_tokens=False)[: sampling.max_tokens]
                for t in self.texts
                for _ in range(n)
            ]
            return Completions(
                ids, self.tok.batch_decode(ids, skip_special_tokens=True), ["stop"] * len(ids), None
            )
        self.texts = ["done"]
        return super().generate(prompts, n, sampling)


def test_hostile_python_tool_calls_are_contained_as_code_tests_programs_are(tmp_path_factory):
    import os
    import socket

    from grpokit.sandbox import Limits, isolation_mode
    from grpokit.tools import make_python_tool

    if isolation_mode() != "namespaces":
        pytest.skip("needs namespaces isolation (root and util-linux unshare); see docs/sandbox.md")
    sb = _sandbox_tests()
    outside = tmp_path_factory.mktemp("outside")
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    os.chmod(outside, 0o777)
    os.chmod(victim, 0o666)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    cases = sb._hostile_cases(str(outside), str(victim), server.getsockname()[1])
    assert set(cases) == set(PYTHON_TOOL_REASONS)
    calls = [f"<tool>python({code!r})</tool>" for code, _, _ in cases.values()]
    tok = build_tokenizer("".join(sorted(set("".join(calls) + CHARS))))
    tool = as_tool(make_python_tool(Limits(**sb.SMALL_KWARGS)), "python")
    rollout = ToolRollout(
        PerPrompt(tok, calls),
        tok,
        [tool],
        fmt=PlainFormat(),
        max_turns=2,
        timeout=60.0,
        max_result_chars=300,
        max_workers=4,
    )
    dirs_before = sb.sandbox_dirs()
    os.environ["GRPOKIT_TEST_SECRET"] = sb.SECRET
    try:
        comps = rollout.generate([tok.encode(name) for name in cases], 1, SamplingParams(max_tokens=100000))
    finally:
        del os.environ["GRPOKIT_TEST_SECRET"]
    connected = sb.accepted_a_connection(server)
    for name, ep in zip(cases, comps.episodes, strict=True):
        (call,) = ep.tool_calls
        assert call.name == "python" and call.arguments == {"code": cases[name][0]}
        reason = (
            "ok"
            if call.error is None
            else call.result.removeprefix("error: python raised RuntimeError: ").split(";")[0]
        )
        assert call.error in (None, "raised") and reason in PYTHON_TOOL_REASONS[name], (name, call.result)
        assert ep.final == "done"  # the episode went on after the attack
    results = {name: ep.tool_calls[0].result for name, ep in zip(cases, comps.episodes, strict=True)}
    assert any(w in results["write_outside"] for w in ("FileNotFoundError", "PermissionError"))
    assert "ENETUNREACH" in results["connect_loopback"] or "unreachable" in results["connect_loopback"]
    home = os.path.expanduser("~")  # read_home, printing what it found: not the host's home
    seen = ToolBox([tool], timeout=60.0).call(
        "python", {"code": cases["read_home"][0] + "\nprint(sorted(entries))"}
    )
    assert seen.error == "raised" or seen.text.strip() != str(sorted(os.listdir(home))), seen
    # contained exactly as test_sandbox.py::test_hostile_programs_changed_nothing_outside checks it
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert not connected, "a sandboxed program reached the loopback server"
    assert all(sb.SECRET not in text for text in comps.texts)
    assert sb.sandbox_dirs() <= dirs_before
    assert sb.sandbox_processes() == []
    os.kill(os.getpid(), 0)


# -- end to end: the trainer with tools learns what the episode's reward pays for ----------------------------


def made_a_call(completions, episodes, **kwargs):
    """1.0 for an episode with at least one tool call, else 0.0."""
    return [float(bool(ep.tool_calls)) for ep in episodes]


class Recording(ToolRollout):
    def generate(self, *args, **kwargs):
        self.last = super().generate(*args, **kwargs)
        return self.last


@pytest.mark.slow
def test_grpo_with_tools_learns_to_call_and_trains_only_on_model_tokens(tmp_path):
    from grpokit.rewards import RewardSpec
    from grpokit.trainer import Trainer

    tok = build_tokenizer("0123456789+*=ab{}")
    build_tiny_llama(tok, size="test", seed=0).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    cfg = tiny_config(
        tmp_path / "model",
        tmp_path / "run",
        *NO_TASK,
        "rewards=[]",  # set below
        "tools.builtin=[calculator]",
        "rollout.max_turns=3",
        "rollout.engine=fast",
        "rollout.max_completion_length=32",
        "optim.max_steps=24",
        "checkpoint.save_every=0",
    )
    cfg.rewards = [RewardSpec(made_a_call)]
    rows = [{"prompt": f"{i}*{j}"} for i in range(10) for j in range(10)]
    trainer = Trainer(cfg, train_rows=rows)
    assert isinstance(trainer.pipeline.engine, ToolRollout)
    trainer.pipeline.engine = Recording(
        trainer.pipeline.engine.engine, trainer.tokenizer, [as_tool(size)], fmt=MarkerFormat(), max_turns=3
    )
    batch, metrics, _ = trainer.rollout([trainer.train_data[i] for i in range(4)])
    model_tokens = sum(sum(m) for m in trainer.pipeline.engine.last.model_mask)
    assert (
        batch.loss_mask.sum().item() == model_tokens < batch.tokens.completion_mask.sum().item()
    )  # tool tokens: no loss
    assert metrics["rollout/tools/calls_per_episode"] > 0
    trainer.train()
    calls = [
        json.loads(line)["rollout/tools/episodes_with_calls"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(calls) == 24
    first, last = sum(calls[:6]) / 6, sum(calls[-6:]) / 6
    assert last > first + 0.2, (first, last)
