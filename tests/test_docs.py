"""The docs are true (issue 47, items 4 and 6 and their siblings): every fenced block of README.md, docs/*.md and
deploy/README.md says what it is (tests/docblocks.py: run, config, output, figure, or skip: with the reason), every
`run` block runs here (python with .venv's interpreter, shell in an empty directory with `pled` on PATH, against a
real `pled serve` where the block asks for one), every `config` block is a config pled accepts, every `pled`
command and option the docs name (in blocks and in prose) exists in pled's own argument parser, every command's
--help gives each option a line and its default, the README's table of commands lists every command and option, and
the links between the docs lead to a file and heading that exist."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import docblocks
from docblocks import MARKERS, Block
from harness import LAYOUTS, clean_env, start
from pled.cli import parser as pled_parser
from pled.generator import make_sidecar

ROOT = docblocks.ROOT
BLOCKS = docblocks.all_blocks()


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in pled_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


# -- every block says what it is ----------------------------------------------------------------------------------

def test_every_block_in_the_docs_says_whether_it_runs_and_why_not():
    assert len(BLOCKS) >= 15, [b.where for b in BLOCKS]  # the docs' blocks were found at all
    wrong = [f"{b.where}: ```{b.lang} {b.marker}" for b in BLOCKS
             if not b.lang or b.marker not in MARKERS or (b.marker == "skip:" and len(b.args) < 12)]
    assert not wrong, ("each fenced block names its language and one marker (run, config, output, figure, or "
                       f"'skip: what it needs'; tests/docblocks.py): {wrong}")


def test_a_block_without_a_marker_is_found(tmp_path):
    """The check above is not vacuous: a new block written as most Markdown is (```sh alone) is seen as unmarked."""
    doc = tmp_path / "new.md"
    doc.write_text("# new\n\n```sh\npled status\n```\n\n   ```python run\n   print(1)\n   ```\n")
    found = docblocks.blocks_of(doc)
    assert [(b.line, b.lang, b.marker, b.text) for b in found] == [(3, "sh", "", "pled status\n"),
                                                                    (7, "python", "run", "print(1)\n")]


# -- the blocks that run -------------------------------------------------------------------------------------------

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _params(b: Block):
    """Each run block with .venv's interpreter; a Python block also in vLLM's environment (.venv-vllm: pled's client
    beside vLLM's own torch), where operations.md says to run it."""
    marks = [pytest.mark.daemon, pytest.mark.slow] if b.tables() else []  # a pled, and torch for python
    yield pytest.param(b, sys.executable, id=b.where, marks=marks)
    if b.lang == "python":
        yield pytest.param(b, str(VLLM_PYTHON), id=f"{b.where} in vLLM's environment", marks=[*marks, pytest.mark.vllm])


RUN = [p for b in BLOCKS if b.marker == "run" for p in _params(b)]


@pytest.mark.parametrize(("block", "python"), RUN)
def test_a_run_block_runs(block: Block, python: str, tmp_path):
    assert block.lang in ("python", "sh", "bash", "console"), f"{block.where}: no way to run ```{block.lang}"
    needs = [c for w in block.args.split() if w.startswith("needs=") for c in w[len("needs="):].split(",")]
    missing = [c for c in needs if not shutil.which(c)]
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}, not installed here")
    env = clean_env(PATH=f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PLED_SOCKET", None)
    env.pop("PLED_CONFIG", None)
    daemon = None
    if block.tables():
        tables = {}
        for name in block.tables():
            tables[name] = tmp_path / "tables" / name
            make_sidecar(str(tables[name]), name if name in LAYOUTS else "ples_int4", shards=2, rows=4096)
        daemon = start(tmp_path, tables)
        env["PLED_SOCKET"] = daemon.socket
    work = tmp_path / "work"
    work.mkdir()
    if "cwd=checkout" in block.args.split():  # a block that reads the checkout (and writes nothing)
        work = ROOT
    if block.lang == "python":
        cmd = [python, "-c", block.text]
    else:
        cmd = ["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", "-c", block.text]
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    finally:
        if daemon is not None:  # the block's pled ends with it, not with the session
            daemon.stop()
    assert r.returncode == 0, f"{block.where} exited {r.returncode}:\n{block.text}\n{r.stdout}\n{r.stderr}"
    if "stdout=json" in block.args.split():  # what it prints is JSON, a document a line
        lines = [line for line in r.stdout.splitlines() if line.strip()]
        assert lines and all(isinstance(json.loads(line), dict) for line in lines), (block.where, r.stdout)


CONFIG = [pytest.param(b, id=b.where) for b in BLOCKS if b.marker == "config"]


@pytest.mark.parametrize("block", CONFIG)
def test_a_config_block_is_a_config_pled_accepts(block: Block):
    from pled.daemon import config

    parsed = config.parse(block.text, f"/etc/pled/{block.where}.toml")  # refused: ConfigError, naming the key
    named = re.findall(r'^name = "([^"]+)"', block.text, flags=re.M)
    assert [t.name for t in parsed.tables] == named, block.where


# -- the commands and options the docs name ----------------------------------------------------------------------

def wrong_commands(found: list[docblocks.Mention]) -> list[str]:
    """Each mention whose command, option or option value pled's parser does not have."""
    subs = subparsers()
    top = options(pled_parser())
    wrong = []
    for m in found:
        command, *rest = m.words
        if command not in subs:
            wrong.append(f"{m.where}: pled {command}: no such command (pled --help lists them)")
            continue
        known = options(subs[command]) | top
        for k, word in enumerate(rest):
            if not re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word):
                continue
            name = word.split("=", 1)[0]
            if name not in known:
                wrong.append(f"{m.where}: pled {command} has no option {name}")
                continue
            action = known[name]
            value = word.split("=", 1)[1] if "=" in word else (rest[k + 1] if k + 1 < len(rest) else None)
            if action.choices and value and re.fullmatch(r"[a-z][\w.-]*", value) and value not in action.choices:
                wrong.append(f"{m.where}: pled {command} {name} takes {sorted(action.choices)}, not {value}")
    return wrong


