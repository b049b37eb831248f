"""The docs against the real command line: every `traceml <command> --option` they show exists, the README stays short."""
import argparse
import re
import shlex
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from traceml.cli import _parser

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# Where a command may start on a line of code: its start, or after a shell separator.
SEPARATORS = {"&&", "||", "|", ";", "$", "#", "or:", "e.g.", "then"}


def subcommands() -> Dict[str, argparse.ArgumentParser]:
    """The real parser's commands, by name (the internal `_collect` left out)."""
    parser = _parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub for name, sub in action.choices.items() if not name.startswith("_")}


def code_of(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, code): each line of a fenced block (a line ending in a backslash joined to
    the next) and each inline code span of the prose."""
    in_block, pending, pending_line = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
            continue
        if in_block:
            if not pending:
                pending_line = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            yield pending_line, pending + line
            pending = ""
        else:
            for match in INLINE_CODE.finditer(line):
                yield number, match.group(2)


def _tokens(code: str) -> List[str]:
    try:
        return shlex.split(code)
    except ValueError:  # an apostrophe in a comment, an unbalanced quote: plain words will do
        return code.split()


def commands_in(code: str) -> Iterator[List[str]]:
    """Each `traceml ...` command line in a piece of code, as tokens after `traceml`."""
    tokens = _tokens(code)
    for at, token in enumerate(tokens):
        if token.strip("'\"") not in ("traceml", "traceml.cli"):
            continue
        before = tokens[at - 1] if at else None
        if before is not None and before not in SEPARATORS and before != "-m":
            continue  # `import traceml`, `pip install traceml`: not the command
        rest = []
        for word in tokens[at + 1:]:
            if word in SEPARATORS or word.startswith("#"):
                break
            rest.append(word.strip("'\""))
        if rest and re.fullmatch(r"[a-z_][a-z_-]*", rest[0]):
            yield rest


def check_command(words: List[str], commands: Dict[str, argparse.ArgumentParser]) -> List[str]:
    """What is wrong with one command as the docs show it: an unknown command, or an option its
    real parser does not take. Options after `run`'s script are the script's own."""
    name, words = words[0], words[1:]
    if name not in commands:
        return [f"no such command: traceml {name}"]
    parser, problems = commands[name], []
    options = {flag: action for action in parser._actions for flag in action.option_strings}
    at = 0
    while at < len(words):
        word = words[at].lstrip("[(").rstrip("]),.:;`")
        at += 1
        if word.startswith("--"):
            flag, has_value = word.split("=", 1)[0], "=" in word
            action = options.get(flag)
            if action is None:
                problems.append(f"traceml {name} has no option {flag}")
            elif action.nargs != 0 and not has_value:
                at += 1  # its value
        elif word.startswith("-") and len(word) > 1:
            if word not in options:
                problems.append(f"traceml {name} has no option {word}")
        elif name == "run" and word not in ("...", "|"):
            break  # the script: what follows is its own arguments
    return problems


def problems_in(paths: List[Path]) -> List[str]:
    commands, problems = subcommands(), []
    for path in paths:
        for number, code in code_of(path.read_text()):
            for words in commands_in(code):
                problems += [f"{path.name}:{number}: {problem}" for problem in check_command(words, commands)]
    return problems


def doc_files() -> List[Path]:
    return [README, *sorted(DOCS.glob("**/*.md"))]


def test_every_command_and_option_in_the_docs_is_the_real_clis():
    files = doc_files()
    assert len(files) > 5, "the docs pages are missing"
    checked = sum(1 for path in files for _, code in code_of(path.read_text()) for _ in commands_in(code))
    assert checked >= 30, f"only {checked} traceml commands found in the docs: is the parser reading them?"
    assert problems_in(files) == []


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.glob("**/*.md")}
    named = set(re.findall(r":\s*([\w/-]+\.md)\s*$", nav, re.MULTILINE))
    assert pages == named, (pages - named, named - pages)


@pytest.mark.parametrize("planted, expected", [
    ("traceml run --no-such-option train.py", "traceml run has no option --no-such-option"),
    ("`traceml export RUN --format csv --stepz 1:2`", "traceml export has no option --stepz"),
    ("traceml frobnicate RUN", "no such command: traceml frobnicate"),
    ("pip install x && traceml view RUN --deep", "traceml view has no option --deep"),
    ("traceml run --nproc-per-node 2 \\\n    --master-prot 29500 train.py", "traceml run has no option --master-prot"),
])
def test_the_checker_finds_a_planted_mistake(tmp_path, planted, expected):
    page = (DOCS / "cli.md").read_text()
    copy = tmp_path / "cli.md"
    inline = planted.startswith("`")
    copy.write_text(page + ("\n" + planted + "\n" if inline else f"\n```bash\n{planted}\n```\n"))
    assert problems_in([DOCS / "cli.md"]) == []
    problems = problems_in([copy])
    assert len(problems) == 1 and problems[0].endswith(expected), problems


def test_the_checker_leaves_the_scripts_own_options_alone():
    commands = subcommands()
    assert check_command(["run", "--mode", "summary", "train.py", "--steps", "40", "--deep"], commands) == []
    assert check_command(["run", "--deep", "--port", "0", "train.py", "--bogus"], commands) == []
    assert check_command(["run", "--bogus", "train.py"], commands) == ["traceml run has no option --bogus"]
