#!/usr/bin/env python3
"""Check that every relative link in the project's documents resolves.

Scans README.md, benches/*.md and docs/**/*.md. For each Markdown link or reference
definition whose target is relative (not http:, https:, mailto: or another scheme):

- the file or directory it names must exist (relative to the document, or to the repository
  root for a target starting with "/");
- a "#anchor" must match a heading of the target Markdown file (or of the document itself for
  a bare "#anchor"), slugged as GitHub does: lowercased, punctuation other than "-" and "_"
  dropped, spaces as "-", the n-th repeat of a slug suffixed "-n"; or an explicit
  <a name="..."> / id="..." in that file.

Links inside fenced code blocks and inline code are not links and are skipped. Prints each
broken link as FILE:LINE: TARGET: reason, and exits 1 if there is any, else 0.

Python 3 standard library only: `python3 scripts/check_links.py [ROOT]`.
"""

import os
import re
import sys
import unicodedata
from urllib.parse import unquote

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) or [text](target "title"); the text may hold one level of brackets
# (such as an image inside a link).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def slug(text):
    """GitHub's anchor for a heading's text."""
    # Rendered text: inline code keeps its content, links keep their text, images their alt,
    # HTML tags go.
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("`", "")
    text = text.strip().lower()
    out = []
    for ch in text:
        if ch in "-_" or ch == " ":
            out.append("-" if ch == " " else ch)
        elif unicodedata.category(ch)[0] in "LNM":
            out.append(ch)
    return "".join(out)


def lines_outside_code(path):
    """(line number, text) of each line outside fenced code blocks."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = FENCE.match(line)
            if fence is None and m:
                fence = m.group(1)[0] * len(m.group(1))
                continue
            if fence is not None:
                if line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
                    fence = None
                continue
            yield number, line.rstrip("\n")


_anchors = {}


def anchors(path):
    """Every anchor a Markdown file defines."""
    if path not in _anchors:
        found, seen = set(), {}
        for _, line in lines_outside_code(path):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            for name in HTML_ANCHOR.findall(line):
                found.add(name)
        _anchors[path] = found
    return _anchors[path]


def targets(path):
    """(line number, target) of every link in a Markdown file."""
    for number, line in lines_outside_code(path):
        m = REFERENCE_DEF.match(line)
        if m:
            yield number, m.group(1)
            continue
        line = INLINE_CODE.sub("", line)
        for m in INLINE_LINK.finditer(line):
            yield number, m.group(1)


def check(root, doc):
    """Messages for the broken links of one document."""
    problems = []
    for number, target in targets(doc):
        target = target.strip("<>")
        if not target or SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if file_part:
            base = root if file_part.startswith("/") else os.path.dirname(doc)
            dest = os.path.normpath(os.path.join(base, file_part.lstrip("/")))
        else:
            dest = doc
        where = f"{os.path.relpath(doc, root)}:{number}: {target}"
        if not os.path.exists(dest):
            problems.append(f"{where}: {os.path.relpath(dest, root)} does not exist")
            continue
        if not anchor:
            continue
        if not dest.endswith(".md") or os.path.isdir(dest):
            problems.append(f"{where}: an anchor into a file that is not Markdown")
        elif unquote(anchor) not in anchors(dest):
            problems.append(f"{where}: no heading or anchor '{anchor}' in {os.path.relpath(dest, root)}")
    return problems


def documents(root):
    docs = [os.path.join(root, "README.md")]
    benches = os.path.join(root, "benches")
    if os.path.isdir(benches):
        docs += sorted(os.path.join(benches, f) for f in os.listdir(benches) if f.endswith(".md"))
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "docs")):
        dirnames.sort()
        docs += sorted(os.path.join(dirpath, f) for f in filenames if f.endswith(".md"))
    return [d for d in docs if os.path.isfile(d)]


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    docs = documents(root)
    problems = [p for doc in docs for p in check(root, doc)]
    for p in problems:
        print(p)
    count = sum(1 for doc in docs for _ in targets(doc))
    if problems:
        print(f"check_links: {len(problems)} broken link(s) in {len(docs)} documents", file=sys.stderr)
        return 1
    print(f"check_links: {count} links in {len(docs)} documents, every relative one resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
