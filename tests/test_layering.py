"""Imports point down the layers: no module imports one from a layer above it, not even inside a function or
under ``if TYPE_CHECKING``.

Every module of ``quantcli/``, ``calibrators/`` and ``exporters/`` is parsed with :mod:`ast` (nothing is
imported); each import is resolved to the module it loads and compared with the importer's layer. A module in
no layer fails too, so a new file has to be placed; so does a cycle (two modules importing each other,
directly or round a loop). The order, bottom-up, is the one docs/architecture.md states.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quantcli", "calibrators", "exporters")

#: bottom-up; a module may import from its own layer and the ones before it. ``pkg.*`` places a whole
# package: one : rule per package (docs/architecture.md states the same order)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("quantcli", "quantcli.lazy", "quantcli.errors", "quantcli.files", "quantcli.defaults")),
    (
        "quant",
        (
            "quantcli.quant",
            "quantcli.quant.*",
            "quantcli.tensor_quant",
            "quantcli.affine",
            "quantcli.descriptor",
        ),
    ),
    ("calibrators", ("calibrators", "calibrators.*")),
    ("nn", ("quantcli.nn", "quantcli.nn.*")),
    ("inputs", ("quantcli.inputs", "quantcli.inputs.*")),
    ("exporters", ("exporters", "exporters.*")),
    ("analysis", ("quantcli.analysis", "quantcli.analysis.*")),
    ("calibration", ("quantcli.calibration", "quantcli.calibration.*")),
    ("verify", ("quantcli.verify", "quantcli.verify.*")),
    ("cli", ("quantcli.cli", "quantcli.cli.*", "quantcli.__main__")),
]

#: package ``__init__`` modules whose attributes load lazily (PEP 562 ``__getattr__``): ``from quantcli import
#: calibrate`` is an import of the module that defines ``calibrate``, and the facade's own ``importlib`` calls
#: are that mechanism, not an edge of the facade (it imports nothing when it loads).
FACADES = {"quantcli": "_LAZY", "calibrators": "_LAZY", "quantcli.cli": "_LAZY"}

#: the import paths the public contract names (DESIGN.md), each the same module object as its
# ``quantcli.quant`` : module; nothing in the repository imports through them
PUBLIC_PATHS = {
    "quantcli.tensor_quant": "quantcli.quant.tensor_quant",
    "quantcli.affine": "quantcli.quant.affine",
}


def layer_of(module: str, layers=LAYERS) -> int | None:
    for i, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lazy_names(source: str, table: str) -> dict[str, str]:
    """The ``name -> module`` table a facade's ``__getattr__`` reads (a dict literal assigned at module
    level)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == table for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return {}


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: importing a module runs its packages' ``__init__`` first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _literal_module(call: ast.Call) -> str | None:
    """``importlib.import_module("x")``, ``__import__("x")``, ``sys.modules.get("x")``: the literal module
    name."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    is_modules_get = (
        name == "get"
        and isinstance(f, ast.Attribute)
        and isinstance(f.value, ast.Attribute)
        and f.value.attr == "modules"
    )
    if name not in ("import_module", "__import__") and not is_modules_get:
        return None
    arg = call.args[0] if call.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _from_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from X import ...`` in ``module`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(
    source: str, module: str, is_package: bool, known: set[str], lazy: dict[str, dict[str, str]]
) -> list[tuple[int, str]]:
    """``(line, module)`` for every module of ours that ``source`` loads, anywhere in the file."""
    out: list[tuple[int, str]] = []
    dynamic = module not in lazy
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, m) for a in node.names if _ours(a.name) for m in _parents(a.name)]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, module, is_package)
            if not _ours(target):
                continue
            out += [(node.lineno, m) for m in _parents(target)]
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in known:  # ``from pkg import submodule``
                    out.append((node.lineno, sub))
                elif a.name in lazy.get(target, {}):  # ``from facade import name``: the module defining it
                    out.append((node.lineno, lazy[target][a.name]))
        elif dynamic and isinstance(node, ast.Call):
            name = _literal_module(node)
            if name and _ours(name):
                out += [(node.lineno, m) for m in _parents(name)]
    return out


def module_edges(
    source: str, module: str, is_package: bool, known: set[str], lazy: dict[str, dict[str, str]]
) -> set[str]:
    """The modules of ours that ``source`` itself names, anywhere in the file: ``from a.b import c`` is an
    edge to ``a.b.c`` where that is a module, else to ``a.b``; a facade's name is an edge to the module
    defining it. The packages a module sits in are not edges of it (Python runs their ``__init__`` first, but
    a package importing its submodules is no cycle)."""
    direct = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            direct |= {a.name for a in node.names if _ours(a.name)}
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, module, is_package)
            if not _ours(target):
                continue
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
            named = {lazy[target][a.name] for a in node.names if a.name in lazy.get(target, {})}
            direct |= subs | named
            if len(subs) + len(named) < len(node.names):
                direct.add(target)
        elif module not in lazy and isinstance(node, ast.Call):
            name = _literal_module(node)
            if name and _ours(name):
                direct.add(name)
    return direct - {module}


def cycles(sources: dict[str, tuple[str, str, bool]]) -> list[list[str]]:
    """Every group of modules that import each other round a loop (Tarjan's strongly connected components)."""
    known = set(sources)
    lazy = {m: lazy_names(sources[m][1], table) for m, table in FACADES.items() if m in sources}
    graph = {
        m: sorted(module_edges(src, m, pkg, known, lazy) & known) for m, (_, src, pkg) in sources.items()
    }
    index, low, stack, on_stack, found = {}, {}, [], set(), []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def violations(sources: dict[str, tuple[str, str, bool]], layers=LAYERS) -> list[str]:
    """``sources``: module -> (path, source, is_package). One message per upward edge or unplaced module."""
    known = set(sources)
    lazy = {m: lazy_names(sources[m][1], table) for m, table in FACADES.items() if m in sources}
    problems = []
    for module, (path, source, is_package) in sorted(sources.items()):
        here = layer_of(module, layers)
        if here is None:
            problems.append(
                f"{path}: module {module} is in no layer; place it in LAYERS "
                f"(tests/test_layering.py) "
                "and docs/architecture.md's layer order"
            )
            continue
        edges = sorted(set(imports_of(source, module, is_package, known, lazy)))
        for line, imported in edges:
            there = layer_of(imported, layers)
            if imported != module and imported not in known:
                problems.append(
                    f"{path}:{line}: {module} imports {imported}, which is not a module of this repository"
                )
            elif there is None:
                continue  # reported once, as a module in no layer
            elif there > here and not _reported_below(imported, line, edges, here, layers):
                problems.append(
                    f"{path}:{line}: {module} ({layers[here][0]}) imports {imported} "
                    f"({layers[there][0]}), a layer above it"
                )
    return problems


def stale_entries(modules, layers=LAYERS) -> list[str]:
    """Entries of the layer map that match no module (a file moved or deleted): the map must stay true."""
    return [
        f"{p!r} ({name})"
        for name, patterns in layers
        for p in patterns
        if not any(fnmatch.fnmatchcase(m, p) for m in modules)
    ]


def _reported_below(package: str, line: int, edges, here: int, layers) -> bool:
    """An upward edge to a package whose submodule, imported on the same line, is reported itself."""
    return any(
        ln == line and m.startswith(package + ".") and (layer_of(m, layers) or 0) > here for ln, m in edges
    )


def repository_sources(root: Path = ROOT) -> dict[str, tuple[str, str, bool]]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            out[module_name(p, root)] = (str(p.relative_to(root)), p.read_text(), p.name == "__init__.py")
    return out


# ------------------------------------------------------------------------------------------------- the tests


def test_every_import_points_down():
    sources = repository_sources()
    assert len(sources) > 60  # the walk found the packages
    problems = violations(sources)
    assert not problems, "imports that point up the layers:\n" + "\n".join(problems)


def test_every_layer_entry_names_a_module():
    assert stale_entries(repository_sources()) == []
    assert stale_entries(
        {"quantcli.quant.arithmetic"}, [("foundation", ("quantcli.quant.arithmetic", "quantcli.gone"))]
    ) == ["'quantcli.gone' (foundation)"]


def _synthetic(**modules: str) -> dict[str, tuple[str, str, bool]]:
    """A small fake repository: module -> source (names ending in ``__init__`` are packages)."""
    out = {}
    for name, source in modules.items():
        pkg = name.endswith(".__init__")
        mod = name.removesuffix(".__init__")
        out[mod] = (mod.replace(".", "/") + ("/__init__.py" if pkg else ".py"), source, pkg)
    return out


def test_control_an_upward_import_is_reported_with_file_line_and_edge():
    src = _synthetic(
        **{
            "quantcli.__init__": "_LAZY = {'calibrate': 'quantcli.calibration.calibrate'}\n",
            "quantcli.quant.arithmetic": "import torch\n\n\ndef f():\n    from exporters.qdq import emit\n  "
            "  return emit\n",
            "quantcli.quant.__init__": "",
            "quantcli.calibration.__init__": "",
            "quantcli.calibration.calibrate": "from quantcli import arithmetic\n",
            "exporters.__init__": "",
            "exporters.qdq": "from quantcli.quant.arithmetic import f\n",
        }
    )
    assert violations(src) == [
        "quantcli/quant/arithmetic.py:5: quantcli.quant.arithmetic (quant) imports exporters.qdq "
        "(exporters), a layer above it",
    ]


def test_control_hidden_upward_imports_are_found():
    """Relative, ``TYPE_CHECKING``, facade, ``importlib`` and ``sys.modules`` imports are edges too."""
    src = _synthetic(
        **{
            "quantcli.__init__": "_LAZY = {'calibrate': 'quantcli.calibration.calibrate'}\n",
            "quantcli.errors": "",
            "quantcli.calibration.__init__": "",
            "quantcli.calibration.calibrate": "",
            "quantcli.nn.__init__": "",
            "quantcli.nn.modules": "import sys\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ..calibration.calibrate import X\n",
            "quantcli.nn.config": "from quantcli import calibrate\n",
            "quantcli.nn.replace": "import "
            "importlib\nimportlib.import_module('quantcli.calibration.calibrate')\n",
            "quantcli.nn.dynamic": "import sys\nd = sys.modules.get('quantcli.calibration.calibrate')\n",
            "exporters.__init__": "",
        }
    )
    problems = violations(src)
    assert [p.split(": ")[0] for p in problems] == [
        "quantcli/nn/config.py:1",
        "quantcli/nn/dynamic.py:2",
        "quantcli/nn/modules.py:4",
        "quantcli/nn/replace.py:2",
    ]
    assert all(
        "imports quantcli.calibration.calibrate (calibration), a layer above it" in p for p in problems
    )


def test_control_unplaced_and_unknown_modules_fail():
    src = _synthetic(
        **{
            "quantcli.__init__": "",
            "quantcli.errors": "",
            "quantcli.newthing": "from quantcli import errors\n",
            "quantcli.calibration.calibrate": "from quantcli.gone import x\n",
        }
    )
    assert violations(src) == [
        "quantcli/calibration/calibrate.py:1: quantcli.calibration.calibrate imports quantcli.gone, which "
        "is not a module of this repository",
        "quantcli/newthing.py: module quantcli.newthing is in no layer; place it in LAYERS "
        "(tests/test_layering.py) and docs/architecture.md's layer order",
    ]


def test_control_downward_and_same_layer_imports_pass():
    src = _synthetic(
        **{
            "quantcli.__init__": "__version__ = '0'\n",
            "quantcli.quant.__init__": "",
            "quantcli.quant.arithmetic": "",
            "quantcli.errors": "",
            "quantcli.cli": "from quantcli import __version__\nfrom exporters import export_onnx\n",
            "exporters.__init__": "def __getattr__(n):\n    from exporters import onnx_export\n",
            "exporters.onnx_export": "from exporters.qdq import emit\nfrom quantcli.errors import E\n",
            "exporters.qdq": "from quantcli import arithmetic as ar\n",
        }
    )
    assert violations(src) == []


def _stated(text: str, layer: str) -> set[str]:
    """The backticked names in the parentheses after ``**layer**``."""
    return set(re.findall(r"`([^`]+)`", text.split(f"**{layer}** (", 1)[1].split(")", 1)[0]))


def _expected(patterns: tuple[str, ...]) -> set[str]:
    """How docs/architecture.md names a layer's entries: a package as its folder, a package's ``__init__``
    that is a layer of its own by its path, a module by its last name."""
    out = set()
    for p in patterns:
        if p.endswith(".*"):
            out.add(p[:-2].replace(".", "/") + "/")
        elif p in PACKAGES:
            if p + ".*" not in patterns:
                out.add(f"{p}/__init__.py")
        elif p + ".*" not in patterns:
            out.add(p.rsplit(".", 1)[1])
    return out


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_architecture_states_the_layer_order():
    stated = " ".join(ARCHITECTURE.read_text().split("Layers, bottom-up:", 1)[1].split("\n\n", 1)[0].split())
    positions = [stated.find(f"**{name}**") for name, _ in LAYERS]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), stated
    for name, patterns in LAYERS:
        assert _stated(stated, name) == _expected(patterns), name


