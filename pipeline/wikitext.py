"""Wikitext to plain paragraphs, with mwparserfromhell (Kurtz et al., the maintained MediaWiki parser).

What stays: body text, link text, external-link titles, list items (one per line), the contents of
formatting tags. What goes: templates (infoboxes, citations, navboxes), tables, <ref>s and other
non-prose tags, files/images, categories, interlanguage links, comments, headings themselves, and
whole boilerplate sections ("References", "External links", ...), as WikiExtractor (Attardi 2015)
and the BERT data recipes do. The result is paragraphs joined by "\\n".
"""

from __future__ import annotations

import re

import mwparserfromhell
from mwparserfromhell.nodes import (
    Argument,
    Comment,
    ExternalLink,
    Heading,
    HTMLEntity,
    Tag,
    Template,
    Text,
    Wikilink,
)

DROP_TAGS = frozenset(
    "table ref references gallery math chem score timeline imagemap syntaxhighlight source "
    "pre code templatedata graph mapframe maplink noinclude includeonly onlyinclude hiero "
    "inputbox categorytree poem".split()
)
BREAK_TAGS = frozenset("br li dt dd p div blockquote".split())
DROP_LINK_NAMESPACES = frozenset(
    "file image media category wikipedia wp template help portal user special "
    "draft module talk wikt wiktionary s q n b v voy commons".split()
)
BOILERPLATE_SECTIONS = frozenset(
    [
        "references",
        "notes",
        "footnotes",
        "citations",
        "sources",
        "bibliography",
        "external links",
        "further reading",
        "see also",
        "notes and references",
        "references and notes",
        "works cited",
        "general references",
        "gallery",
    ]
)
DISAMBIGUATION_TEMPLATES = frozenset(
    [
        "disambiguation",
        "disambig",
        "dab",
        "disamb",
        "hndis",
        "geodis",
        "numberdis",
        "mathdab",
        "hospitaldis",
        "schooldis",
        "shipindex",
        "set index",
        "set index article",
        "ship index",
        "sia",
        "surname",
        "given name",
    ]
)
INLINE_TEMPLATES = {
    "ndash": "–",
    "snd": " – ",
    "spaced ndash": " – ",
    "mdash": "—",
    "nbsp": " ",
    "'": "'",
    "·": " · ",
    "dot": " · ",
    "en dash": "–",
    "em dash": "—",
}
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(-[a-z]+)?$")
_SPACES = re.compile(r"[ \t\u00a0]+")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?)])")
_LIST_MARK = re.compile(r"^[*#:;]+\s*")
# <ref .../> and <ref ...>...</ref> (never across another <ref), and comments: removed before parsing
_REFS = re.compile(r"<ref\b[^>]*?/>|<ref\b[^>]*(?<!/)>(?:(?!<ref\b).)*?</ref\s*>", re.S | re.I)
_STRAY_REF_TAGS = re.compile(
    r"</?ref\b[^>]*>", re.I
)  # an unclosed <ref>: its text stays, as MediaWiki shows it
_COMMENTS = re.compile(r"<!--.*?-->", re.S)


def is_disambiguation(title: str, wikitext: str) -> bool:
    """A disambiguation or set-index page: by title suffix or by a {{disambiguation}}-like template."""
    if title.endswith("(disambiguation)"):
        return True
    lowered = wikitext.lower()
    if "{{" not in lowered:
        return False
    for name in re.findall(r"\{\{\s*([^|}\n]+)", lowered):
        name = name.strip().replace("_", " ")
        if name in DISAMBIGUATION_TEMPLATES or name.endswith("disambiguation"):
            return True
    return False


def _link_text(link: Wikilink) -> str:
    title = str(link.title).strip()
    if title.startswith(":"):
        title = title[1:]
    if ":" in title:
        prefix = title.split(":", 1)[0].strip().lower()
        if prefix in DROP_LINK_NAMESPACES or _LANG_PREFIX.match(prefix):
            return ""
    if link.text is not None:
        return _strip(link.text.nodes)
    return title.split("#", 1)[0] if not title.startswith("#") else title[1:]


def _strip(nodes) -> str:
    parts = []
    for node in nodes:
        if isinstance(node, Text):
            parts.append(node.value)
        elif isinstance(node, Wikilink):
            parts.append(_link_text(node))
        elif isinstance(node, Tag):
            tag = str(node.tag).strip().lower()
            if tag in DROP_TAGS:
                continue
            if tag in BREAK_TAGS:
                parts.append("\n")
            if node.contents is not None and not node.self_closing:
                parts.append(_strip(node.contents.nodes))
        elif isinstance(node, ExternalLink):
            if node.title is not None:
                parts.append(_strip(node.title.nodes))
        elif isinstance(node, HTMLEntity):
            parts.append(node.normalize())
        elif isinstance(node, Heading):
            parts.append("\n\n")
        elif isinstance(node, Template):
            parts.append(_template_text(node))
        elif isinstance(node, (Comment, Argument)):
            continue
    return "".join(parts)


def _template_text(template: Template) -> str:
    """The few inline templates that carry prose ({{lang}}, {{convert}}, dashes); all others go."""
    name = str(template.name).strip().lower()
    if name in INLINE_TEMPLATES:
        return INLINE_TEMPLATES[name]
    positional = [p for p in template.params if not p.showkey]
    if name.startswith("lang") and positional:
        return _strip(positional[-1].value.nodes)
    if name in ("convert", "cvt") and len(positional) >= 2:
        return f"{_strip(positional[0].value.nodes).strip()} {_strip(positional[1].value.nodes).strip()}"
    return ""


def _drop_boilerplate_sections(nodes) -> list:
    """Top-level nodes without the boilerplate sections (a heading up to the next of its level or above)."""
    kept, skip_level = [], None
    for node in nodes:
        if isinstance(node, Heading):
            title = _strip(node.title.nodes).strip().lower()
            if skip_level is not None and node.level <= skip_level:
                skip_level = None
            if skip_level is None and title in BOILERPLATE_SECTIONS:
                skip_level = node.level
        if skip_level is None:
            kept.append(node)
    return kept


def _tidy(text: str) -> list[str]:
    """Plain-text lines to paragraphs: whitespace collapsed, template debris and markup residue removed."""
    paragraphs, current = [], []
    for line in text.split("\n"):
        line = _LIST_MARK.sub("", line.strip())
        line = line.replace("'''", "").replace("''", "")
        line = _SPACES.sub(" ", _EMPTY_BRACKETS.sub("", line)).strip()
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
        if line.startswith(("{|", "|", "!", "__")) or not any(c.isalpha() for c in line):
            line = ""
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def clean_wikitext(wikitext: str) -> str:
    """Plain paragraphs, joined by newlines ("" when nothing is left).

    References and comments go before parsing, as WikiExtractor does: they are dropped anyway,
    they are a large share of an article's markup (parsing is 1.8x faster without them), and a
    malformed one can make mwparserfromhell give up on the rest of a page, which then leaks
    markup (`<ref>...`, `<blockquote>`), keeps boilerplate sections or loses prose.
    """
    code = mwparserfromhell.parse(
        _STRAY_REF_TAGS.sub("", _REFS.sub("", _COMMENTS.sub("", wikitext)))
    )
    return "\n".join(_tidy(_strip(_drop_boilerplate_sections(code.nodes))))
