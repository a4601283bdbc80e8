"""Pure text cleaning: byte decoding with counted repairs, binary detection, Project Gutenberg
boilerplate, paragraphs. (Wikitext has its own module, `shatter.pipeline.wikitext`.)

The Gutenberg markers follow the conventions handled by Gutenberg's own `gutenbergpy`/`gutenberg`
cleaners ("*** START OF THE PROJECT GUTENBERG EBOOK ..." / "*** END OF ...", and the older
"End of the Project Gutenberg EBook" trailer).
"""

from __future__ import annotations

import re

_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.I | re.M,
)
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")
_CONTROL = bytes([*range(0, 9), 11, 12, *range(14, 32)])
# every character str.split() splits on (Unicode White_Space and a few separators, all <= U+3000)
_OTHER_SPACES = tuple(c for c in map(chr, range(0x3001)) if c.isspace() and c != " ")


def decode(data: bytes) -> tuple[str, int]:
    """UTF-8 text and the number of invalid byte sequences replaced by U+FFFD."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode())


def is_binary(head: bytes) -> bool:
    """A file that is not text: NUL bytes, or over 10% control bytes, in its first bytes."""
    if not head:
        return False
    if b"\x00" in head:
        return True
    controls = len(head) - len(head.translate(None, _CONTROL))  # in C: no loop over the bytes
    return controls > 0.1 * len(head)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg text (unchanged when it has no header/footer markers)."""
    start = _START.search(text)
    if start:
        text = text[start.end() :]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    return text


def collapse_spaces(text: str) -> str:
    """Runs of whitespace (what re's \\s and str.split() match) as one space, stripped: the same as
    `" ".join(text.split())`, 3x faster, with C-speed find/replace passes and no per-word objects."""
    for c in _OTHER_SPACES:
        if c in text:
            text = text.replace(c, " ")
    while "  " in text:
        text = text.replace("  ", " ")
    return text.strip(" ")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, each with its line breaks and runs of spaces collapsed."""
    out = []
    for block in _BLANK_LINES.split(text.replace("\r\n", "\n")):
        block = collapse_spaces(block)
        if block:
            out.append(block)
    return out


def clean_plain(text: str) -> str:
    """A plain-text document as paragraphs joined by newlines."""
    return "\n".join(paragraphs(text))


def clean_book(text: str) -> str:
    """A book: Gutenberg boilerplate removed, paragraphs joined by newlines."""
    return clean_plain(strip_gutenberg(text))


def sample_lines(text: str) -> list[str]:
    """The units the tokenizer is trained on: the cleaned text's lines (paragraphs)."""
    return [line for line in text.split("\n") if line]
