"""`grpokit report RUN_DIR` (grpokit/records/report.py) rendered in headless Chromium: every plot is drawn and
visible, no console error, nothing fetched from elsewhere; the doctor's findings and the sample completions
are on the page, model output shown as text.

Chromium is Debian's `chromium` package: when it is missing and we are root, the fixture installs it with
apt-get (about a minute); it skips, saying why, only where it cannot, and fails there under CI=true.
Playwright (the test extra) drives it.
"""

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpokit.cli import app
from grpokit.doctor import diagnose
from grpokit.metrics.compute import read_metrics
from grpokit.records.report import REPORT_PLOTS, write_html_report
from grpokit.records.table import append_step, read_table
from grpokit.trainer import Trainer
from tests.helpers import REWARD, require, skip_or_fail, tiny_config

C0 = (31, 119, 180)  # matplotlib's first line color: every plot draws its first metric in it


def _install_chromium() -> str:
    if (found := shutil.which("chromium")) is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        skip_or_fail(
            "the report test needs headless Chromium: `chromium` is not on PATH, and without root and "
            "apt-get it cannot be installed here; run `apt-get install -y chromium` (Debian / Ubuntu)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "chromium"]
    proc = subprocess.run(install, capture_output=True, text=True, env=env)
    if proc.returncode != 0:  # a fresh image has no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
    if (found := shutil.which("chromium")) is None:
        skip_or_fail(
            f"`apt-get install -y chromium` failed (exit {proc.returncode}), so the page cannot be rendered: "
            f"{(proc.stderr or proc.stdout).strip()[-400:]}"
        )
    return found


@pytest.fixture(scope="module")
def browser():
    sync_api = require("playwright.sync_api")  # drives Chromium here
    executable = _install_chromium()
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def open_page(browser, path: Path):
    """The page at `path`, with what went wrong while loading it: console errors, page errors, and any request
    for something other than the file itself (refused, so a page that needs the network shows it)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on(
        "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    url = path.resolve().as_uri()

    def route(r):
        if r.request.url == url:
            r.continue_()
        else:
            problems.append(f"fetched {r.request.url}")
            r.abort()

    page.route("**/*", route)
    page.goto(url, wait_until="load")
    return page, problems


def _c0_pixels(png: bytes) -> int:
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int64)  # [H, W, 3]
    return int((np.abs(pixels - np.array(C0)).sum(-1) < 60).sum())


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory):
    """6 GRPO steps with beta > 0, two reward functions, held-out evaluation and recorded completions:
    a run that logs every metric the report plots."""
    out = tmp_path_factory.mktemp("report") / "run"
    cfg = tiny_config(
        tiny_model_dir,
        out,
        "data.task_train_size=200",
        "data.eval_size=8",
        f"rewards=[{{function: '{REWARD}'}}, {{function: countdown}}]",
        "rollout.num_generations=4",
        "optim.max_steps=6",
        "algorithm.beta=0.04",
        "eval.at_start=true",
        "eval.every=3",
        "eval.k=2",
        "logging.sample_every=2",
        "logging.num_samples=2",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    )
    Trainer(cfg).train()
    return out


@pytest.mark.slow
def test_the_report_of_a_real_run_renders_every_plot(run_dir, browser, tmp_path):
    result = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "page.html")])
    assert result.exit_code == 0, result.output
    page, problems = open_page(browser, tmp_path / "page.html")

    plots = page.locator("figure.plot")
    names = [plots.nth(i).get_attribute("data-plot") for i in range(plots.count())]
    assert names == [spec.name for spec in REPORT_PLOTS]  # this run logs every metric the report draws
    for i, name in enumerate(names):
        figure = plots.nth(i)
        svg = figure.locator("svg")
        assert figure.is_visible() and svg.is_visible(), name
        box = svg.bounding_box()
        assert box["width"] > 200 and box["height"] > 100, (name, box)
        drawn = svg.evaluate("s => s.getBBox().width * s.getBBox().height")
        assert drawn > 0, name
        assert _c0_pixels(figure.screenshot()) > 30, f"{name}: no line of the first metric on screen"
    # several inline SVGs on one page: every id is unique and every url(#id) they use resolves
    broken = page.evaluate("""() => {
        const ids = [...document.querySelectorAll('[id]')].map(e => e.id);
        const dup = ids.filter((id, i) => ids.indexOf(id) !== i);
        const refs = [...document.querySelectorAll('[clip-path], [href], [fill^="url("]')]
            .flatMap(e => [e.getAttribute('clip-path'), e.getAttribute('href'), e.getAttribute('fill')])
            .filter(v => v && (v.startsWith('url(#') || v.startsWith('#')))
            .map(v => v.replace(/^url\\(#/, '').replace(/\\)$/, '').replace(/^#/, ''));
        return {dup, missing: refs.filter(r => !document.getElementById(r))};
    }""")
    assert broken == {"dup": [], "missing": []}, broken

    text = page.inner_text("body")
    assert "Held-out evaluation" in text and "eval/pass@1" in page.inner_text("#summary")
    assert "Doctor" in text
    last = [r for r in read_table(run_dir) if r["step"] == 6]
    samples = page.inner_text("#samples")
    assert "Step 2" in samples and "Step 6" in samples
    assert all(r["completion"].strip() in samples for r in last if r["completion"].strip())
    assert problems == []
    page.close()


def _metrics_rows(n: int) -> list[dict]:
    # every group tied from the start: the doctor's zero_std and no_signal checks fire
    return [
        {
            "step": s,
            "reward/mean": 0.5,
            "reward/std": 0.0,
            "reward/zero_std_frac": 1.0,
            "advantage/abs_mean": 0.0,
            "policy/kl": 0.0,
            "policy/entropy": 1.0,
            "rollout/completion_len_mean": 10.0,
        }
        for s in range(1, n + 1)
    ]


@pytest.mark.slow
def test_the_report_shows_the_doctors_findings_and_model_output_as_text(browser, tmp_path):
    rows = _metrics_rows(40)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    append_step(
        tmp_path,
        40,
        [
            {
                "prompt": "2+2=",
                "completion": "<b>bold</b> <script>console.error('x')</script>",
                "group": 0,
                "reward": 0.5,
                "reward/format": None,
                "advantage": 0.0,
            }
        ],
    )
    findings = diagnose(read_metrics(tmp_path / "metrics.jsonl"))
    assert {"zero_std", "no_signal"} <= {f.check for f in findings}

    page, problems = open_page(browser, write_html_report(tmp_path))
    doctor = page.inner_text("#doctor")
    for f in findings:
        assert f.check in doctor and f"{f.steps[0]}-{f.steps[1]}" in doctor
    assert "<b>bold</b> <script>" in page.inner_text("#samples")  # shown as text ...
    assert page.locator("#samples b, #samples script").count() == 0  # ... never run as HTML
    # only the plots whose metrics were logged are drawn; the page says which were not
    names = page.locator("figure.plot").evaluate_all("fs => fs.map(f => f.dataset.plot)")
    assert names == ["reward", "kl", "entropy", "lengths", "zero_std"]
    assert "Not logged by this run" in page.inner_text(
        "#plots"
    ) and "perf/rollout_tokens_per_s" in page.inner_text("#plots")
    assert problems == []
    page.close()


def test_a_run_without_recorded_completions_says_how_to_record_them(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n")
    page = write_html_report(tmp_path).read_text()
    assert "logging.sample_every" in page
    assert "<script" not in page and "<link" not in page and " src=" not in page  # nothing to fetch or run
