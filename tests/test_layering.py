"""Imports point down the layers: no module imports one from a layer above it, not even inside a function or
under ``if TYPE_CHECKING``.

Every module of ``quantcli/``, ``calibrators/`` and ``exporters/`` is parsed with :mod:`ast` (nothing is
imported); each import is resolved to the module it loads and compared with the importer's layer. A module in no
layer fails too, so a new file has to be placed. The order, bottom-up, is the one the README states.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quantcli", "calibrators", "exporters")

#: bottom-up; a module may import from its own layer and the ones before it. ``pkg.*`` places a whole package.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("quantcli", "quantcli.lazy", "quantcli.quant.arithmetic", "quantcli.errors", "quantcli.files")),
    ("calibrators", ("calibrators", "calibrators.*")),
    ("descriptors", ("quantcli.quant.descriptor", "quantcli.quant.granularity", "quantcli.quant.formats")),
    ("quantize ops", ("quantcli.quant.tensor_quant", "quantcli.quant.qdq", "quantcli.quant.affine")),
    ("nn", ("quantcli.nn", "quantcli.nn.*")),
    ("inputs", ("quantcli.inputs.loading", "quantcli.inputs.data", "quantcli.inputs.hf_model", "quantcli.inputs.whole_module", "quantcli.inputs.trust",
                "quantcli.inputs.text_data", "quantcli.inputs.image_data")),
    ("exporters", ("exporters", "exporters.*")),
    ("workflows", ("quantcli.calibration.calibrate", "quantcli.calibration.job", "quantcli.inputs.checkpoint", "quantcli.calibration.smoothquant", "quantcli.calibration.process_group",
                   "quantcli.calibration.gptq", "quantcli.calibration.awq", "quantcli.calibration.weight_rounding",
                   "quantcli.inputs.shard", "quantcli.analysis.quality", "quantcli.analysis.sensitivity", "quantcli.calibration.mixed_precision", "quantcli.calibration.latency_placement",
                   "quantcli.analysis.analyze", "quantcli.analysis.report_html", "quantcli.analysis.inspect", "quantcli.verify",
                   "quantcli.verify.*")),
    ("cli", ("quantcli.cli", "quantcli.__main__")),
]

#: package ``__init__`` modules whose attributes load lazily (PEP 562 ``__getattr__``): ``from quantcli import
#: calibrate`` is an import of the module that defines ``calibrate``, and the facade's own ``importlib`` calls
#: are that mechanism, not an edge of the facade (it imports nothing when it loads).
FACADES = {"quantcli": "_LAZY"}


def layer_of(module: str, layers=LAYERS) -> int | None:
    for i, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lazy_names(source: str, table: str) -> dict[str, str]:
    """The ``name -> module`` table a facade's ``__getattr__`` reads (a dict literal assigned at module level)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == table for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: importing a module runs its packages' ``__init__`` first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _literal_module(call: ast.Call) -> str | None:
    """``importlib.import_module("x")``, ``__import__("x")``, ``sys.modules.get("x")``: the literal module name."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    is_modules_get = (name == "get" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute)
                      and f.value.attr == "modules")
    if name not in ("import_module", "__import__") and not is_modules_get:
        return None
    arg = call.args[0] if call.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_of(source: str, module: str, is_package: bool, known: set[str],
               lazy: dict[str, dict[str, str]]) -> list[tuple[int, str]]:
    """``(line, module)`` for every module of ours that ``source`` loads, anywhere in the file."""
    out: list[tuple[int, str]] = []
    dynamic = module not in lazy
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, m) for a in node.names if _ours(a.name) for m in _parents(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
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


def violations(sources: dict[str, tuple[str, str, bool]], layers=LAYERS) -> list[str]:
    """``sources``: module -> (path, source, is_package). One message per upward edge or unplaced module."""
    known = set(sources)
    lazy = {m: lazy_names(sources[m][1], table) for m, table in FACADES.items() if m in sources}
    problems = []
    for module, (path, source, is_package) in sorted(sources.items()):
        here = layer_of(module, layers)
        if here is None:
            problems.append(f"{path}: module {module} is in no layer; place it in LAYERS (tests/test_layering.py) "
                            "and the README's layer order")
            continue
        edges = sorted(set(imports_of(source, module, is_package, known, lazy)))
        for line, imported in edges:
            there = layer_of(imported, layers)
            if imported != module and imported not in known:
                problems.append(f"{path}:{line}: {module} imports {imported}, which is not a module of this repository")
            elif there is None:
                continue  # reported once, as a module in no layer
            elif there > here and not _reported_below(imported, line, edges, here, layers):
                problems.append(f"{path}:{line}: {module} ({layers[here][0]}) imports {imported} "
                                f"({layers[there][0]}), a layer above it")
    return problems


def stale_entries(modules, layers=LAYERS) -> list[str]:
    """Entries of the layer map that match no module (a file moved or deleted): the map must stay true."""
    return [f"{p!r} ({name})" for name, patterns in layers for p in patterns
            if not any(fnmatch.fnmatchcase(m, p) for m in modules)]


def _reported_below(package: str, line: int, edges, here: int, layers) -> bool:
    """An upward edge to a package whose submodule, imported on the same line, is reported itself."""
    return any(ln == line and m.startswith(package + ".") and (layer_of(m, layers) or 0) > here for ln, m in edges)


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
    assert stale_entries({"quantcli.quant.arithmetic"}, [("foundation", ("quantcli.quant.arithmetic", "quantcli.gone"))]) == [
        "'quantcli.gone' (foundation)"]


def _synthetic(**modules: str) -> dict[str, tuple[str, str, bool]]:
    """A small fake repository: module -> source (names ending in ``__init__`` are packages)."""
    out = {}
    for name, source in modules.items():
        pkg = name.endswith(".__init__")
        mod = name.removesuffix(".__init__")
        out[mod] = (mod.replace(".", "/") + ("/__init__.py" if pkg else ".py"), source, pkg)
    return out


def test_control_an_upward_import_is_reported_with_file_line_and_edge():
    src = _synthetic(**{
        "quantcli.__init__": "_LAZY = {'calibrate': 'quantcli.calibration.calibrate'}\n",
        "quantcli.quant.arithmetic": "import torch\n\n\ndef f():\n    from exporters.qdq import emit\n    return emit\n",
        "quantcli.calibration.calibrate": "from quantcli import arithmetic\n",
        "exporters.__init__": "",
        "exporters.qdq": "from quantcli.quant.arithmetic import f\n",
    })
    assert violations(src) == [
        "quantcli/quant/arithmetic.py:5: quantcli.quant.arithmetic (foundation) imports exporters.qdq (exporters), "
        "a layer above it",
    ]


def test_control_hidden_upward_imports_are_found():
    """Relative, ``TYPE_CHECKING``, facade, ``importlib`` and ``sys.modules`` imports are edges too."""
    src = _synthetic(**{
        "quantcli.__init__": "_LAZY = {'calibrate': 'quantcli.calibration.calibrate'}\n",
        "quantcli.errors": "",
        "quantcli.calibration.calibrate": "",
        "quantcli.nn.__init__": "",
        "quantcli.nn.modules": "import sys\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from ..calibration import X\n",
        "quantcli.nn.config": "from quantcli import calibrate\n",
        "quantcli.nn.replace": "import importlib\nimportlib.import_module('quantcli.calibration.calibrate')\n",
        "quantcli.nn.dynamic": "import sys\nd = sys.modules.get('quantcli.calibration.calibrate')\n",
        "exporters.__init__": "",
    })
    problems = violations(src)
    assert [p.split(": ")[0] for p in problems] == [
        "quantcli/nn/config.py:1", "quantcli/nn/dynamic.py:2", "quantcli/nn/modules.py:4", "quantcli/nn/replace.py:2"]
    assert all("imports quantcli.calibration.calibrate (workflows), a layer above it" in p for p in problems)


def test_control_unplaced_and_unknown_modules_fail():
    src = _synthetic(**{
        "quantcli.__init__": "",
        "quantcli.errors": "",
        "quantcli.newthing": "from quantcli import errors\n",
        "quantcli.calibration.calibrate": "from quantcli.gone import x\n",
    })
    assert violations(src) == [
        "quantcli/calibration/calibrate.py:1: quantcli.calibration.calibrate imports quantcli.gone, which is not a module of this "
        "repository",
        "quantcli/newthing.py: module quantcli.newthing is in no layer; place it in LAYERS "
        "(tests/test_layering.py) and the README's layer order",
    ]


def test_control_downward_and_same_layer_imports_pass():
    src = _synthetic(**{
        "quantcli.__init__": "__version__ = '0'\n",
        "quantcli.quant.arithmetic": "",
        "quantcli.errors": "",
        "quantcli.cli": "from quantcli import __version__\nfrom exporters import export_onnx\n",
        "exporters.__init__": "def __getattr__(n):\n    from exporters import onnx_export\n",
        "exporters.onnx_export": "from exporters.qdq import emit\nfrom quantcli.errors import E\n",
        "exporters.qdq": "from quantcli import arithmetic as ar\n",
    })
    assert violations(src) == []


def _stated(text: str, layer: str) -> set[str]:
    """The backticked names in the parentheses after ``**layer**``."""
    return set(re.findall(r"`([^`]+)`", text.split(f"**{layer}** (", 1)[1].split(")", 1)[0]))


def _expected(patterns: tuple[str, ...]) -> set[str]:
    """How the README names a layer's entries: a package as its folder, a module by its last name."""
    out = set()
    for p in patterns:
        if p.endswith(".*"):
            out.add(p[:-2].replace(".", "/") + "/")
        elif p not in PACKAGES and p + ".*" not in patterns:
            out.add(p.rsplit(".", 1)[1])
    return out


