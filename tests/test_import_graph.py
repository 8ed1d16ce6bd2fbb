"""The package's import graph: every import statement between paddle_mgrad modules (module
level or inside a function) is an arrow.  The arrows must form no loop, and they must run one
way through the wings (:data:`WINGS`, top to bottom): the doctor may import everything, the
bottom modules nothing above them."""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "paddle_mgrad")


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path, name, modules):
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` depends on pkg.sub alone (pkg/__init__ runs, but Python runs
            # it for any import of pkg.x); `from pkg import name` depends on pkg
            targets = [
                f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
            ]
        else:
            continue
        for t in targets:
            # an import of a.b.c depends on the deepest paddle_mgrad module it names
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _package_files():
    """``{module name: path}`` for every ``.py`` file of the package."""
    files = {}
    for root, _, names in os.walk(PKG):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(root, n)
                files[_module_name(p)] = p
    return files


def import_graph():
    files = _package_files()
    return {m: _imports(p, m, files) for m, p in files.items()}


def _find_cycle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state:
                c = visit(d)
                if c:
                    return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


#: The wings, top to bottom: (rank, wing, module prefixes).  An arrow may run down to a higher
#: rank, or stay inside its own wing; one between two wings of the same rank (linear and
#: recomputation know nothing of each other) or back up fails.
WINGS = (
    (0, "entry", ("paddle_mgrad.__main__",)),
    (1, "diagnostics", ("paddle_mgrad.diagnostics",)),
    # what a user calls: the package's API, the .pth start-up activation, the trainer helpers
    (2, "front", ("paddle_mgrad", "paddle_mgrad.autoload", "paddle_mgrad.trainer")),
    (3, "switch", ("paddle_mgrad.switch",)),
    (4, "fleet", ("paddle_mgrad.fleet",)),
    (5, "linear", ("paddle_mgrad.linear", "paddle_mgrad.routing")),
    (5, "recomputation", ("paddle_mgrad.recomputation",)),
    (6, "autograd", ("paddle_mgrad.autograd",)),
    (7, "ops", ("paddle_mgrad.ops",)),
    # what every wing uses; they import only each other (and the standard library / Paddle)
    (
        8,
        "bottom",
        (
            "paddle_mgrad.registry",
            "paddle_mgrad.stats",
            "paddle_mgrad.errors",
            "paddle_mgrad._compat",
            "paddle_mgrad.env",
            "paddle_mgrad._cli",
            "paddle_mgrad.threadstate",
        ),
    ),
)


def wing(module, wings=WINGS):
    """``(rank, wing)`` of ``module``: the wing whose prefix names it most exactly."""
    best = None
    for rank, name, prefixes in wings:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), rank, name)
    return None if best is None else best[1:]


def arrows_against_the_wings(graph, wings=WINGS):
    """Every arrow ``a -> b`` that runs up the wing order or across between two wings of one
    rank, as readable lines; modules in no wing are reported too (place a new module)."""
    bad = []
    for a in sorted(graph):
        wa = wing(a, wings)
        if wa is None:
            bad.append(f"{a} is in no wing: add it to WINGS")
            continue
        for b in sorted(graph[a]):
            wb = wing(b, wings)
            if wb is None or wb[1] == wa[1]:
                continue  # b is reported as a module of its own
            if wb[0] <= wa[0]:
                bad.append(f"{a} ({wa[1]}, rank {wa[0]}) -> {b} ({wb[1]}, rank {wb[0]})")
    return bad


def test_imports_run_one_way_through_the_wings():
    graph = import_graph()
    assert (
        "paddle_mgrad.fleet.overlap_linear" in graph and "paddle_mgrad.diagnostics.doctor" in graph
    )
    assert "paddle_mgrad.linear" in graph["paddle_mgrad.fleet.overlap_linear"]  # edges are seen
    bad = arrows_against_the_wings(graph)
    assert not bad, "imports against the wing order:\n" + "\n".join(bad)


def test_function_local_imports_are_arrows_too():
    # switch.enable imports the registry inside the function: that arrow is in the graph
    assert "paddle_mgrad.registry" in import_graph()["paddle_mgrad.switch"]


def test_wing_checker_finds_arrows_back_up_and_across():
    wings = ((0, "top", ("p.top",)), (1, "a", ("p.a",)), (1, "b", ("p.b",)), (2, "low", ("p",)))
    assert wing("p.a.x", wings) == (1, "a") and wing("p.stats", wings) == (2, "low")
    ok = {"p.top": {"p.a", "p.low"}, "p.a": {"p.a.x", "p.low"}, "p.a.x": set(), "p.low": set()}
    assert arrows_against_the_wings(ok, wings) == []
    assert arrows_against_the_wings({"p.low": {"p.a"}}, wings) == [
        "p.low (low, rank 2) -> p.a (a, rank 1)"
    ]
    assert arrows_against_the_wings({"p.a": {"p.b"}}, wings) == [
        "p.a (a, rank 1) -> p.b (b, rank 1)"
    ]
    assert arrows_against_the_wings({"q.x": set()}, wings) == ["q.x is in no wing: add it to WINGS"]


def test_package_import_graph_is_acyclic():
    graph = import_graph()
    assert "paddle_mgrad.registry" in graph and "paddle_mgrad.recomputation.api" in graph
    # package __init__ files re-export their children: edges from a package to its own
    # submodules are how Python packages work, not loops
    for m in graph:
        graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    cycle = _find_cycle(graph)
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_loop():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _borrowed_private_names():
    """``(importer, module, name)`` for each ``from m import _name`` between wings, where
    ``_name`` is not itself a module (private modules such as ``ops._build`` are imported by
    the doctor on purpose)."""
    files = _package_files()
    out = []
    for name, path in sorted(files.items()):
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = (
                package.split(".")[: len(package.split(".")) - (node.level - 1)]
                if node.level
                else []
            )
            mod = (
                ".".join(base + ([node.module] if node.module else []))
                if node.level
                else node.module
            )
            if mod not in files or wing(mod) == wing(name):
                continue
            out += [
                (name, mod, a.name)
                for a in node.names
                if a.name.startswith("_")
                and not a.name.startswith("__")
                and f"{mod}.{a.name}" not in files
            ]
    return out


def test_no_wing_borrows_another_wings_private_names():
    # the fleet linears call linear's named internal interface (linear.INTERNAL), not its
    # underscore helpers
    assert _borrowed_private_names() == []
    import importlib

    linear = importlib.import_module("paddle_mgrad.linear")
    assert all(callable(getattr(linear, n)) for n in linear.INTERNAL)
    assert not set(linear.INTERNAL) & set(linear.__all__)
