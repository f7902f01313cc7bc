"""The documentation holds together: the README stays short, docs/index.md lists every page, links resolve."""

import re
from pathlib import Path

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