def test_every_pled_command_and_option_the_docs_name_exists():
    found = docblocks.mentions()
    assert len(found) > 50, found  # the scan finds the docs' commands
    wrong = wrong_commands(found)
    assert not wrong, "\n".join(wrong)


def test_every_pled_command_the_units_and_recipes_run_exists():
    """units/ (the catalog's advice too) and deploy/ (HEALTHCHECK, probes, init containers) run pled commands: each
    is one pled's parser has, with options it has. An exec form (["pled", "status", ...]) is read as its words."""
    found = []
    for path in [*ROOT.glob("units/**/*"), *ROOT.glob("deploy/**/*"), *ROOT.glob("debian/*")]:
        if not path.is_file() or path.suffix in (".md",):
            continue
        text = path.read_text(errors="replace")
        text = re.sub(r'\[\s*"((?:[^"\]]*/)?pled)"((?:\s*,\s*"[^"]*")*)\s*\]',
                      lambda m: " ".join([m[1], *re.findall(r'"([^"]*)"', m[2])]), text)
        text = re.sub(r"^Exec\w+=[-+@!:]*", "", text, flags=re.M)  # a unit's ExecStart=... runs what follows
        rel = str(path.relative_to(ROOT))
        if path.suffix in (".service", ".conf", ".yaml", ".yml", ".sh") or "Containerfile" in path.name \
                or path.name.endswith(("postinst", "prerm", "postrm", "rules")):  # what runs, not prose
            found += docblocks.commands_in_block(rel, text)
        for n, line in enumerate(text.splitlines(), 1):
            found += docblocks.commands_in_prose(f"{rel}:{n}", line)
    commands = {m.words[0] for m in found}
    assert {"serve", "status", "reload"} <= commands, found  # the units', the Containerfile's, the probes' were read
    wrong = wrong_commands(found)
    assert not wrong, "\n".join(wrong)


def test_the_check_of_commands_and_options_finds_what_does_not_exist():
    made_up = docblocks.commands_in_prose("x", "`pled stauts --json` and `pled status --jsn` and `pled needs 1 GiB`")
    made_up += docblocks.commands_in_block("y", "runuser -u pled -- pled verify --fix # pled status --nope\n")
    assert [m.words for m in made_up] == [("stauts", "--json"), ("status", "--jsn"), ("verify", "--fix")]


def test_every_commands_help_names_each_option_and_its_default():
    """`pled CMD --help` is the reference: every option has a line saying what it does, and where it has a default
    other than off/none, that default (issue 47, item 5's class)."""
    wrong = []
    for name, p in {"pled": pled_parser(), **subparsers()}.items():
        text = " ".join(p.format_help().split())
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                continue
            what = "/".join(a.option_strings) or a.dest
            if not a.help or a.help == argparse.SUPPRESS:
                wrong.append(f"pled {name} {what}: no help line")
                continue
            default = a.default
            if default in (None, False, argparse.SUPPRESS) or isinstance(a, argparse._StoreTrueAction):
                continue
            shown = {str(default), f"{default:g}" if isinstance(default, float) else str(default)}
            if not any(f"default {v}" in text or f"default: {v}" in text for v in shown):
                wrong.append(f"pled {name} {what}: its help does not say 'default {min(shown)}'")
    assert not wrong, "\n".join(wrong)


