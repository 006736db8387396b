"""docs/reference.md cannot drift from the code: it is regenerated here and
compared, every argument of every public callable is described in its
docstring, and every FLATSHARD_* environment variable the sources read is in
the documented table."""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import make_reference  # noqa: E402


def test_reference_is_current():
    with open(make_reference.OUT) as f:
        current = f.read()
    assert make_reference.comparable(make_reference.render()) == \
        make_reference.comparable(current), \
        "docs/reference.md is stale: run python docs/make_reference.py"


def test_every_argument_is_described():
    assert make_reference.undocumented_arguments() == []


def test_every_public_name_has_a_docstring():
    bare = [q for q, o in make_reference.public_objects()
            if not isinstance(o, make_reference.ALIAS) and not make_reference.doc_of(o)
            and not make_reference.dataclasses.is_dataclass(o)]
    assert bare == []


def test_every_environment_variable_is_documented():
    from flatshard.envvars import ENV
    used = set()
    sources = glob.glob(os.path.join(ROOT, "python", "flatshard", "**", "*.py"), recursive=True)
    for path in sources + [os.path.join(ROOT, "setup.py")]:
        used |= set(re.findall(r"\bFLATSHARD_[A-Z][A-Z0-9_]*\b", open(path).read()))
    assert used == set(ENV), (sorted(used - set(ENV)), sorted(set(ENV) - used))
