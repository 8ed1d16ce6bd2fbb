"""No import loops inside the package: every import statement (module level or inside a
function) between paddle_mgrad modules, as a graph, must be acyclic."""
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
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # an import of a.b.c depends on the deepest paddle_mgrad module it names
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph():
    files = {}
    for root, _, names in os.walk(PKG):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(root, n)
                files[_module_name(p)] = p
    return {m: _imports(p, m, files) for m, p in files.items()}


def _find_cycle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
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