def _readme_commands() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Commands"):text.index("Exit status:")]
    return {m[1]: m[0] for m in re.findall(r"^\| `(pled ([a-z-]+)[^`]*)` \|", table, flags=re.M)}


def test_the_readmes_table_of_commands_lists_every_command_and_each_of_its_options():
    rows = _readme_commands()
    wrong = []
    for name, p in subparsers().items():
        if name not in rows:
            wrong.append(f"README.md, Commands: no row for pled {name}")
            continue
        for a in p._actions:
            if a.option_strings and not isinstance(a, argparse._HelpAction) \
                    and not any(s in re.split(r"[\s\[\]|\\]+", rows[name]) for s in a.option_strings):
                wrong.append(f"README.md, Commands: pled {name}'s row lacks {'/'.join(a.option_strings)}")
    assert not wrong, "\n".join(wrong)


# -- links between the docs ----------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    fenced = {b.line + k for b in docblocks.blocks_of(path, text) for k in range(b.text.count("\n") + 2)}
    found: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"#{1,6} (.*)", line)
        if m and n not in fenced:
            base = slug(m[1])
            k = 0
            while (name := base if k == 0 else f"{base}-{k}") in found:
                k += 1
            found.add(name)
    return found


def test_every_link_between_the_docs_leads_to_a_file_and_a_heading_that_exist():
    wrong = []
    for path in docblocks.doc_files():
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                if not dest.exists():
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {target}: no such heading in {dest.name}")
    assert not wrong, "\n".join(wrong)


# -- the make targets and repository files the docs name ------------------------------------------------------------

def code_texts() -> list[tuple[str, str]]:
    """(where, text) of every block that is not pled's output or a figure, and of every inline code span."""
    found = []
    for path in docblocks.doc_files():
        text = path.read_text()
        blocks = docblocks.blocks_of(path, text)
        found += [(b.where, b.text) for b in blocks if b.marker not in ("output", "figure")]
        fenced = {b.line + k for b in blocks for k in range(b.text.count("\n") + 2)}
        for n, line in enumerate(text.splitlines(), 1):
            if n not in fenced:
                found += [(f"{path.relative_to(ROOT)}:{n}", span) for span in re.findall(r"`([^`\n]+)`", line)]
    return found


MAKE = re.compile(r"(?<![\w-])make((?:[ \t]+(?:[A-Z][A-Z_0-9]*=\S*|[a-z][\w-]*))+)")


def test_every_make_target_and_variable_the_docs_name_is_in_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):(?!=)", makefile, flags=re.M))
    assert {"test", "deb", "lint"} <= targets, targets
    wrong = []
    for where, text in code_texts():
        for m in MAKE.finditer(re.sub(r"(^|\s)#.*", "", text)):  # not in a shell comment
            for word in m[1].split():
                if "=" in word:
                    var = word.split("=", 1)[0]
                    if not re.search(rf"\$\({var}\)|\$\$\{{?{var}\b", makefile):
                        wrong.append(f"{where}: make {word}: the Makefile reads no {var}")
                elif word not in targets:
                    wrong.append(f"{where}: make {word}: no such target")
                    break
    assert not wrong, "\n".join(wrong)


REPO_PATH = re.compile(r"(?<![\w./~$-])((?:units|deploy|config|tests|tools|bench|pled|debian|docs|\.ci)/"
                       r"[\w./*,-]*[\w*])")
PLACEHOLDERS = {"pled/x.py", "tests/test_x.py"}  # README's `make mutants MODULES=... TESTS=...` example


def test_every_file_of_the_checkout_the_docs_name_exists():
    import glob

    wrong = [f"{where}: {name}: not in the checkout" for where, text in code_texts()
             for name in REPO_PATH.findall(text)
             if name not in PLACEHOLDERS and not glob.glob(str(ROOT / name), recursive=True)]
    assert not wrong, "\n".join(wrong)


# -- what pled's messages, its config and its catalog point an operator to ----------------------------------------

