"""The code a reader copies out of README.md and docs/*.md, for the tests that keep it true."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


@dataclass(frozen=True)
class Block:
    """One fenced code block: the file it is in, its line there, its language and its text."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path, *langs: str) -> list[Block]:
    """The fenced blocks of ``path`` in one of ``langs`` (all when none given), dedented."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        lang = match["lang"]
        if langs and lang not in langs:
            continue
        indent = len(match["indent"])
        body = "\n".join(line[indent:] for line in match["body"].splitlines())
        found.append(Block(path, text.count("\n", 0, match.start()) + 2, lang, body))
    return found


def prose(path: Path) -> str:
    """The text of ``path`` outside fenced blocks."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def inline_code(path: Path) -> list[str]:
    """Every `inline code` span outside fenced blocks."""
    return _INLINE.findall(prose(path))


def shell_lines(block: Block) -> list[str]:
    """The commands of a shell block: continuations joined, comments and output dropped."""
    lines: list[str] = []
    pending = ""
    for raw in block.text.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            lines.append(stripped)
    return lines
