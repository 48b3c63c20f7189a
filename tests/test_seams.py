"""No seams (shared/design.md): mixbit's product code uses its dependencies through their public
APIs. It assigns nothing into another package's modules or classes, swaps no object's class,
matches no source text, reads no private attribute of another package's objects, imports no
private name, and steers no computation through thread-locals. Read from the source (AST), so a
seam anywhere in server/, quant/ or models/ fails here, whether or not a test runs through it."""

from __future__ import annotations

import ast

import pytest

from .conftest import ROOT

PRODUCT = ("server", "quant", "models")
OWN = ("mixbit", ".")  # imports from these are mixbit's own modules
# Thread-locals that hold per-thread resources, never read to decide what to compute: output
# buffers the kernels reuse, and the MLX stream of each worker thread (MLX streams are per thread).
THREAD_LOCALS = {("models/kernels/__init__.py", "_scratch"), ("server/deps.py", "_THREAD")}


def _files():
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _names(tree) -> tuple[set, set]:
    """Names bound to mixbit's own modules, and to other packages' modules, by imports."""
    own, foreign = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                (own if a.name.startswith("mixbit") else foreign).add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            mine = node.level > 0 or (node.module or "").startswith(OWN)
            for a in node.names:
                (own if mine else foreign).add(a.asname or a.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            fn = node.value.func
            if isinstance(fn, ast.Attribute) and fn.attr == "import_module":
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        foreign.add(t.id)
    return own, foreign


def _base(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def seams(rel: str, tree) -> list[str]:
    own, foreign = _names(tree)
    found = []

    def at(node, what):
        found.append(f"{rel}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith(OWN):
            for a in node.names:
                if a.name.startswith("_"):
                    at(node, f"imports the private name {a.name} from {node.module}")
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "__class__":
                at(node, "swaps an object's class")
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in foreign:
                at(node, f"assigns into {t.value.id}, another package's module or class")
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("setattr", "delattr") and node.args and _base(node.args[0]) in foreign:
                at(node, f"{name} on another package's module or class")
            if name in ("delattr",):
                at(node, "deletes an attribute of an object")
            if name == "getsource" or name == "getsourcelines":
                at(node, "reads source text")
            if name == "local" and isinstance(fn, ast.Attribute) and _base(fn) == "threading":
                continue  # judged at the assignment below
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            fn = node.value.func
            if isinstance(fn, ast.Attribute) and fn.attr == "local" and _base(fn) == "threading":
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if not {(rel, n) for n in names} <= THREAD_LOCALS:
                    at(node, "a thread-local")
        # a module object taken out of sys.modules (to change it); `name in sys.modules` and
        # sys.modules.setdefault(name, None) (Python's way to mark a module absent) only ask or
        # block an import
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "modules" and _base(node.value) == "sys":
            at(node, "reaches into sys.modules")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "modules" \
                and _base(node.func.value) == "sys":
            at(node, "reaches into sys.modules")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = _base(node.value)
            if base not in ("self", "cls") and base not in own:
                at(node, f"reads the private attribute {node.attr}")
    return found


def test_no_seams_in_product_code():
    found = [s for rel, tree in _files() for s in seams(rel, tree)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("code,what", [
    ("import mlx_lm.generate as g\ng.mx = None", "assigns into"),
    ("import importlib\nm = importlib.import_module('mlx_lm.models.qwen3_5')\nm.nn = None", "assigns into"),
    ("x.__class__ = int", "swaps an object's class"),
    ("import inspect\ninspect.getsource(f)", "reads source text"),
    ("import threading\nflags = threading.local()", "a thread-local"),
    ("gen._currently_processing", "private attribute"),
    ("from mlx_lm.models.cache import _BaseCache", "private name"),
    ("import sys\nsys.modules['x'].nn = 1", "sys.modules"),
    ("import sys\nm = sys.modules.get(name)", "sys.modules"),
    ("delattr(tok, '_vocab')", "deletes an attribute"),
])
def test_the_seams_check_finds_each_kind(code, what):
    assert any(what in s for s in seams("x.py", ast.parse(code))), code


def test_the_seams_check_leaves_own_and_public_code_alone():
    code = ("from . import kernels\nfrom .layers import project\nimport mlx.core as mx\n"
            "class A:\n    def f(self):\n        self._x = 1\n        return kernels._qkernel, mx.array(1)\n")
    assert seams("x.py", ast.parse(code)) == []