SECTION_REFERENCE = re.compile(r'operations\.md\\?"?,? \(?\\?"([^"\\]+)\\?"(?: and \\?"([^"\\]+)\\?")?'
                               r'|operations\.md, ([A-Z][\w .:\'-]*?)\)')


def headings(path: Path) -> list[str]:
    text = path.read_text()
    fenced = {b.line + k for b in docblocks.blocks_of(path, text) for k in range(b.text.count("\n") + 2)}
    return [m[1].strip().lower() for n, line in enumerate(text.splitlines(), 1) if n not in fenced
            for m in [re.match(r"#{1,6} (.*)$", line)] if m]


def test_every_section_of_operations_md_that_pled_or_its_files_name_exists():
    """A message, the example config, the journal catalog or a doc that says `operations.md, "X"` sends the operator
    to a heading X (or one that begins with X) that is there."""
    known = headings(ROOT / "docs" / "operations.md")
    sources = [*ROOT.glob("pled/**/*.py"), ROOT / "config" / "pled.toml", *ROOT.glob("units/*"),
               *ROOT.glob("deploy/**/*"), *docblocks.doc_files()]
    wrong, found = [], 0
    for path in sources:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in SECTION_REFERENCE.finditer(line):
                for name in filter(None, m.groups()):
                    found += 1
                    if not any(h.startswith(name.lower().rstrip(".")) for h in known):
                        wrong.append(f"{path.relative_to(ROOT)}:{n}: operations.md has no section {name!r}")
    assert found > 10, found
    assert not wrong, "\n".join(wrong)


def test_pleds_messages_name_the_installed_docs_never_a_checkout_path():
    """Issue 47.7's class: what pled prints names /usr/share/doc/pled/... (config_file.DOCS), not docs/ or config/."""
    wrong = []
    for path in ROOT.glob("pled/**/*.py"):
        text = path.read_text()
        for m in re.finditer(r"""(?<![\w/])(?:docs/[\w.]+\.md|config/pled\.toml)""", text):
            line = text[:m.start()].count("\n") + 1
            source = text.splitlines()[line - 1].strip()
            in_string = re.search(r"""(?:^|[\s(=,])f?["'][^"'#]*$""", source[:source.find(m[0])])
            if in_string and not source.startswith("#") and '"""' not in source:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {source}")
    assert not wrong, "\n".join(wrong)


def test_the_configuration_table_lists_every_key_pled_reads():
    from pled.daemon import config

    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("## Configuration"):text.index("## Tables: sidecars and globs")]
    wrong = [f"docs/operations.md, Configuration: no row for {key}"
             for key in [*config.Config.model_fields, *config.TableConfig.model_fields] if key != "tables"
             if not re.search(rf"^\| (?:`\[\[table\]\]` )?`(?:[\w]+`, `)*{key}`", table, flags=re.M)]
    assert not wrong, "\n".join(wrong)


def test_every_pled_variable_the_docs_name_is_read_or_written_somewhere():
    """PLED_SOCKET, PLED_FALLBACK, a journal field such as PLED_TABLE, ...: each is in pled's code, the Makefile or a
    recipe under deploy/ (a name that is only in the docs is one an operator sets for nothing)."""
    code = "\n".join(p.read_text(errors="replace") for pattern in ("pled/**/*.py", "deploy/**/*", "Makefile", "units/*")
                     for p in ROOT.glob(pattern) if p.is_file())
    named = {v for p in docblocks.doc_files() for v in re.findall(r"\bPLED_[A-Z][A-Z_]*\b", p.read_text())}
    assert "PLED_SOCKET" in named
    wrong = sorted(v for v in named if not re.search(rf"\b{v}\b", code))
    assert not wrong, f"named in the docs, used nowhere: {wrong}"


def test_the_readmes_exit_table_has_a_row_for_every_status_pled_defines():
    """Each EX_... = N in pled's code (pled/shared/errors.py, and a command's own, such as gpu-check's 4) is a row
    of README.md's table of exit statuses, so that a status a command returns is one an operator can look up."""
    defined = {int(n): name for p in ROOT.glob("pled/**/*.py")
               for name, n in re.findall(r"^(EX_[A-Z_]+) = (\d+)\b", p.read_text(), flags=re.M)}
    assert {0, 1, 78} <= set(defined), defined
    text = (ROOT / "README.md").read_text()
    rows = {int(n) for n in re.findall(r"^\| (\d+) \| ", text[text.index("Exit status:"):], flags=re.M)}
    missing = {n: name for n, name in defined.items() if n not in rows}
    assert not missing, f"README.md's exit statuses have no row for {missing}"
