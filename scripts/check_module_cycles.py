#!/usr/bin/env python3
"""Reports import cycles among the modules of src/ (stdlib only).

Reads every `use crate::..`, `use super::..` and `use self::..` declaration (braces and
multi-line groups included) and every `crate::a::b` / `super::a` path written in code (not in
comments), resolves each to the file that defines the module it names, and prints the
strongly connected components of more than one node: each is an import circle.

    scripts/check_module_cycles.py [--group DIR ...] [--only PATH ...]

`--group src/runner/instances` counts a directory's files (and `src/runner/instances.rs`,
when that declares them) as one node. `--only` prints only
the circles that touch one of the given files or directories. A parent `mod.rs` and the
children it declares are not a circle by themselves: a child's `super::` import of its parent
is counted, the parent's `mod child;`, `pub use child::..` and uses of its children are not.
A path through a re-export (`pub use`) counts as an import of the file that defines the item.
Exit status 1 when a reported circle exists.
"""
import argparse
import os
import re
import sys

SRC = "src"


def module_of_file(path):
    """src/a/b.rs or src/a/b/mod.rs -> ['a', 'b']; src/lib.rs -> []."""
    rel = os.path.relpath(path, SRC)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return rel


def file_of_module(segs):
    """The longest prefix of segs that is a file, as (path, segments left), or (None, segs)."""
    for n in range(len(segs), -1, -1):
        base = os.path.join(SRC, *segs[:n]) if n else SRC
        for cand in (base + ".rs", os.path.join(base, "mod.rs")) if n else (os.path.join(SRC, "lib.rs"),):
            if os.path.isfile(cand):
                return os.path.normpath(cand), segs[n:]
    return None, segs


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*", "", line) for line in text.splitlines())


def cut_tests(text):
    """Drops `#[cfg(test)] mod tests { ... }` at the end of a file (test-only imports)."""
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: m.start()] if m else text


def expand(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = tree.strip()
    m = re.match(r"^(.*?)\{(.*)\}$", tree, re.S)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p.strip():
            out.extend(prefix + q for q in expand(p))
    return out


def resolve(path, here, children=False):
    """An import path seen in the module `here` (a list of segments) -> segments from the crate root."""
    segs = [s.strip() for s in path.split("::") if s.strip()]
    segs = [re.sub(r"\s+as\s+\w+$", "", s) for s in segs]
    if not segs:
        return None
    if segs[0] == "crate":
        return segs[1:]
    if segs[0] in ("super", "self"):
        cur = list(here)
        while segs and segs[0] in ("super", "self"):
            if segs.pop(0) == "super":
                cur = cur[:-1]
        return cur + segs
    if children and file_of_module(here + segs[:1])[0] not in (None, file_of_module(here)[0]):
        return here + segs  # a child module named bare (`use child::Item;` in its parent)
    return None  # an external crate, or a name in scope


def imports_of(path):
    """Every module path `path` names, from the crate root, and its `use` aliases (name -> path)."""
    here = module_of_file(path)
    text = cut_tests(strip_comments(open(path, encoding="utf-8").read()))
    found, aliases = set(), {}
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for p in expand(m.group(1)):
            r = resolve(p, here, children=True)
            if r is not None and r:
                name = re.search(r"(?:\bas\s+(\w+)|(\w+))\s*$", p.strip())
                name = name and (name.group(1) or name.group(2))
                if name == "self":
                    name = r[-1]
                if name:
                    aliases[name] = tuple(r)
                found.add(tuple(r))
    for m in re.finditer(r"\b((?:crate|super)(?:::\w+)+)", text):
        r = resolve(m.group(1), here)
        if r is not None:
            found.add(tuple(r))
    return found, aliases


ALIASES = {}


def target_file(segs, depth=0):
    """The file that defines what `segs` names, following re-exports (`pub use`)."""
    f, rest = file_of_module(list(segs))
    if f and rest and depth < 8:
        alias = ALIASES.get(f, {}).get(rest[0])
        if alias is not None:
            return target_file(tuple(alias) + tuple(rest[1:]), depth + 1)
    return f


def edges_of(path):
    """The files `path` imports from. A `mod.rs`'s imports from its own subtree are left out:
    a parent that declares, re-exports and uses its children is their parent, not a circle with
    each child that reads an item defined in it."""
    out = set()
    path = os.path.normpath(path)
    subtree = os.path.dirname(path) + os.sep if os.path.basename(path) == "mod.rs" else None
    for segs in imports_of(path)[0]:
        target = target_file(segs)
        if not target or target == path:
            continue
        if subtree and target.startswith(subtree):
            continue
        out.add(target)
    return out


def sccs(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", action="append", default=[], help="a directory counted as one node")
    ap.add_argument("--only", action="append", default=[], help="report circles touching these")
    args = ap.parse_args()
    groups = [os.path.normpath(g) for g in args.group]

    def node(p):
        for g in groups:
            # `src/a.rs` declaring `src/a/*` is the same module as its directory.
            if p in (g, g + ".rs") or p.startswith(g + os.sep):
                return g + "/"
        return p

    paths = []
    for root, _, files in os.walk(SRC):
        if root.startswith(os.path.join(SRC, "bin")):
            continue
        paths += [os.path.normpath(os.path.join(root, f)) for f in files if f.endswith(".rs")]
    for p in paths:
        ALIASES[p] = imports_of(p)[1]
    graph = {}
    for root, _, files in os.walk(SRC):
        if root.startswith(os.path.join(SRC, "bin")):
            continue
        for f in files:
            if f.endswith(".rs"):
                p = os.path.normpath(os.path.join(root, f))
                a = node(p)
                graph.setdefault(a, set())
                for t in edges_of(p):
                    b = node(t)
                    if a != b:
                        graph[a].add(b)
    only = [os.path.normpath(o) for o in args.only]
    bad = 0
    for comp in sccs(graph):
        if len(comp) < 2:
            continue
        if only and not any(c.rstrip("/") == o or c.startswith(o + os.sep) or o.startswith(c.rstrip("/") + os.sep) for c in comp for o in only):
            continue
        bad += 1
        print("circle: " + " <-> ".join(comp))
        for a in comp:
            for b in sorted(graph[a]):
                if b in comp:
                    print(f"    {a} -> {b}")
    if not bad:
        print("no circles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
