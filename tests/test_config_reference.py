"""docs/reference/config.md is generated from the config's field docstrings and kept current."""

from pathlib import Path

from grpokit.config import Config, SFTConfig
from grpokit.config.reference import COMMAND, _sections, missing_docstrings, render

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "config.md"


def test_every_config_field_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, (
        f"config fields without a docstring: {', '.join(missing)}; add one under each field in "
        f"grpokit/config/, then run `{COMMAND}`"
    )


def test_checked_in_reference_is_current():
    assert PAGE.is_file(), f"{PAGE.relative_to(ROOT)} is missing; run `{COMMAND}` from the repository root"
    assert PAGE.read_text() == render(), (
        f"{PAGE.relative_to(ROOT)} differs from the config's field docstrings; "
        f"run `{COMMAND}` from the repository root and commit the result"
    )


def test_reference_lists_every_key():
    page = render()
    for schema in (Config, SFTConfig):
        for _section, _model, rows in _sections(schema):
            for key, _field in rows:
                assert f"| `{key}` |" in page, key
    for key in ("algorithm.beta", "model.lora.r", "rewards[].function", "tools.builtin", "sft.epochs"):
        assert f"| `{key}` |" in page, key


def test_cli_writes_the_reference(tmp_path):
    from typer.testing import CliRunner

    from grpokit.cli import app

    out = tmp_path / "config.md"
    result = CliRunner().invoke(app, ["config-reference", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == render()
