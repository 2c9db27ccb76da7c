"""The package's layout, checked statically (no import runs): no import cycles, the library core apart from the
applications and the test support, kernel modules independent of the layers above them and of each other's private
names. Every import counts, also one inside a function: a lazy import only hides a cycle until the day it runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "megamoe"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import statement of the module, resolved to modules of the
    package (a name that is a submodule counts as an import of that submodule)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # (under ``if TYPE_CHECKING:``: never runs, annotations only)
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "megamoe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[:len(base) - node.level + 1]
                target = ".".join(up + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "megamoe":
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out += [(s, []) for s in subs]
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest or not subs:
                out.append((target, rest))
    return out


def _graph() -> dict[str, set[str]]:
    return {name: {dep for dep, _ in _imports(name, path) if dep in MODULES and dep != name}
            for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # and resolves what it checks: relative imports and submodules named in a from-import
    deps = dict(_imports("megamoe.comm", MODULES["megamoe.comm"]))
    assert "megamoe.comm.combine" in deps and "megamoe.kernels.interpreter" in deps


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (every import counts, also inside functions): {cycles}"


def _layer(name: str) -> str:
    if name == "megamoe.__main__":  # (``python -m megamoe``: the command line)
        return "apps"
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("apps", "testing", "kernels", "comm", "backends") else "core"


def test_layers_import_downwards():
    # the library (core, comm, kernels, backends) never imports the applications or the test support; kernels
    # import no layer above them (experts, backends, the layer); comm needs no backend
    bad = []
    for name, deps in _graph().items():
        layer = _layer(name)
        for dep in deps:
            if layer not in ("apps", "testing") and _layer(dep) in ("apps", "testing"):
                bad.append(f"{name} -> {dep}")
            if layer == "kernels" and (_layer(dep) == "backends" or dep in ("megamoe.experts", "megamoe.layer")):
                bad.append(f"{name} -> {dep}")
            if layer == "comm" and _layer(dep) == "backends":
                bad.append(f"{name} -> {dep}")
    assert not bad, f"imports against the layering: {bad}"


def test_no_private_names_across_modules():
    # a module takes only public names from another (a private one shared is a public one in disguise: give it a
    # name, or move it to the module both use)
    bad = [f"{name}: {', '.join(n for n in names if n.startswith('_'))} from {dep}"
           for name, path in MODULES.items() for dep, names in _imports(name, path)
           if dep != name and any(n.startswith("_") for n in names)]
    assert not bad, f"private names imported from another module: {bad}"


#: lines the package may hold: a guard against regrowth at its present size; the goal is 12,000
PACKAGE_LINES = 12_223


def test_size():
    # the package stays small enough to read: at most PACKAGE_LINES lines, no module over 900
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert sum(lines.values()) <= PACKAGE_LINES, f"{sum(lines.values())} lines in megamoe/"
    big = {name: n for name, n in lines.items() if n > 900}
    assert not big, f"modules over 900 lines: {big}"


def test_front_page():
    # the README is a front page: at most 15 KB, and no commit hashes (results are named by path, history is git's)
    text = (PKG.parent / "README.md").read_text()
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes"
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not hashes, f"commit hashes in README.md: {hashes}"
    perf = (PKG.parent / "docs" / "performance.md").read_text()
    assert len(perf.encode()) < 40_000, f"docs/performance.md is {len(perf.encode())} bytes: current figures only"


def test_mutation_sites_exist():
    # tools/mutate.py plants its bugs at exact snippets: a refactor that moves one must move the mutation with it,
    # or the check stops at its first run instead of testing anything
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("megamoe_mutate", PKG.parent / "tools" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mutate  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mutate)
        assert len(mutate.check_sites(PKG.parent, mutate.MUTATIONS)) >= 1
    finally:
        del sys.modules[spec.name]
