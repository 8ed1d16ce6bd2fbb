"""``paddle_mgrad.threadstate``: per-thread state with declared defaults."""

import ast
import os
import threading

import pytest

from helpers import ROOT
from paddle_mgrad.threadstate import thread_state


def test_fields_start_as_declared_in_every_thread_and_stay_per_thread():
    st = thread_state("Probe", pack=None, depth=0)
    assert (st.pack, st.depth) == (None, 0)
    st.depth = 3
    seen = []

    def other():
        seen.append((st.pack, st.depth))  # this thread's own fields: the defaults
        st.depth = 7

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [(None, 0)]
    assert st.depth == 3  # the other thread's assignment stayed there
    assert type(st).__name__ == "Probe" and isinstance(st, threading.local)
    with pytest.raises(AttributeError):
        st.undeclared  # noqa: B018 -- a field nobody declared is still an error


def test_a_mutable_default_is_refused():
    """A default is one object shared by every thread: a list would be written by all."""
    with pytest.raises(TypeError, match=r"thread_state\(Probe\): default stack=\[\] is mutable"):
        thread_state("Probe", stack=[])


def test_the_package_declares_every_thread_local():
    """No plain ``threading.local()`` in the package: reading a field a thread never set from
    one raises and catches an AttributeError inside every ``getattr(..., default)``."""
    found = []
    for root, _, names in os.walk(os.path.join(ROOT, "paddle_mgrad")):
        for n in names:
            if not n.endswith(".py"):
                continue
            path = os.path.join(root, n)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "local"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "threading"
                ):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert found == []
