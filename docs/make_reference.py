"""Generate docs/reference.md from the code: every public name of `flatshard`
(its `__all__`) and of `flatshard.optim`, with signatures, defaults, fields
and docstrings; every environment variable (flatshard/envvars.py); every
command-line tool (`python -m flatshard ... --help`).

    python docs/make_reference.py            rewrite docs/reference.md
    python docs/make_reference.py --check    exit 1 if docs/reference.md is stale

tests/test_reference.py runs the check, and also that every argument of every
public callable is described in its docstring.
"""
import argparse
import dataclasses
import enum
import inspect
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "reference.md")


def public_objects():
    """(qualified name, object) for everything the reference documents, in order."""
    import flatshard
    import flatshard.optim as fopt
    out, seen = [], set()
    # An alias (FSDP) is documented once, under the object's own name.
    for n in sorted(flatshard.__all__, key=lambda n: getattr(getattr(flatshard, n), "__name__",
                                                                 n) != n):
        if n in versioned("torch.distributed.fsdp"):
            continue
        o = getattr(flatshard, n)
        out.append((f"flatshard.{n}", ALIAS(o) if id(o) in seen else o))
        seen.add(id(o))
    out.sort(key=lambda qo: flatshard.__all__.index(qo[0].split(".")[-1]))
    names = getattr(fopt, "__all__", None) or [n for n in ("AdamW", "Adam", "SGD")
                                               if hasattr(fopt, n)]
    for n in names:
        o = getattr(fopt, n)
        if id(o) not in seen:
            out.append((f"flatshard.optim.{n}", o))
            seen.add(id(o))
    return out


class ALIAS:
    """Another public name for an object documented under its own name."""

    def __init__(self, obj):
        self.obj = obj


def torch_own(obj):
    """Whether obj is torch's own class, re-exported (the FSDP2 policies,
    DataParallelMeshDims, FlatParameter): documented by the installed torch,
    whose fields and text change with its version, so the reference names it
    and does not copy it."""
    return isinstance(obj, type) and (obj.__module__ or "").startswith("torch.")


def _default_text(value):
    """A default as the reference writes it: torch's own option objects built
    with no arguments as `Name()` (their repr lists fields a torch version may
    add), anything else as its repr."""
    cls = type(value)
    if torch_own(cls) and dataclasses.is_dataclass(cls):
        try:
            if value == cls():
                return f"{cls.__name__}()"
        except TypeError:
            pass
    return repr(value)


def _ann(a):
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else inspect.formatannotation(a)


def signature_lines(name, obj):
    """`name(arg=default, ...)`, one argument per line when it is long."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return [name + "(...)"]
    params = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        text = str(p.replace(annotation=inspect.Parameter.empty))
        if p.default is not p.empty:
            text = text.partition("=")[0] + "=" + _default_text(p.default)
        ann = _ann(p.annotation)
        if ann:
            head, eq, rest = text.partition("=")
            text = f"{head}: {ann}" + (f" = {rest}" if eq else "")
        params.append(text)
    one = f"{name}({', '.join(params)})"
    if len(one) <= 96:
        return [one]
    return [f"{name}("] + [f"    {p}," for p in params] + [")"]


def versioned(where):
    """Names flatshard has only where the installed torch has them
    (torch_facts.VERSIONED): left out of the generated text, which would
    otherwise change with torch; VERSIONED_NOTE names them."""
    from flatshard import torch_facts
    return {n for w, n in torch_facts.VERSIONED if w == where}


def versioned_note():
    from flatshard import torch_facts
    names = ", ".join(f"`{n}`" if w == "torch.distributed.fsdp" else f"`{w}.{n}`"
                      for w, n in torch_facts.VERSIONED)
    return ("torch 2.15's FSDP2 names, present in flatshard exactly where the installed "
            f"torch has them (`flatshard.torch_facts.VERSIONED`): {names}. They are described "
            "in fsdp2.md (torch 2.15's additions) and their docstrings, and left out below, "
            "whose text does not change with the installed torch.")


def own_methods(cls):
    """Public methods defined by flatshard classes (not inherited from torch)."""
    out = []
    skip = versioned("FSDPModule")
    for klass in cls.__mro__:
        if not klass.__module__.startswith("flatshard"):
            continue
        for n, v in vars(klass).items():
            if n.startswith("_") or n in {m for m, _ in out} or n in skip:
                continue
            f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            f = inspect.unwrap(f) if callable(f) else f  # torch wraps Optimizer.step
            if inspect.isfunction(f):
                out.append((n, f))
    return sorted(out)


def doc_of(obj):
    doc = inspect.getdoc(obj) or ""
    if dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
        return ""  # the generated one: the fields table says it better
    if isinstance(obj, type) and issubclass(obj, enum.Enum) and doc.startswith("Create a collection"):
        return ""
    return doc


def section(qual, obj):
    short = qual.split(".")[-1]
    lines = [f"### `{qual}`", ""]
    if isinstance(obj, ALIAS):
        return lines + [f"The same object as `flatshard.{obj.obj.__name__}`.", ""]
    if torch_own(obj):
        path = obj.__module__ if obj.__module__.startswith("torch.distributed.fsdp.") and \
            not hasattr(__import__("torch.distributed.fsdp").distributed.fsdp, obj.__name__) \
            else "torch.distributed.fsdp"
        return lines + [f"torch's own `{path}.{obj.__name__}`, re-exported: its fields and "
                        "documentation are the installed torch's "
                        f"(`help({path}.{obj.__name__})`).", ""]
    if isinstance(obj, type) and issubclass(obj, BaseException):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        lines += ["```python", f"class {short}({bases})", "```", ""]
    elif isinstance(obj, type) and issubclass(obj, enum.Enum):
        lines += ["| member | value |", "|---|---|"]
        lines += [f"| `{m.name}` | `{m.value!r}` |" for m in obj]
        lines.append("")
    elif dataclasses.is_dataclass(obj):
        lines += ["| field | type | default |", "|---|---|---|"]
        for f in dataclasses.fields(obj):
            if f.default is not dataclasses.MISSING:
                default = repr(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = f"{f.default_factory.__name__}()"
            else:
                default = "required"
            lines.append(f"| `{f.name}` | `{_ann(f.type)}` | `{default}` |")
        lines.append("")
    elif isinstance(obj, type):
        lines += ["```python", "class " + "\n".join(signature_lines(short, obj.__init__)), "```",
                  ""]
    elif callable(obj):
        lines += ["```python", "\n".join(signature_lines(short, obj)), "```", ""]
    doc = doc_of(obj)
    if doc:
        lines += [doc, ""]
    if isinstance(obj, type) and not issubclass(obj, (BaseException, enum.Enum)):
        for n, f in own_methods(obj):
            lines += [f"#### `{short}.{n}`", "", "```python",
                      "\n".join(signature_lines(n, f)), "```", ""]
            d = inspect.getdoc(f)
            if d:
                lines += [d, ""]
    return lines


def cli_help():
    """What `python -m flatshard --help` and each command's --help print at
    100 columns: the same parser's help texts, made in this process."""
    from flatshard.__main__ import _parser
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse reads the width when it formats
    try:
        parser = _parser()
        top = parser.format_help()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        lines = ["```text", "$ python -m flatshard --help", top.rstrip(), "```", ""]
        for cmd in re.findall(r"^    (\w+)\s", top, flags=re.M):
            lines += ["```text", f"$ python -m flatshard {cmd} --help",
                      commands.choices[cmd].format_help().rstrip(), "```", ""]
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return lines


