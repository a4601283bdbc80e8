"""Wikitext cleaning: what stays (prose, link text, list items) and what goes (markup of every kind)."""

import bz2
import html
import re

import pytest

from shatter.pipeline.wikitext import clean_wikitext, is_disambiguation


def test_markup_goes_and_prose_stays():
    text = (
        "'''Paris''' ({{IPA-fr|paʁi}}) is the [[capital city|capital]] of [[France]].<ref>{{cite web|url=x}}"
        "</ref> It lies on the [[Seine]] ({{convert|13|km|mi}} of it).<!-- a comment -->\n"
        "[[File:Paris.jpg|thumb|A caption with [[link]]]]\n"
        '{| class="wikitable"\n|-\n! Year !! Population\n|-\n| 1900 || 2,714,068\n|}\n'
        "== History ==\n=== Early ===\nThe [[Parisii]] lived there.<ref name=a/>\n"
        "* a list item with [http://example.org an external link]\n# numbered item\n"
        "== See also ==\n* [[Lyon]]\n== References ==\n{{reflist}}\n"
        "[[Category:Capitals in Europe]]\n[[de:Paris]]\n"
    )
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


def test_references_go_even_when_malformed_and_keep_the_prose_around_them():
    text = (
        'First.<ref name="a/b"/> Second.<ref group="note">{{cite web |url= |title=T}}</ref> Third.'
        "<ref name=x>open but never closed\n\nA new paragraph.<ref>closed</ref> End.<!-- <ref>x</ref> -->"
    )
    out = clean_wikitext(text)
    assert "<ref" not in out and "cite" not in out and "x</ref" not in out
    assert out.split("\n") == [
        "First. Second. Third.open but never closed",
        "A new paragraph. End.",
    ]


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_articles_leak_no_markup_and_drop_their_boilerplate(shared_data):
    raw = bz2.open(shared_data / "wiki" / "enwiki-sample-pages-articles.xml.bz2").read().decode()
    pages = [
        p
        for p in re.findall(r"<page>.*?</page>", raw, re.S)
        if "<ns>0</ns>" in p and "<redirect" not in p
    ]
    cleaned = [
        clean_wikitext(html.unescape(re.search(r"<text[^>]*>(.*?)</text>", p, re.S).group(1)))
        for p in pages
    ]
    joined = "\n".join(cleaned)
    for residue in ("<ref", "</ref", "<blockquote", "{{cite"):
        assert residue not in joined, residue
    # "See also" / "Bibliography" lists are dropped with their sections
    assert "Bibliography of the American Revolutionary War" not in joined
    assert "List of Presidents of the United States, sortable by previous experience" not in joined
