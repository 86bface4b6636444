"""The README and docs/*.md as a whole: their command lines parse, the command-line page names
every option of every command, their links lead somewhere, and the README introduces every page.
(The examples themselves are run by tests/cli/test_readme.py and the tests it names.)"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys

import pytest

from forge.cli.parser import build_parser, split_torchrun_args
from tests import docs
from tests.helpers import REPO, run_forge


def shown_command_lines() -> list[tuple[str, str]]:
    """(page, line) for every forge command a page shows: the lines of its ```bash blocks that
    run forge (continuations joined), and the `$ forge ...` lines of any block."""
    found = []
    for page, text in docs.PAGES.items():
        for lang, body in docs.fenced_blocks(text):
            joined = re.sub(r"\\\n\s*", " ", body)
            for line in joined.splitlines():
                line = line.strip()
                if line.startswith("$ forge "):
                    found.append((page, line[2:]))
                elif lang == "bash" and line.startswith("forge "):
                    found.append((page, line))
                elif lang == "bash" and " -m forge.cli " in line:
                    found.append((page, "forge " + line.split(" -m forge.cli ", 1)[1]))
    return found


def test_every_forge_command_the_pages_show_parses(capsys):
    lines = shown_command_lines()
    assert len(lines) > 40  # the pages show many; a broken look-up would find none
    refused = []
    for page, line in lines:
        words = [w for w in shlex.split(line, comments=True)[1:] if w != "&"]
        argv, _torchrun = split_torchrun_args(words)
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            refused.append(f"{page}: {line}\n    {capsys.readouterr().err.strip()}")
    assert not refused, "\n".join(refused)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for name, p in action.choices.items() if not name.startswith("_")}


def test_the_command_line_page_names_every_option_of_every_command():
    """docs/cli.md's synopsis has a line for each command with each of its options (either
    spelling), and names no option the command lacks; each command has its own section."""
    page = docs.PAGES["docs/cli.md"]
    synopsis = docs.fenced_blocks(page)[0][1]
    lines = {line.split()[1]: line for line in synopsis.splitlines() if line.startswith("forge ")}
    commands = subcommands()
    assert set(lines) == set(commands)
    for name, parser in commands.items():
        assert re.search(rf"^### forge {re.escape(name)}\n", page, re.M), name
        given = set()
        for action in parser._actions:
            spellings = set(action.option_strings) - {"-h", "--help", "-v", "--verbose"}
            if spellings:
                given |= spellings
                shown = [s for s in spellings if re.search(rf"(?<![\w-]){s}(?![\w-])", lines[name])]
                assert shown, f"docs/cli.md: `forge {name}` shows no {sorted(spellings)}"
        named = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", lines[name]))
        assert named <= given, f"docs/cli.md: `forge {name}` has no {sorted(named - given)}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, fenced = set(), False
    for line in text.splitlines():
        fenced ^= line.lstrip().startswith("```")
        heading = re.match(r"#+ (.*)", line)
        if heading and not fenced:
            found.add(slug(heading.group(1)))
    return found


def test_links_between_pages_lead_to_files_and_headings_that_exist():
    broken = []
    for page, text in docs.PAGES.items():
        here = (REPO / page).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (here / path).resolve() if path else REPO / page
            if not file.exists():
                broken.append(f"{page}: {target}: no file {file}")
            elif anchor and anchor not in anchors(file.read_text()):
                broken.append(f"{page}: {target}: no heading #{anchor} in {path or page}")
    assert not broken, "\n".join(broken)


def test_pages_named_in_the_prose_exist():
    """A page named outside a link (``docs/checkpoints.md``, ``see trainers.md``) exists, next to
    the page that names it or from the repository's root: a moved or never-written page is
    caught here as a broken link is above."""
    missing = []
    for page, text in docs.PAGES.items():
        here = (REPO / page).parent
        for named in set(re.findall(r"(?<![\w./#-])((?:[\w-]+/)*[\w-]+\.md)\b", text)):
            if not ((here / named).exists() or (REPO / named).exists()):
                missing.append(f"{page}: {named}")
    assert not missing, "\n".join(sorted(missing))


def test_the_readme_introduces_and_links_every_page():
    readme = docs.PAGES["README.md"]
    assert "make demo" in readme and "make test" in readme
    for page in docs.PAGES:
        if page != "README.md":
            assert f"]({page})" in readme, f"README.md does not link {page}"


def test_the_template_chain_the_readme_shows_is_what_forge_prints():
    shown = docs.output("forge render train -p projects/tiny_lm --chain")
    result = run_forge("render", "train", "-p", "projects/tiny_lm", "--chain", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown.replace("~/forge", str(REPO))


def reliability_script():
    spec = importlib.util.spec_from_file_location("reliability", REPO / "scripts/reliability.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_records(records, outcome: str) -> None:
    failure = "<failure message='x'/>" if outcome == "failed" else ""
    records.mkdir()
    (records / "junit.xml").write_text(
        "<testsuites><testsuite>"
        "<testcase classname='tests.config.test_sandbox' name='test_a' time='1.5'>"
        f"{failure}</testcase></testsuite></testsuites>"
    )
    run = {
        "started": "2026-01-02T03:04+00:00",
        "commit": "abc1234",
        "command": "pytest",
        "cores": 2,
    }
    (records / "run.json").write_text(json.dumps(run))


def test_make_reliability_rewrites_the_results_and_keeps_the_pages_introduction(tmp_path):
    script = reliability_script()
    assert script.MARKER in (REPO / "docs/RELIABILITY.md").read_text()
    page = tmp_path / "RELIABILITY.md"
    page.write_text("# Reliability\n\nhand-written [text](#x)\n\n" + script.MARKER + "\n\nold\n")
    write_records(tmp_path / "first", "passed")
    assert script.main(["--records", str(tmp_path / "first"), "--output", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Reliability\n\nhand-written [text](#x)\n\n" + script.MARKER + "\n")
    assert "old" not in text and "commit abc1234" in text and "None: all 1 tests passed." in text
    write_records(tmp_path / "second", "failed")
    script.main(["--records", str(tmp_path / "second"), "--output", str(page)])
    again = page.read_text()
    assert again.count(script.MARKER) == 1 and again.startswith(text.split(script.MARKER)[0])
    assert "- FAILED `tests/config/test_sandbox.py::test_a`" in again
    assert "None: all 1 tests passed." not in again


@pytest.mark.parametrize("existing", [None, "# an old page without the marker\n"])
def test_a_page_without_an_introduction_gets_the_default_one(tmp_path, existing):
    script = reliability_script()
    page = tmp_path / "RELIABILITY.md"
    if existing:
        page.write_text(existing)
    write_records(tmp_path / "records", "passed")
    script.main(["--records", str(tmp_path / "records"), "--output", str(page)])
    text = page.read_text()
    assert text.startswith(script.DEFAULT_INTRODUCTION + script.MARKER + "\n")
    assert "an old page" not in text