def test_architecture_layout_names_every_module():
    """Each file is in the layout table: by its path, or by its name in the row of its directory."""
    rows = [
        line
        for line in ARCHITECTURE.read_text().split("## Layout", 1)[1].splitlines()
        if line.startswith("| ")
    ]
    missing = []
    for path, _, is_package in repository_sources().values():
        if is_package and path not in ("quantcli/__init__.py",):
            continue
        folder, name = path.rsplit("/", 1)
        if not any(f"`{path}`" in row or (f"`{folder}/`" in row and f"`{name}`" in row) for row in rows):
            missing.append(path)
    assert missing == []


def test_no_import_cycles():
    """Function-local imports included: two modules that need each other are one concept or a missing
    third."""
    assert cycles(repository_sources()) == []


def test_control_cycles_are_found_through_local_and_from_imports():
    src = _synthetic(
        **{
            "quantcli.__init__": "",
            "quantcli.nn.__init__": "from quantcli.nn.replace import quantize_model\n",
            "quantcli.nn.fold_bn": "def f():\n    from quantcli.nn.modes import m\n",
            "quantcli.nn.modes": "from quantcli.nn import replace\n",
            "quantcli.nn.replace": "from quantcli.nn.fold_bn import fold\nfrom quantcli.nn.config import C\n",
            "quantcli.nn.config": "from quantcli.nn import replace\n",
            "quantcli.inputs.loading": "def g():\n    from quantcli.inputs.hf_model import h\n",
            "quantcli.inputs.hf_model": "from quantcli.inputs.loading import ModelSpec\n",
            "quantcli.inputs.data": "from quantcli.inputs import loading\n",
        }
    )
    assert cycles(src) == [
        ["quantcli.inputs.hf_model", "quantcli.inputs.loading"],
        ["quantcli.nn.config", "quantcli.nn.fold_bn", "quantcli.nn.modes", "quantcli.nn.replace"],
    ]
    # a package importing its submodules, and submodules importing the package's siblings, is no cycle
    del src["quantcli.nn.fold_bn"], src["quantcli.nn.config"], src["quantcli.inputs.hf_model"]
    src["quantcli.nn.replace"] = ("quantcli/nn/replace.py", "from quantcli.nn.modes import m\n", False)
    src["quantcli.nn.modes"] = ("quantcli/nn/modes.py", "from quantcli.nn.tensor_quantizer import T\n", False)
    assert cycles(src) == []


def test_public_paths_are_their_quant_modules_and_unused_inside():
    """``quantcli.tensor_quant`` and ``quantcli.affine`` (the contract's import paths) are the very modules
    that define the ops, and no module of the repository imports through them."""
    import importlib

    for public, defining in PUBLIC_PATHS.items():
        assert importlib.import_module(public) is importlib.import_module(defining), public
    sources = repository_sources()
    known = set(sources)
    lazy = {m: lazy_names(sources[m][1], table) for m, table in FACADES.items() if m in sources}
    users = sorted(
        m
        for m, (_, src, pkg) in sources.items()
        if m not in PUBLIC_PATHS and module_edges(src, m, pkg, known, lazy) & set(PUBLIC_PATHS)
    )
    assert users == []
