"""The fenced code blocks of pled's docs, and what each says it is (tests/test_docs.py runs or checks every one).

Every block's fence names its language and then one marker, in the info string (GitHub shows the first word as the
language and ignores the rest):

    ```python run                    run here, with .venv's python, as a script
    ```python run pled=ples_int4     the same, against a real `pled serve` holding a synthetic table of that name
                                     (its layout the name's where it names one), $PLED_SOCKET set to its socket
    ```sh run [pled=T,...]           run here by bash (-e, pipefail) in an empty temporary directory, with .venv's
                                     bin (the `pled` command) first on PATH
    ```sh run ... stdout=json        and what it prints is JSON, one document a line
    ```sh run ... cwd=checkout       in the checkout instead (a block that reads it and writes nothing)
    ```sh run ... needs=CMD,...      skipped, naming them, where those commands are not installed
    ```toml config                   a pled.toml, or part of one: read by pled's own config parser, must be accepted
    ```text output                   what a command or pled prints (a message, log lines): shown, not run
    ```text figure                   a diagram: shown, not run
    ```sh skip: REASON               a block that cannot run here; REASON says what it needs (root, systemd as
                                     PID 1, a GPU, a Debian 12 host, a container engine, a cluster) and, where one
                                     exists, which test runs it instead

A block without one of these markers fails tests/test_docs.py, naming its file and line. Blocks that are not run are
still checked: the `pled` commands and options they name exist (tests/test_docs.py).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/*.md", "deploy/README.md"]
MARKERS = ("run", "config", "output", "figure", "skip:")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    path: str      # relative to the checkout
    line: int      # the opening fence's line, from 1
    lang: str
    marker: str    # one of MARKERS ("skip:" for a skip), or what the fence says instead (then wrong)
    args: str      # the rest: a skip's reason, run's options
    text: str = field(repr=False)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def tables(self) -> list[str]:
        """The tables `pled=T1,T2` asks a real pled to hold for a run block."""
        for word in self.args.split():
            if word.startswith("pled="):
                return [t for t in word[len("pled="):].split(",") if t]
        return []


def doc_files() -> list[Path]:
    return [p for pattern in DOCS for p in sorted(ROOT.glob(pattern))]


def parse_info(info: str) -> tuple[str, str, str]:
    """(language, marker, args) of a fence's info string."""
    words = info.split(None, 1)
    if not words:
        return "", "", ""
    lang, rest = words[0], (words[1].strip() if len(words) > 1 else "")
    if rest.startswith("skip:"):
        return lang, "skip:", rest[len("skip:"):].strip()
    marker, _, args = rest.partition(" ")
    return lang, marker, args.strip()


def blocks_of(path: Path, text: str | None = None) -> list[Block]:
    text = path.read_text() if text is None else text
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        lang, marker, args = parse_info(m["info"])
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        found.append(Block(rel, i + 1, lang, marker, args, "\n".join(body) + "\n"))
        i = j + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks_of(p)]


# -- the pled commands a text names ------------------------------------------------------------------------------

SHELL_OPERATORS = {"&&", "||", "|", ";", "(", ")", "{", "}", "!"}
# Spans of prose that begin with "pled " but quote what pled prints, not a command.
MESSAGE_WORDS = {"needs"}


@dataclass(frozen=True)
class Mention:
    where: str
    words: tuple[str, ...]  # from the subcommand on: ("status", "--json", ...)


def _words(text: str) -> list[str]:
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        return list(lexer)
    except ValueError:  # an unbalanced quote in a shown fragment: split on blanks
        return text.split()


def _is_pled(word: str) -> bool:
    return word == "pled" or (word.startswith("/") and word.endswith("/bin/pled"))


def commands_in_block(where: str, text: str) -> list[Mention]:
    """Each `pled SUBCOMMAND ...` a shell block runs: a `pled` word followed by a word, not an option's value
    (`-u pled`, `--name pled`), up to the next shell operator or comment."""
    out = []
    for n, line in enumerate(text.replace("\\\n", " ").splitlines()):
        words = _words(line)
        for k, word in enumerate(words):
            if not _is_pled(word) or k + 1 >= len(words):
                continue
            before = words[k - 1] if k else ""
            after = words[k + 1]
            if before.startswith("-") and before != "--" or _is_pled(after) or not re.fullmatch(r"[a-z][a-z-]*", after):
                continue
            rest = []
            for w in words[k + 1:]:
                if w in SHELL_OPERATORS or set(w) <= set("|&;<>()"):
                    break
                rest.append(w)
            out.append(Mention(f"{where} (+{n})", tuple(rest)))
    return out


def commands_in_prose(where: str, text: str) -> list[Mention]:
    """Each inline code span that begins with `pled WORD` (a command, or a synopsis like `pled status [--json]`)."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", text):
        m = re.match(r"(?:/usr/bin/)?pled ([a-z][a-z-]*)(?=$|\s)(.*)", span)
        if not m or m[1] in MESSAGE_WORDS:
            continue
        synopsis = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", m[2].replace("\\|", " "))
        out.append(Mention(where, (m[1], *synopsis)))
    return out


def mentions() -> list[Mention]:
    """Every `pled` command the docs name, in blocks and prose (an `output` block is pled's text, not a command)."""
    found = []
    for path in doc_files():
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        for block in blocks_of(path, text):
            if block.marker not in ("output", "figure", "config"):
                found += commands_in_block(block.where, block.text)
        fenced = {b.line + k for b in blocks_of(path, text) for k in range(b.text.count("\n") + 2)}
        for n, line in enumerate(text.splitlines(), 1):
            if n not in fenced:
                found += commands_in_prose(f"{rel}:{n}", line)
    return found
