"""Every command has help with an example; the documentation (the README and docs/) names every
command and tune flag; the README's first screen holds the two set-up commands; every docs page is in
the site's navigation, and the site builds strictly (a broken link fails)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = README + "".join(page.read_text() for page in PAGES)


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_command_help_has_an_example(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output, name


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_the_docs_name_every_command(name):
    assert f"offload-tuner {name}" in DOCS or f"tuner {name}" in DOCS, name


def test_the_docs_document_the_tune_flags():
    tune = cli.commands["tune"]
    for param in tune.params:
        for flag in param.opts:
            if flag.startswith("--") and flag not in ("--help",):
                if flag in ("--n-prompt", "--n-gen", "--repetitions", "--trial-timeout", "--seed", "--demo"):
                    continue  # documented in --help; the docs show the main ones
                assert flag in DOCS, flag


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
    assert re.search(r"CMAKE_ARGS=.*-DGGML_RPC=on", ci)
    assert "mkdocs build --strict" in ci


def test_the_readme_first_screen_holds_the_two_set_up_commands():
    first_screen = "\n".join(README.splitlines()[:40])
    assert "CMAKE_ARGS=\"-DGGML_RPC=on\" python -m pip install --no-cache-dir -e '.[test]' && python -m tuner tune --demo" in first_screen
    assert "\npython -m pytest -q\n" in first_screen
    assert len(README.splitlines()) <= 60  # a front door; the reference is in docs/


def test_every_docs_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, re.MULTILINE))
    assert listed == {page.name for page in PAGES}


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "doctor" / "index.html").is_file()


def _command(words: list[str]):
    """The click command ``offload-tuner WORDS...`` names (a group's subcommand too), and how many words it took."""
    command, used = cli, 0
    while used < len(words) and hasattr(command, "commands") and words[used] in command.commands:
        command, used = command.commands[words[used]], used + 1
    return (command, used) if command is not cli else (None, 0)


def test_every_option_the_docs_show_on_a_command_line_exists():
    """``offload-tuner CMD ... --flag`` in a code line of the docs: the flag is one of CMD's options."""
    bad = []
    for line in DOCS.splitlines():
        for m in re.finditer(r"(?:offload-tuner|python -m tuner) ((?:[\w-]+ ?){1,2})(.*)", line):
            words = m[1].split()
            command, used = _command(words)
            if command is None:
                continue
            rest = " ".join(words[used:]) + " " + m[2]
            rest = re.split(r"\||&&|;|#|`|\)|\$\(", rest)[0]  # this command's own words only
            known = {opt for p in command.params for opt in p.opts} | {"--help", "-h"}
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                if flag not in known:
                    bad.append(f"{' '.join(words[:used])} {flag}: {line.strip()[:100]}")
    assert bad == []
