"""The package's structure (docs/design.md, "Map"): what each folder may import, no import cycles,
short signatures. Reads the source; imports nothing of the package."""

import ast
import os
import re
from typing import Dict, Set

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_zeco")
OPERATORS = ("gla", "gated_delta_rule", "kda")
# The main job and what only it uses.
JOB = {"megatron_zeco.train", "megatron_zeco.recall", "megatron_zeco.checkpoint"} | {
    f"megatron_zeco.training{m}" for m in ("", ".arguments", ".initialize", ".model", ".training", ".checkpointing")}


def _modules() -> Dict[str, str]:
    """``{dotted module name: path}`` of every module of the package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` in ``package`` names, relative levels resolved."""
    base = node.module or ""
    if not node.level:
        return base
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))


def _imports(module: str) -> Set[str]:
    """The package's modules ``module`` imports, anywhere in it (function-level imports too)."""
    tree = ast.parse(open(MODULES[module]).read())
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: no import at run time
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _imported_package_modules(path: str, package: str):
    """``(line, dotted name)`` of every import of the package's modules in ``path``."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            yield node.lineno, base
            if base in MODULES and MODULES[base].endswith("__init__.py"):  # a name of the package or a module
                defined = open(MODULES[base]).read()
                yield from ((node.lineno, f"{base}.{a.name}") for a in node.names
                            if f"{base}.{a.name}" in MODULES or not re.search(rf"\b{a.name}\b", defined))
            elif base in MODULES:  # a name a module defines at its top level
                defined = _top_level_names(MODULES[base])
                yield from ((node.lineno, f"{base}.{a.name}") for a in node.names
                            if defined is not None and a.name != "*" and a.name not in defined)


def _top_level_names(path: str):
    """The names a module binds at its top level (None where it has a module ``__getattr__``)."""
    names = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With, ast.If, ast.Try)):
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
            names.update(n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
            names.update((a.asname or a.name).split(".")[0] for n in ast.walk(node)
                         if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names)
    return None if "__getattr__" in names else names


def test_every_import_of_the_package_names_a_module_that_exists():
    """Imports inside functions run only on some paths (a Megatron-Core version, a GPU): a moved module
    or a removed name must not leave one behind, in the package, its tests, benchmarks or examples."""
    root = os.path.dirname(PACKAGE)
    files = {path: (m if path.endswith("__init__.py") else m.rpartition(".")[0]) for m, path in MODULES.items()}
    for folder in ("tests", "benchmarks", "examples"):
        for where, _, names in os.walk(os.path.join(root, folder)):
            files.update({os.path.join(where, n): "" for n in names if n.endswith(".py")})
    missing = [f"{os.path.relpath(path, root)}:{line}: {name}" for path, package in sorted(files.items())
               for line, name in _imported_package_modules(path, package)
               if name.split(".")[0] == "megatron_zeco" and name not in MODULES]
    assert not missing, "imports of modules or names that do not exist:\n" + "\n".join(missing)


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles():
    """No module reaches itself through the package's imports (a package's __init__ re-exporting its
    own modules aside: an __init__ imports its children, a child that imports its package's __init__
    would close a cycle and is caught)."""
    state: Dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for n in sorted(GRAPH[m]):
            if m.startswith(n + "."):  # a module's own package: its __init__ runs first anyway
                continue
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else path + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


# What each folder may import from the package (beyond itself).
ALLOWED = {
    "kernels": set(),
    "common": set(),
    "comm": {"kernels"},
    "cp": {"comm", "common", "kernels"},
    "mcore": {"comm", "common", "cp", "kernels"},
}
for _op in OPERATORS:
    ALLOWED[_op] = {"comm", "common", "cp", "kernels", "mcore"}


def test_each_folder_imports_only_what_lies_below_it():
    """kernels and common import nothing of ours; comm only kernels;
    cp never an operator, Megatron glue or the main job; an operator never another operator; mcore never an
    operator."""
    bad = []
    for m, deps in GRAPH.items():
        folder = _folder(m)
        if folder not in ALLOWED:
            continue
        for d in deps:
            if _folder(d) != folder and _folder(d) not in ALLOWED[folder]:
                bad.append(f"{m} imports {d}")
    assert not bad, bad


def test_operators_use_megatron_only_in_their_layer():
    """An operator's math, local op and CP function import neither megatron-core nor the Megatron glue;
    only its layer does."""
    bad = []
    for m, path in MODULES.items():
        if _folder(m) in OPERATORS and not m.endswith(".layer"):
            source = open(path).read()
            if "megatron.core" in source or any(_folder(d) == "mcore" for d in GRAPH[m]):
                bad.append(m)
    assert not bad, bad


def test_nothing_imports_the_main_job():
    """train, training/, recall and checkpoint are the main job's: no layer, operator or spec imports them."""
    bad = [f"{m} imports {d}" for m, deps in GRAPH.items() if m not in JOB for d in deps if d in JOB]
    assert not bad, bad


# Functions with many parameters by design: the public operator functions (fla's and Megatron's
# conventions, every keyword a user sets) and the Triton kernels and their launchers (one argument
# per kernel argument).
PUBLIC_OPS = {"zeco_gla", "zeco_gated_delta_rule", "zeco_kda", "chunk_gla", "chunk_gated_delta_rule", "chunk_kda"}
# Triton kernels and their launchers, which take what the kernels take (as fla's do); the delta rules'
# float64 correction mirrors its kernels' signatures.
KERNEL_MODULES = {"megatron_zeco.kernels.scan_hop", "megatron_zeco.gla.kernels", "megatron_zeco.kernels.delta_correction",
                  "megatron_zeco.kernels.delta_reference"}


def test_no_function_takes_more_than_eight_parameters():
    """Outside the public operator functions and the Triton kernels, a function takes at most 8
    parameters (``self``, ``cls`` and autograd's ``ctx`` not counted; ``*args`` and ``**kwargs`` not
    counted): knobs travel as one resolved object (``CPConfig``, ``CPPlan``, ``Route``, ``Call``)."""
    bad = []
    for m, path in MODULES.items():
        if m in KERNEL_MODULES:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in PUBLIC_OPS:
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls", "ctx")]
                if len(names) > 8:
                    bad.append(f"{m}.{node.name}: {len(names)}")
    assert not bad, bad


def test_the_gpu_extra_installs_the_pinned_fla():
    """setup.py's ``gpu`` extra installs the fla-core release the GPU paths are pinned to."""
    setup = open(os.path.join(os.path.dirname(PACKAGE), "setup.py")).read()
    pinned = ast.literal_eval(next(line.split("=", 1)[1].strip() for line in
                                   open(os.path.join(PACKAGE, "common", "backend.py"))
                                   if line.startswith("FLA_VERSION =")))
    assert f'"fla-core=={pinned}"' in setup, pinned
