"""The layers the README's architecture table names, bottom up: a module imports only its own layer and those below
it, and no import cycle exists. Imports inside functions count: a cycle hidden in a function is still a cycle."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("forge", "rl", "losses", "actors", "apps", "bench")


def _layers() -> list[str]:
    """The README table's folders that are Python packages, bottom up."""
    folders = re.findall(r"^\| `(\w+)/` \|", (ROOT / "README.md").read_text(), flags=re.M)
    return [f for f in folders if (ROOT / f / "__init__.py").exists()]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source."""
    files = {_module_name(f): f for p in PACKAGES for f in (ROOT / p).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from package import module` imports the module; `from module import name`, the module
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in files]
                candidates = submodules if len(submodules) == len(node.names) else [base, *submodules]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in files:  # `import a.b.c` imports a.b.c or its nearest package
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_readme_names_the_layers_bottom_up():
    assert _layers() == ["forge", "rl", "losses", "actors", "apps", "bench", "tests"]


def test_no_module_imports_a_layer_above_its_own():
    rank = {layer: i for i, layer in enumerate(_layers())}
    upward = [f"{module} imports {target}" for module, targets in sorted(_import_graph().items())
              for target in sorted(targets) if rank[target.split(".")[0]] > rank[module.split(".")[0]]]
    assert upward == []


def test_no_import_cycle_not_even_inside_a_function():
    assert _cycles(_import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle_hidden_in_a_function():
    graph = _import_graph()
    assert "forge.provisioner" in graph["forge.service"]  # a top-level import is seen
    assert "actors.engines.hf" in graph["actors.engines"]  # one inside a function too
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
