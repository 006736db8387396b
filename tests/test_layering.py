"""Who owns what, as the imports show it: no circle between the Python
subpackages of flatshard (runtime/ below fsdp/ and fsdp2/, state/ below
the wrappers, ...), the leaves importing what README.md says they do, and
no circle between csrc/'s headers (a header and its own .c file aside).
Read from the sources, so a new import that closes a circle fails here,
whatever the import order at run time would hide."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "python", "flatshard")
CSRC = os.path.join(ROOT, "csrc")


def _unit_of(rel):
    """A module's owner: its subpackage, or the top-level module itself."""
    parts = rel.split(os.sep)
    return parts[0] if len(parts) > 1 else parts[0][:-3]


def _python_edges():
    edges = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, PKG)
            here = _unit_of(rel)
            pkg_parts = os.path.dirname(rel).split(os.sep) if os.path.dirname(rel) else []
            for node in ast.walk(ast.parse(open(path).read(), path)):
                targets = []
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = pkg_parts[:len(pkg_parts) - (node.level - 1)] \
                            if node.level > 1 else pkg_parts
                        mod = base + (node.module.split(".") if node.module else [])
                        if node.module is None:  # from . import a, b
                            targets = [mod + [a.name] for a in node.names]
                        else:
                            targets = [mod]
                    elif node.module and node.module.startswith("flatshard."):
                        targets = [node.module.split(".")[1:]]
                elif isinstance(node, ast.Import):
                    targets = [a.name.split(".")[1:] for a in node.names
                               if a.name.startswith("flatshard.")]
                for t in targets:
                    if not t:
                        continue
                    other = t[0]
                    if other != here:
                        edges.setdefault(here, set()).add(other)
    return edges


def _cycles(edges):
    """Each circle found by a depth-first walk, as the list of its nodes."""
    found, state = [], {}

    def walk(n, stack):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                walk(m, stack)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            walk(n, [])
    return found


def test_no_circle_between_python_subpackages():
    edges = _python_edges()
    assert "fsdp" in edges and "runtime" in edges["fsdp"]  # the walk reads imports
    assert _cycles(edges) == []


# README.md's layout: "the leaves: errors imports only _C; options and
# envvars only errors; tensors only _C and errors"
LEAVES = {"errors": {"_C"}, "options": {"errors"}, "envvars": {"errors"},
          "tensors": {"_C", "errors"}}


def test_the_leaves_import_what_the_readme_says():
    edges = _python_edges()
    assert {leaf: edges.get(leaf, set()) for leaf in LEAVES} == LEAVES


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_circle_between_c_headers():
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
    edges, headers = {}, {}
    for dirpath, _, files in os.walk(CSRC):
        for f in files:
            if f.endswith((".h", ".cuh")):
                headers[f] = os.path.join(dirpath, f)
    for name, path in headers.items():
        for inc in include.findall(open(path).read()):
            inc = os.path.basename(inc)
            if inc in headers and inc != name:
                edges.setdefault(name, set()).add(inc)
    assert edges  # the walk reads includes
    assert _cycles(edges) == []


# ---------------------------------------------------------------------------
# C: files that call each other's functions. A room is one source file with
# its own header (csrc/hooks/params.c and params.h); room A depends on room B
# where A includes B's header or calls a function B's source defines. No
# circle between rooms: an event's sequence (csrc/hooks/) is called by the
# types around it (csrc/glue/) and calls down into the engine and the glue's
# translation helpers, never back up.

_C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_C_DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \t\*]*?\b([A-Za-z_]\w*)\s*\([^;{]*\)\s*\{",
                           re.M)
_C_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_C_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _c_rooms():
    """{room: [its files]}, a room being a file's path without its extension
    (an `_internal.h` is its file's own header too)."""
    rooms = {}
    for dirpath, _, files in os.walk(CSRC):
        for f in files:
            if f.endswith((".c", ".h", ".cu", ".cuh")):
                path = os.path.join(dirpath, f)
                room = os.path.splitext(os.path.relpath(path, CSRC))[0].removesuffix("_internal")
                rooms.setdefault(room, []).append(path)
    return rooms


def _c_edges():
    rooms = _c_rooms()
    text = {r: "".join(_C_COMMENT.sub("", open(p).read()) for p in ps) for r, ps in rooms.items()}
    # calls are read in sources only: a header's declaration is not a call
    code = {r: "".join(_C_COMMENT.sub("", open(p).read()) for p in ps if p.endswith((".c", ".cu")))
            for r, ps in rooms.items()}
    header_room, defined_in, defines, declares = {}, {}, {}, {}
    for room, paths in rooms.items():
        for p in paths:
            if p.endswith((".h", ".cuh")):
                header_room.setdefault(os.path.basename(p), set()).add(room)
        defines[room] = set(_C_DEFINITION.findall(code[room]))
        declares[room] = set(_C_CALL.findall("".join(_C_COMMENT.sub("", open(p).read())
                                                     for p in paths if p.endswith(".h"))))
        for name in defines[room]:
            defined_in.setdefault(name, set()).add(room)
    edges = {}
    for room, src in text.items():
        for inc in _C_INCLUDE.findall(src):
            for other in header_room.get(os.path.basename(inc), ()):
                # a source defining what the header declares implements it:
                # its own header (engine/unit_reduce.c and unit.h)
                if other != room and not (defines[room] & declares[other]):
                    edges.setdefault(room, set()).add(other)
        for name in set(_C_CALL.findall(code[room])):
            owners = defined_in.get(name, set())
            if len(owners) == 1 and room not in owners:  # (a name two rooms define: a test's double)
                edges.setdefault(room, set()).add(next(iter(owners)))
    return edges


def test_no_circle_between_c_files():
    edges = _c_edges()
    # the walk reads both kinds of tie: a call (the events call the engine
    # group's bind) and an include (the types include their events' headers)
    assert "glue/py_group" in edges["hooks/shard_events"]
    assert "hooks/shard_events" in edges["glue/py_event"]
    assert _cycles(edges) == []


def test_the_hooks_define_no_type_and_no_module():
    """csrc/hooks/ is C over torch objects: no type object, no module init
    (those are csrc/glue/'s)."""
    for path in _c_rooms():
        if path.startswith("hooks" + os.sep):
            for p in _c_rooms()[path]:
                src = open(p).read()
                assert "PyType_Spec" not in src and "PyModuleDef" not in src, p
