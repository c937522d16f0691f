"""No value made on the host and uploaded in ToMe's hot path: the source guard the CPU can run.

On a CUDA tensor, ``t[index] = True`` (or ``= 0.5``) makes its value as a host tensor on purpose, and
``index_put_`` then copies it to the device: a pageable upload and a ``cudaStreamSynchronize`` per line, per
forward (two in every DiT merge forward on an H100, 1.6 ms each on Flux). On the CPU and on the ``meta`` device the
same line makes its value on the device, and ``torch.cuda.set_sync_debug_mode`` does not flag it, so no CPU run can
see it happen. This test reads the source instead: every ``tome_core`` module that runs at model-call time, for an
indexed write of a Python number onto anything that may be a tensor, and for a tensor built from Python values
directly on a device (``torch.tensor(..., device=...)``). Device values are written with ``index_fill_``,
``masked_fill``, ``scatter_`` or ``torch.where`` with a scalar operand (a kernel argument, never an upload).

Writes into Python containers are fine; a name is known to be one where the same function binds it to a list,
dict or set display or constructor, or annotates it as one.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tome_core"
# code that never runs inside a model call: the user's A/B tool and the command line
NOT_HOT = {"__main__.py", "_version.py"}
CONTAINER_CALLS = {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter"}
CONTAINER_HINTS = ("dict", "list", "set", "Dict", "List", "Set", "MutableMapping", "Mapping")


def hot_modules() -> List[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if p.name not in NOT_HOT and "compare" not in p.parts and not p.name.startswith("compare"))


def _is_host_scalar(node: ast.AST) -> bool:
    """A Python number or bool: a literal, its negation, or float()/int()/bool() of a literal ("inf")."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (bool, int, float)) and node.value is not None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_host_scalar(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("float", "int", "bool"):
        return all(isinstance(a, ast.Constant) for a in node.args)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math":
        return node.attr in ("inf", "pi", "e", "nan")
    return False


def _container_value(node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _container_value(node.left) or _container_value(node.right)
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        return name in CONTAINER_CALLS
    return False


def _annotated_container(annotation: ast.AST) -> bool:
    return annotation is not None and any(hint in ast.unparse(annotation) for hint in CONTAINER_HINTS)


def _bound_to_containers(tree: ast.AST, kind: type) -> Set[str]:
    """The names (``kind`` ast.Name) or attributes (ast.Attribute: ``self.reached = [False]``) that ``tree`` binds
    to a Python container, by value or by annotation."""
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        value = getattr(node, "value", None)
        container = value is not None and _container_value(value) or \
            isinstance(node, ast.AnnAssign) and _annotated_container(node.annotation)
        names.update((t.id if kind is ast.Name else t.attr) for t in targets if isinstance(t, kind) and container)
    return names


def _containers(function: ast.AST) -> Set[str]:
    """Names the function binds to a Python container: its arguments annotated as one, ``**kwargs``, and its own
    assignments."""
    names = _bound_to_containers(function, ast.Name)
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        arguments = function.args
        names.update(arg.arg for arg in arguments.args + arguments.kwonlyargs + arguments.posonlyargs
                     if _annotated_container(arg.annotation))
        if arguments.kwarg is not None:
            names.add(arguments.kwarg.arg)
    return names


def _container_attributes(tree: ast.Module) -> Set[str]:
    """Attributes the module ever sets to a Python container (``self.reached = [False]``)."""
    return _bound_to_containers(tree, ast.Attribute)


def _scopes(node: ast.AST, outer: Set[str]) -> Iterator[Tuple[ast.AST, Set[str]]]:
    """Every function with the container names it sees: its own and its enclosing functions'."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            seen = outer | _containers(child)
            yield child, seen
            yield from _scopes(child, seen)
        else:
            yield from _scopes(child, outer)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope`` outside the functions nested in it (those are scopes of their own)."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield child
        yield from _own_nodes(child)


def _base(target: ast.Subscript, attributes: Set[str], containers: Set[str]) -> bool:
    """Whether an indexed write's base is a known Python container."""
    value = target.value
    while isinstance(value, ast.Subscript):
        value = value.value
    if isinstance(value, ast.Name):
        return value.id in containers
    return isinstance(value, ast.Attribute) and value.attr in attributes


def host_made_values(source: str) -> List[Tuple[int, str]]:
    """(line, code) of every indexed write of a Python number onto a possible tensor, and every tensor built from
    Python values on a device, in ``source``."""
    tree = ast.parse(source)
    attributes, found = _container_attributes(tree), set()
    for scope, containers in [(tree, _containers(tree))] + list(_scopes(tree, _containers(tree))):
        for node in _own_nodes(scope):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Subscript) and _is_host_scalar(node.value) \
                            and not _base(target, attributes, containers):
                        found.add((node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.tensor", "torch.as_tensor") \
                    and any(k.arg == "device" for k in node.keywords):
                found.add((node.lineno, ast.unparse(node)))
    return sorted(found)


@pytest.mark.parametrize("path", hot_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_value_is_made_on_the_host_and_uploaded_in_the_hot_path(path):
    found = host_made_values(path.read_text(encoding="utf-8"))
    assert not found, (f"{path.relative_to(ROOT.parent)}: a value made on the host and copied to the device (a "
                       f"sync per call on CUDA); use index_fill_/masked_fill/scatter_/torch.where with the scalar: "
                       + "; ".join(f"line {line}: {code}" for line, code in found))


@pytest.mark.parametrize("code, flagged", [
    ("def f(t, i):\n    t[i] = True\n", True),
    ("def f(t, i):\n    t[i] = -float('inf')\n", True),
    ("def f(t, i):\n    t[i:] += 1\n", True),
    ("def f(d: dict, i):\n    d[i] = True\n", False),
    ("def f(i):\n    seen = [False]\n    seen[0] = True\n", False),
    ("def f(i):\n    shape = [1] * 3\n    shape[i] = -1\n", False),
    ("def f(t, i, v):\n    t[i] = v\n", False),  # a tensor value: a device copy at most
    ("def f(x):\n    return torch.tensor(0.0, device=x.device)\n", True),
    ("def f(x):\n    return torch.tensor([1, 2])\n", False),  # built and kept on the host
    ("def f(t, i):\n    t.index_fill_(0, i, True)\n", False),
    ("def f(seen: List[bool]):\n    def g():\n        seen[0] = True\n    return g\n", False),
    ("class P:\n    def __init__(self):\n        self.hit = [False]\ndef f(p):\n    p.hit[0] = True\n", False),
    ("def f(p):\n    p.mask[0] = True\n", True),
])
def test_the_guard_flags_what_it_should(code, flagged):
    assert bool(host_made_values(code)) == flagged
