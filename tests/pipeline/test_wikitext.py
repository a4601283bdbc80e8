"""Wikitext cleaning: what stays (prose, link text, list items) and what goes (markup of every kind)."""
import bz2
import html
import re

import pytest

from pipeline.wikitext import clean_wikitext, is_disambiguation


def test_markup_goes_and_prose_stays():
    text = ("'''Paris''' ({{IPA-fr|paʁi}}) is the [[capital city|capital]] of [[France]].<ref>{{cite web|url=x}}"
            "</ref> It lies on the [[Seine]] ({{convert|13|km|mi}} of it).<!-- a comment -->\n"
            "[[File:Paris.jpg|thumb|A caption with [[link]]]]\n"
            "{| class=\"wikitable\"\n|-\n! Year !! Population\n|-\n| 1900 || 2,714,068\n|}\n"
            "== History ==\n=== Early ===\nThe [[Parisii]] lived there.<ref name=a/>\n"
            "* a list item with [http://example.org an external link]\n# numbered item\n"
            "== See also ==\n* [[Lyon]]\n== References ==\n{{reflist}}\n"
            "[[Category:Capitals in Europe]]\n[[de:Paris]]\n")
    out = clean_wikitext(text)
    assert out.split("\n") == [
        "Paris is the capital of France. It lies on the Seine (13 km of it).",
        "The Parisii lived there.",
        "a list item with an external link",
        "numbered item",
    ]


def test_disambiguation_detection():
    assert is_disambiguation("Mercury (disambiguation)", "")
    assert is_disambiguation("Mercury", "'''Mercury''' may refer to\n{{Disambiguation|geo}}")
    assert is_disambiguation("Smith", "{{surname}}")
    assert not is_disambiguation("Mercury", "Mercury is a planet.{{Infobox planet}}")


@pytest.mark.shared_data
def test_heavy_table_markup_leaves_no_residue(shared_data):
    raw = bz2.open(shared_data / "wiki" / "enwiki-table-markup.xml.bz2").read().decode()
    texts = [html.unescape(t) for t in re.findall(r"<text[^>]*>(.*?)</text>", raw, re.S)]
    cleaned = [clean_wikitext(t) for t in texts]
    joined = "\n".join(cleaned)
    assert all(len(c) > 200 for c in cleaned)  # the prose of every page survives
    for residue in ("|", "{{", "}}", "[[", "]]", "<ref", "wikitable", "colspan", "style=", "=="):
        assert residue not in joined, residue
