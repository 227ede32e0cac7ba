"""The layers the README's architecture table names, bottom up: a module imports only its own layer and those below
it, and no import cycle exists. Imports inside functions count: a cycle hidden in a function is still a cycle.

Inside `apps/`, each app folder is independent: it imports no other app, only the shared app code named in SHARED_APP_CODE
(which imports no app itself), and no loop runs between app folders."""

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("forge", "rl", "losses", "actors", "apps", "bench")
# What the apps share, and the only app code one app folder may import from outside itself; each imports no app.
SHARED_APP_CODE = {
    "apps.app_config": "an app's config loaded, `model: tiny` resolved, its check step run",
    "apps.config_reference": "config dataclasses rendered as the --help and docs reference",
    "apps.run_checkpoints": "a job's checkpoints and the `checkpoint` section (GRPO and SFT)",
    "apps.held_out": "the held-out evaluator (eval, SFT, GRPO, the warm start)",
    "apps.http": "what the HTTP apps share (the REST service and the gateway)",
    "apps.warm_start": "the supervised warm start (GRPO, the HTTP apps' model, their configs)",
}
# A module an app folder may import from another app: its public client, as any program outside forge would. (Spelt
# in parts: tests/test_markers.py takes a test file naming an app's entry point for one that starts the app.)
PUBLIC_APP_MODULES = {".".join(("apps", "server", "client")): "the REST service's client SDK (no torch or Monarch), "
                                                               "which the examples use"}


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


def _app_folder(module: str) -> str | None:
    """`apps.sft.config` -> `apps.sft`; a module directly in apps/ is a folder of its own (`apps.app_config`);
    None outside apps/."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "apps" and len(parts) > 1 else None


def _shared(module: str) -> bool:
    return any(module == s or module.startswith(s + ".") for s in SHARED_APP_CODE)


def _app_imports(graph: dict[str, set[str]], public: Iterable[str] = PUBLIC_APP_MODULES) -> list[str]:
    """Every import from one app folder into another that is not of shared app code (or a `public` client module),
    and every import of an app by shared app code."""
    bad = []
    for module, targets in sorted(graph.items()):
        here = _app_folder(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = _app_folder(target)
            if there is None or there == here:
                continue
            allowed = _shared(target) or (target in public and not _shared(module))
            if not allowed:
                bad.append(f"{module} imports {target}")
    return bad


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """app folder -> the app folders it imports (shared code's folders included)."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = _app_folder(module)
        if here is not None:
            folders.setdefault(here, set()).update(
                t for t in map(_app_folder, targets) if t is not None and t != here)
    for targets in list(folders.values()):
        for t in targets:
            folders.setdefault(t, set())
    return folders


def test_every_shared_app_module_exists():
    graph = _import_graph()
    assert [s for s in [*SHARED_APP_CODE, *PUBLIC_APP_MODULES] if s not in graph] == []


def test_no_app_imports_another_app_only_the_shared_app_code():
    assert _app_imports(_import_graph()) == []


def test_no_loop_between_app_folders():
    assert _cycles(_folder_graph(_import_graph())) == []


def test_the_app_checks_see_an_import_between_apps_and_a_loop():
    graph = {"apps.one.main": {"apps.two.checkpoints", "apps.run_checkpoints", "rl.types"},
             "apps.two.checkpoints": set(), "apps.run_checkpoints": set(), "rl.types": set(),
             "apps.warm_start.supervised": {"apps.one.data"}, "apps.one.data": set(),
             "apps.three.loop": {"apps.two.sdk"}, "apps.two.sdk": set(), "apps.held_out.evaluate": {"apps.two.sdk"}}
    assert _app_imports(graph, public=["apps.two.sdk"]) == ["apps.held_out.evaluate imports apps.two.sdk",
                                                            "apps.one.main imports apps.two.checkpoints",
                                                            "apps.warm_start.supervised imports apps.one.data"]
    graph["apps.one.data"] = {"apps.two.rollouts"}
    graph["apps.two.rollouts"] = {"apps.warm_start.supervised"}
    assert _cycles(_folder_graph(graph)) == [["apps.one", "apps.two", "apps.warm_start"]]
