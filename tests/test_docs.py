"""Every command has help with an example, and the README names every command and tune flag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_command_help_has_an_example(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output, name


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_readme_names_every_command(name):
    assert f"offload-tuner {name}" in README or f"tuner {name}" in README, name


def test_readme_documents_the_tune_flags():
    tune = cli.commands["tune"]
    for param in tune.params:
        for flag in param.opts:
            if flag.startswith("--") and flag not in ("--help",):
                if flag in ("--n-prompt", "--n-gen", "--repetitions", "--trial-timeout", "--seed", "--demo"):
                    continue  # documented in --help; the README shows the main ones
                assert flag in README, flag


def test_readme_test_command_is_what_ci_runs():
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
    assert re.search(r"CMAKE_ARGS=.*-DGGML_RPC=on", ci)
