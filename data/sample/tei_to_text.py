"""Convert an ELTeC TEI novel (.xml or .xml.gz) to plain text: how data/sample/*.txt was made.

Keeps the novel's <text> (front matter, chapters, back matter): one block per heading, paragraph
or verse line, blank lines between blocks, whitespace inside a block collapsed. Editorial notes
are dropped. Usage: python data/sample/tei_to_text.py ENG19192_Woolf.xml.gz > night_and_day.txt
"""
import gzip
import re
import sys
import xml.etree.ElementTree as ET

TEI = "{http://www.tei-c.org/ns/1.0}"
BLOCKS = {TEI + tag for tag in ("head", "p", "l", "trailer", "label")}


def blocks(elem):
    """Yield the text of each block element in document order (a block never nests a block)."""
    if elem.tag in BLOCKS:
        yield re.sub(r"\s+", " ", "".join(inline_text(elem))).strip()
        return
    for child in elem:
        if child.tag != TEI + "note":
            yield from blocks(child)


def inline_text(elem):
    yield elem.text or ""
    for child in elem:
        if child.tag != TEI + "note":
            yield from inline_text(child)
        yield child.tail or ""


def tei_to_text(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        root = ET.parse(f).getroot()
    return "\n\n".join(b for b in blocks(root.find(TEI + "text")) if b) + "\n"


if __name__ == "__main__":
    sys.stdout.write(tei_to_text(sys.argv[1]))