def test_readme_states_the_layer_order():
    stated = " ".join((ROOT / "README.md").read_text().split("Layers, bottom-up:", 1)[1].split("\n\n", 1)[0].split())
    positions = [stated.find(f"**{name}**") for name, _ in LAYERS]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), stated
    for name, patterns in LAYERS:
        assert _stated(stated, name) == _expected(patterns), name


def test_readme_layout_names_every_module():
    """Each file is in the layout table: by its path, or by its name in the row of its directory."""
    rows = [line for line in (ROOT / "README.md").read_text().split("## Layout", 1)[1].splitlines()
            if line.startswith("| ")]
    missing = []
    for path, _, is_package in repository_sources().values():
        if is_package:
            continue
        folder, name = path.rsplit("/", 1)
        if not any(f"`{path}`" in row or (f"`{folder}/`" in row and f"`{name}`" in row) for row in rows):
            missing.append(path)
    assert missing == []


def test_moved_names_still_import_from_their_old_modules():
    """What moved down a layer is re-exported where it was, as the same object."""
    import importlib

    moved = {
        "exporters.qdq": ("quantcli.quant.qdq", ["QdqSpec", "constant_value", "symmetric_spec", "affine_spec", "e4m3_spec",
                                           "check_opset", "emit", "symmetric_qdq", "symmetric_quantize", "affine_qdq",
                                           "e4m3_qdq", "int32_bias_dq"]),
        "exporters.formats": ("quantcli.quant.formats", ["OnnxQuantType", "INT8", "UINT8", "INT4", "UINT4", "INT16", "UINT16",
                                                   "FP8_E4M3", "INT32", "ALL", "BY_ELEM_TYPE", "BY_NAME",
                                                   "BLOCKED_MIN_OPSET", "MIN_OPSET", "integer_type", "emitted_type",
                                                   "format_name", "required_opset"]),
        "exporters.custom_ops": ("quantcli.quant.qdq", ["export_amax"]),
        "exporters.dynamic_linear": ("quantcli.nn.dynamic", ["weight_spec", "dynamic_linear_symbolic"]),
        "quantcli.quant.tensor_quant": ("quantcli.quant.arithmetic", ["affine_qparams"]),
    }
    for old, (new, names) in moved.items():
        a, b = importlib.import_module(old), importlib.import_module(new)
        assert [n for n in names if getattr(a, n, None) is not getattr(b, n)] == [], old