def render():
    from flatshard.envvars import ENV
    lines = ["# flatshard reference", "",
             "Generated from the code by `python docs/make_reference.py`; "
             "tests/test_reference.py fails when this file and the code differ. "
             "For how the pieces fit, see design.md; for how to use them, guide.md.", "",
             "## Python API", "", versioned_note(), ""]
    for qual, obj in public_objects():
        lines += section(qual, obj)
    lines += ["## Environment variables", "",
              "Arguments always win over the environment; a malformed value is a "
              "`ConfigError` naming the variable.", "",
              "| variable | default | effect |", "|---|---|---|"]
    lines += [f"| `{k}` | `{d}` | {e} |" for k, (d, e) in sorted(ENV.items())]
    lines += ["", "## Command line", ""] + cli_help()
    return "\n".join(lines).rstrip() + "\n"


def undocumented_arguments():
    """'qualname: arg' for every argument no docstring mentions (by name)."""
    missing = []
    for qual, obj in public_objects():
        if isinstance(obj, ALIAS) or torch_own(obj) or (
                isinstance(obj, type) and issubclass(obj, (BaseException, enum.Enum))):
            continue
        if dataclasses.is_dataclass(obj):
            targets = [(qual, obj, [f.name for f in dataclasses.fields(obj)])]
        elif isinstance(obj, type):
            targets = [(qual, obj.__init__, None)]
            targets += [(f"{qual}.{n}", f, None) for n, f in own_methods(obj)]
        else:
            targets = [(qual, obj, None)]
        for name, fn, names in targets:
            doc = (inspect.getdoc(fn) or "") + "\n" + (inspect.getdoc(obj) or "")
            if names is None:
                try:
                    sig = inspect.signature(fn)
                except (TypeError, ValueError):
                    continue
                names = [p.name for p in sig.parameters.values()
                         if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL,
                                                                             p.VAR_KEYWORD)]
            missing += [f"{name}: {a}" for a in names
                        if not re.search(r"(?<![\w.])" + re.escape(a) + r"(?!\w)", doc)]
    return missing


def comparable(text):
    """The reference as the check compares it: exact, but for the spacing of
    the command-line help, which argparse lays out differently from Python
    3.13 on (the same words, columns and line breaks moved)."""
    head, sep, cli = text.partition("\n## Command line\n")
    return head + sep + re.sub(r"\s+", " ", cli)


def main():
    ap = argparse.ArgumentParser(description="generate docs/reference.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = ap.parse_args()
    text = render()
    if args.check:
        current = open(OUT).read() if os.path.exists(OUT) else ""
        if comparable(current) != comparable(text):
            print("docs/reference.md is stale: run python docs/make_reference.py")
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
