"""The documentation holds together: the README stays short, docs/index.md lists every page, links resolve."""

import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "benchmarks" / "README.md"]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it to 200 and move details to docs/"


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    linked = {(DOCS / target.split("#")[0]).resolve() for target in LINK.findall(index)}
    missing = [
        str(p.relative_to(ROOT))
        for p in DOCS.rglob("*.md")
        if p.name != "index.md" and p.resolve() not in linked
    ]
    assert not missing, f"docs/index.md does not link {', '.join(missing)}"


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            file = page.parent / path if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "broken links: " + "; ".join(broken)


def test_readme_config_is_valid(tmp_path):
    from grpokit.config import load_config

    block = re.search(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert block, "the README shows a config"
    (tmp_path / "config.yaml").write_text(block.group(1))
    cfg = load_config(tmp_path / "config.yaml")
    assert cfg.rewards and cfg.data.train_path


def _python_blocks(page: Path, section: str) -> list[str]:
    """The ```python blocks of one `## section` of a page, in order."""
    body = page.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_extending_a_loss_runs_as_written(monkeypatch):
    """docs/extending.md's "A loss" code, as written: the reduction and the objective it registers (its own
    asserts check the objective's worked numbers), then the reduction's worked numbers."""
    from grpokit.algo import losses, policy_loss

    for table in ("AGGREGATIONS", "SURROGATES", "SURROGATE_OF"):  # the entries it adds end with the test
        monkeypatch.setattr(losses, table, dict(getattr(losses, table)))
    blocks = _python_blocks(DOCS / "extending.md", "A loss")
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(block, namespace)
    assert namespace["loss"].item() == pytest.approx(-0.5, abs=1e-12)
    # seq_sum: lengths 1 and 3 on-policy (ratio 1), A = [2, 1]: -(2 * 1 + 1 * 3) / 2 sequences = -2.5.
    logp = torch.full((2, 3), math.log(0.5), dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, _ = policy_loss(logp, logp, torch.tensor([2.0, 1.0]), mask, loss_type="seq_sum")
    assert loss.item() == pytest.approx(-2.5, abs=1e-12)
