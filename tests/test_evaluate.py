"""evaluate(): the held-out metrics on a scripted engine, with worked numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpokit import metrics as M
from grpokit.evaluate import evaluate
from tests.helpers import ScriptedEngine

# prompt id -> (greedy answer, 4 sampled answers); the right answer of every prompt is "7"
SCRIPT = {
    1: (
        "7",
        ["7", "7", "3", "3"],
    ),  # greedy right; 2 of 4 samples right; majority: tie "7"/"3" -> first seen "7"
    2: ("3", ["3", "3", "7", "1"]),  # greedy wrong; 1 of 4 right; majority "3" wrong
    3: ("1", ["1", "2", "5", "1 "]),  # nothing right; "1" and "1 " are one answer for maj@k
}


def answers(prompt, n, sampling):
    greedy, sampled = SCRIPT[prompt[0]]
    return [(text, True) for text in ([greedy] if sampling.greedy else sampled[:n])]


def judge(rows, comps):
    ok = [t.strip() == "7" for t in comps.texts]
    return [float(o) for o in ok], ok, [True] * len(ok)


@pytest.mark.parametrize("batch_size", [1, 2, 64])
def test_evaluate_worked_numbers(batch_size):
    rows = [SimpleNamespace(prompt_ids=[i]) for i in (1, 2, 3)]
    m = evaluate(ScriptedEngine(None, answers), rows, judge, k=4, batch_size=batch_size)
    assert m["eval/pass@1"] == pytest.approx(1 / 3)  # greedy: prompt 1 only
    assert m["eval/pass@4"] == pytest.approx(2 / 3)  # any sample right: prompts 1 and 2
    assert m["eval/maj@4"] == pytest.approx(1 / 3)  # majority right: prompt 1 (tie -> first seen)
    assert m["eval/mean@4"] == pytest.approx(3 / 12)  # 2 + 1 + 0 right samples of 12
    assert m["eval/reward_mean"] == pytest.approx(1 / 3)
    assert m["eval/num_prompts"] == 3.0
    assert m["eval/mean_length"] == pytest.approx(1.0)
    # every key is a name of grpokit.metrics.compute (docs/metrics.md, "eval/")
    assert set(m) == {
        M.EVAL_PASS_AT_1,
        M.EVAL_FORMAT_RATE,
        M.EVAL_REWARD_MEAN,
        M.EVAL_MEAN_LENGTH,
        M.EVAL_NUM_PROMPTS,
        M.eval_pass_at(4),
        M.eval_maj_at(4),
        M.eval_mean_at(4),
        M.EVAL_TIME,
    }


def test_evaluate_k1_has_no_sampled_metrics():
    rows = [SimpleNamespace(prompt_ids=[1])]
    m = evaluate(ScriptedEngine(None, answers), rows, judge, k=1)
    assert m["eval/pass@1"] == 1.0 and not any(key.startswith(("eval/maj", "eval/mean@")) for key in m)


def test_grpokit_eval_needs_only_the_held_out_file(tiny_model_dir, tmp_path):
    """`grpokit eval MODEL -c CONFIG` with data.eval_path and no training data evaluates; with neither, one
    line names what to set."""
    import json

    from typer.testing import CliRunner

    from grpokit.cli import app
    from tests.helpers import REWARD

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(json.dumps({"prompt": f"{a} {a}>{2 * a}="}) + "\n" for a in range(1, 4))
    )  # fewer rows than rollout.prompts_per_step (a training batch): evaluation draws none of them
    common = ["eval", str(tiny_model_dir), f"rewards=[{{function: '{REWARD}'}}]", "eval.k=2"]
    common += ["rollout.max_completion_length=4", f"output_dir={tmp_path / 'out'}"]
    r = CliRunner().invoke(app, [*common, f"data.eval_path={held_out}"])
    assert r.exit_code == 0, r.output
    assert "pass@1" in r.output
    assert f"held-out evaluation of {tiny_model_dir}\n" in r.output  # the path on one line, never wrapped
    r = CliRunner().invoke(app, common)
    assert r.exit_code == 2, r.output
    line = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert line == [
        "error: " + "no held-out data: set data.eval_path (a .jsonl/.parquet/.csv file), data.task, "
        "or data.train_path with data.eval_size"
    ]
