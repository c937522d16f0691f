"""The house's rules, read from the source: layers, the arrows between them, and no cycles.

tome_core/engine imports torch and itself only; the catalogue builds on the engine; each adapter on the
engine and the catalogue, never on another adapter; the public API (tome_core/__init__) on all of them; the users'
tools (tome_core/tools) on the public API only, and only the command line hands over to them; nothing in tome_core
imports the benchmark (tome_bench).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tome_core"
STDLIB = set(sys.stdlib_module_names)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, top_level_only: bool) -> set:
    """Absolute module names ``path`` imports (relative imports resolved); module level only if asked."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # "from . import merge"
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("engine", "catalogue", "tools"):
        return parts[1]
    if len(parts) > 2 and parts[1] == "adapters":
        return f"adapters.{parts[2]}"
    return "api"  # tome_core/__init__, __main__, _version, tome_core.adapters itself


ALLOWED = {"engine": {"engine"}, "catalogue": {"engine", "catalogue"}}


def own_imports(module: str, top_level_only: bool = False) -> set:
    """The tome_core modules ``module`` imports."""
    return {name for name in imports_of(MODULES[module], top_level_only) if name in MODULES}


def test_every_arrow_points_down_the_layers():
    wrong = []
    for module in MODULES:
        source = layer(module)
        for target in own_imports(module):
            target_layer = layer(target)
            allowed = ALLOWED.get(source)
            if source.startswith("adapters."):
                allowed = {"engine", "catalogue", source}
            if allowed is not None and target_layer not in allowed and target not in ("tome_core", "tome_core.adapters"):
                wrong.append(f"{module} ({source}) -> {target} ({target_layer})")
    assert wrong == []


def test_the_engine_imports_torch_and_itself_only():
    outside = {name.split(".")[0] for module in MODULES if layer(module) == "engine"
               for name in imports_of(MODULES[module], top_level_only=False)} - STDLIB - {"torch", "tome_core", "__future__"}
    assert outside == set()


def test_no_module_imports_a_host_or_the_benchmark():
    hosts = {"comfy", "comfy_api", "comfy_extras", "server", "diffusers", "modules", "ldm", "sgm", "gradio",
             "tome_bench", "nodes", "tome_webui", "tomesd", "invokeai", "tome_invokeai"}
    found = {(module, name) for module, path in MODULES.items() for name in imports_of(path, top_level_only=False)
             if name.split(".")[0] in hosts}
    # `python -m tome_core compare` loads the user's diffusers pipeline: diffusers imported on use, in its loader only
    loader = {(module, name) for module, name in found if module == "tome_core.tools.compare.load"}
    assert loader and {name.split(".")[0] for _, name in loader} == {"diffusers"}
    # the command line's `python -m tome_core bench` hands over to the benchmark: the one arrow to it
    assert found - loader == {("tome_core.__main__", "tome_bench.cli"), ("tome_core.__main__", "tome_bench.cli.main")}


def test_the_tools_stand_on_the_public_api_and_nothing_below_imports_them():
    """A user's tool (``python -m tome_core compare``) uses what any user's script may: the public API; the engine,
    the catalogue, the adapters and the public API never import it; the command line hands over to it on use."""
    tools = {module for module in MODULES if layer(module) == "tools"}
    assert "tome_core.tools.compare.command" in tools
    below = {target for module in tools for target in own_imports(module)} - tools
    assert below == {"tome_core", "tome_core._version"}
    users = {(module, target) for module in MODULES if module not in tools for target in own_imports(module)
             if target in tools}
    assert users == {("tome_core.__main__", "tome_core.tools.compare")}
    assert not own_imports("tome_core.__main__", top_level_only=True) & tools  # on use: `import tome_core` skips it


def test_no_import_cycles():
    """None at module level, nor through an import made on use inside a function (a circle all the same: the binding
    types once reached the catalogue that lists them that way, and the speed check the plan that asks it)."""
    graph = {module: own_imports(module) - {module} for module in MODULES}
    visiting, done, cycles = set(), set(), []

    def visit(module, trail):
        if module in done:
            return
        if module in visiting:
            cycles.append(trail[trail.index(module):] + [module])
            return
        visiting.add(module)
        for target in sorted(graph[module]):
            # a package's __init__ importing its own submodules is how a package is built, not a cycle
            if not target.startswith(module + "."):
                visit(target, trail + [target])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    assert cycles == []


def test_the_layers_are_where_the_architecture_says():
    assert {layer(m) for m in MODULES} == {"api", "engine", "catalogue", "adapters.hooks", "adapters.model_patcher",
                                           "adapters.wanvideo", "tools"}
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for folder in ("tome_core/engine", "tome_core/catalogue", "tome_core/adapters/hooks",
                   "tome_core/adapters/model_patcher", "tome_core/adapters/wanvideo", "tome_core/tools", "tome_bench",
                   "nodes", "tome_webui", "tome_invokeai"):
        assert folder in doc, folder


def test_units_a_reader_can_hold():
    """No function of the product (engine, catalogue, adapters, entry points, benchmark) is over 80 lines."""
    long = []
    for folder in ("tome_core", "tome_bench", "nodes", "tome_webui", "tome_invokeai", "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert long == []


def test_the_binding_types_know_nothing_of_the_catalogue_that_lists_them():
    """diffusers_dits and comfy_dits are types and readers; finding a model's binding reads the catalogue
    (diffusers_lookup, comfy_lookup), and the speed check never asks for the plan that asks it."""
    catalogue = {"tome_core.catalogue.families", "tome_core.catalogue.diffusers_lookup", "tome_core.catalogue.comfy_lookup"}
    for binding in ("tome_core.catalogue.diffusers_dits", "tome_core.catalogue.comfy_dits",
                    "tome_core.catalogue.invoke_dits"):
        assert not own_imports(binding) & catalogue, binding
    assert "tome_core.engine.plan" not in own_imports("tome_core.engine.speed_check")


def test_one_call_plan_serves_every_dit_adapter():
    """The per-call work of both DiT modes lives once, in the engine (engine/call_plan.py): each host's per-call
    mechanism routes to it, and the matching and its set-up (``match_grid``) are called from that one place."""
    per_call = ("tome_core.adapters.hooks.dit_call", "tome_core.adapters.model_patcher.dit_call",
                "tome_core.adapters.wanvideo.state")
    for module in per_call:
        assert "tome_core.engine.call_plan" in own_imports(module), module
    callers = sorted(module for module, path in MODULES.items() if module != "tome_core.engine.token_merge"
                     and any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                             == "match_grid" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))))
    assert callers == ["tome_core.engine.call_plan"]
