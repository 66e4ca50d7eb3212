"""The package's shape, checked from its source: no import cycles, no private names imported
across modules, no hidden (function-level) imports between our own modules outside the CLI,
the wings of ``parallel/`` imported one way, functions short, and nothing stored on the model's
modules under ``shardlm_*`` names."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardlm"
# the CLI imports each command's modules inside its function, so ``shardlm --help`` does not pay
# for torch and transformers (its module docstring says so)
LAZY_ALLOWED = {"shardlm.cli"}
# the packages in dependency order: each imports only from those before it (and itself)
LAYERS = ["errors", "config", "data", "distributed", "parallel", "checkpoint", "train", "preflight", "estimate", "cli"]
# the wings of ``parallel/`` in dependency order; the wings of one layer never import each other
# (inference and the runtime styles meet only in the builder); ``build`` and ``__init__`` on top
PARALLEL_LAYERS = [{"model"}, {"plan"}, {"infer", "runtime", "weights"}, {"build"}]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def imports(name: str, tree: ast.Module, known: set[str]):
    """(imported shardlm module, imported names, at module level?) for each import of ``tree``."""
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardlm"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in known else node.module  # ``from pkg import module`` or a name
                yield target, (alias.name if target == node.module else None), id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardlm"):
                    yield alias.name, None, id(node) in top


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        for target, _, _ in imports(name, tree, known):
            if target != name and target in known:
                edges[name].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    edges = graph()
    assert len(edges) > 20
    cycle = find_cycle({m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()})
    assert cycle is None, " -> ".join(cycle)


def test_packages_depend_one_way():
    def layer(module: str) -> int:
        parts = module.split(".")
        return LAYERS.index(parts[1]) if len(parts) > 1 else len(LAYERS)  # the package root: on top

    for module, targets in graph().items():
        for target in targets:
            assert layer(target) <= layer(module), f"{module} imports {target}, a later layer"


def parallel_wing(module: str) -> tuple[int, str]:
    """(layer, wing) of a module of ``shardlm.parallel``: its subpackage, or the entry points on top."""
    wing = module.split(".")[2] if module.count(".") >= 2 else "__init__"
    found = [i for i, wings in enumerate(PARALLEL_LAYERS) if wing in wings]
    return (found[0] if found else len(PARALLEL_LAYERS)), wing


def test_parallel_wings_depend_one_way():
    parallel = {m: ts for m, ts in graph().items() if m.startswith("shardlm.parallel.")}
    assert {parallel_wing(m)[1] for m in parallel} >= {w for ws in PARALLEL_LAYERS for w in ws}
    wings = {f"shardlm.parallel.{w}" for ws in PARALLEL_LAYERS for w in ws}
    loose = {m for m in parallel if m.count(".") == 2} - wings  # the builder is a wing of its own
    assert not loose, f"loose files in parallel/ besides its entry points: {sorted(loose)}"
    for module, targets in parallel.items():
        layer, wing = parallel_wing(module)
        for target in targets:
            if not target.startswith("shardlm.parallel."):
                continue
            t_layer, t_wing = parallel_wing(target)
            assert t_layer < layer or t_wing == wing, f"{module} ({wing}) imports {target} ({t_wing})"


def test_no_private_names_cross_modules_and_no_hidden_imports():
    mods = modules()
    known = set(mods)
    for name, tree in mods.items():
        for target, imported, top_level in imports(name, tree, known):
            assert not (imported or "").startswith("_"), f"{name} imports private {target}.{imported}"
            assert top_level or name in LAZY_ALLOWED, f"{name} imports {target} inside a function"


def test_nothing_is_stored_on_modules_under_shardlm_names():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                assert not node.attr.startswith("shardlm_"), f"{path.name}:{node.lineno} sets .{node.attr}"


MAX_FUNCTION_LINES = 80
JUSTIFIED = ("long", "one piece", "kept whole")  # a docstring saying why a function stays long


def test_functions_are_short_unless_their_docstring_says_why():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                doc = (ast.get_docstring(node) or "").lower()
                if lines > MAX_FUNCTION_LINES and not any(word in doc for word in JUSTIFIED):
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines without a docstring saying why: " + ", ".join(long)
