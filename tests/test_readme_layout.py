"""README's Layout is the tree as it is: every path it names exists, and every
C source and Python module is covered by an entry (its own, or a folder
entry with nothing listed below it)."""
import fnmatch
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout_entries(text):
    """(path, is_dir, has_children) for each name in README's Layout block.
    A line is '<indent><names>  <description>'; two spaces of indent a level;
    names are relative to the nearest folder line above at a lower level."""
    block = re.search(r"## Layout\n\n```\n(.*?)```", text, flags=re.S).group(1)
    entries, parents = [], []          # parents: (indent, folder path)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        names = re.split(r"\s{2,}", line.strip())[0].split()
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        for name in names:
            path = base + name
            entries.append([path, name.endswith("/"), False])
        for e in entries:
            if e[1] and base == e[0]:
                e[2] = True
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, base + names[0]))
    return [tuple(e) for e in entries]


def tree_files(top, exts):
    out = []
    for d, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), ROOT) for f in files
                if os.path.splitext(f)[1] in exts]
    return sorted(out)


ENTRIES = layout_entries(open(os.path.join(ROOT, "README.md")).read())
FILES = tree_files("csrc", {".c", ".h", ".cu", ".cuh"}) + tree_files("python/flatshard", {".py"})


def matches(entry, path):
    """File entries are globs over the tree ('layout.[ch]', 'py_*.c')."""
    name, is_dir, _ = entry
    if is_dir:
        return path.startswith(name)
    return fnmatch.fnmatchcase(path, name)


def test_every_named_path_exists():
    missing = []
    for name, is_dir, _ in ENTRIES:
        if is_dir:
            if not os.path.isdir(os.path.join(ROOT, name)):
                missing.append(name)
        elif not any(fnmatch.fnmatchcase(os.path.relpath(os.path.join(d, f), ROOT), name)
                     for d, _, fs in os.walk(os.path.join(ROOT, os.path.dirname(name) or "."))
                     for f in fs):
            missing.append(name)
    assert not missing, f"README's Layout names paths the tree lacks: {missing}"


def test_every_source_file_is_covered():
    uncovered = []
    for path in FILES:
        if any(matches(e, path) for e in ENTRIES if not e[1]):
            continue
        # else the deepest folder entry above it must list nothing below it
        folders = [e for e in ENTRIES if e[1] and path.startswith(e[0])]
        deepest = max(folders, key=lambda e: len(e[0]), default=None)
        if deepest is None or deepest[2]:
            uncovered.append(path)
    assert not uncovered, f"README's Layout leaves these out: {uncovered}"


def test_the_check_sees_a_stale_entry():
    text = "## Layout\n\n```\ncsrc/  c\n  core/  x\n    gone.[ch]  old\n```\n"
    entries = layout_entries(text)
    assert ("csrc/core/gone.[ch]", False, False) in entries
    assert ("csrc/core/", True, True) in entries
    assert not any(fnmatch.fnmatchcase(f, "csrc/core/gone.[ch]") for f in FILES)
