"""The layout rules of ``kernels/`` (the ``specpilot.kernels`` package), checked on the source:

* no module imports another module's private (``_name``) names, by ``from`` import or attribute;
* the import graph inside ``kernels/`` (function-level imports included) has no cycle;
* no module of the installed package imports ``lab``;
* every measured table entry names a known kernel and valid config fields, and the W12 routing
  rules name known kernels;
* no dead knobs: every field of a production kernel config is set to a value other than its
  default by some table entry or by the kernel's default-config heuristic.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels"
PACKAGE = {"specpilot_cli": "specpilot", "probes": "specpilot.probes", "kernels": "specpilot.kernels",
           "auditors": "specpilot.auditors", "reports": "specpilot.reports", "engine": "specpilot.engine",
           "bundles": "specpilot.bundles"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(KERNELS).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["specpilot.kernels", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(KERNELS.rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str, path: Path, modules: dict) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``path``; a ``from X import
    y`` where ``X.y`` is a module counts as an import of that module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, path.name == "__init__.py", node)
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    out.append((f"{target}.{a.name}", None, node.lineno))
                else:
                    out.append((target, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
    return out


def test_no_private_name_is_imported_across_kernel_modules():
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases = {}   # local name -> kernels module, for attribute access
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path.name == "__init__.py", node)
                for a in node.names:
                    if f"{target}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
                    elif a.name.startswith("_") and target.startswith("specpilot.kernels") and a.name != "__future__":
                        bad.append(f"{path.relative_to(REPO)}:{node.lineno} imports {target}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases
                    and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} uses {aliases[node.args[0].id]}.{node.args[1].value}")
    assert not bad, "\n".join(bad)


def test_the_kernel_import_graph_has_no_cycle():
    modules = _modules()
    graph = {m: sorted({t for t, _, _ in _imports(m, p, modules) if t in modules and t != m})
             for m, p in modules.items()}
    # a package's __init__ is imported before its submodules run, so a submodule importing its own
    # package (e.g. ``from specpilot.kernels.decode import gemv_w12``) is resolved in the loop above
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_installed_module_imports_lab():
    bad = []
    for folder in PACKAGE:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                bad += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n == "lab" or n.startswith("lab.")]
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# the measured tables
# ---------------------------------------------------------------------------------------------

def _tables(op: str) -> list[Path]:
    paths = sorted((KERNELS / op / "tuned").glob("*.json"))
    assert paths, op
    return paths


def _config_classes():
    from specpilot.kernels.decode import gemv as dgemv
    from specpilot.kernels.decode import gemv_w12, gemv_w12_gluon
    from specpilot.kernels.w12 import routing

    w12 = {name: next(c for c, k in routing.CONFIGS.items() if k == name) for name in routing.KERNELS}
    decode = {"gemv": dgemv.GemvConfig, "gemv-w12": gemv_w12.W12GemvConfig, "gemv-w12-gluon": gemv_w12_gluon.GluonFusedConfig}
    return w12, decode


def _rows_ok(span) -> bool:
    return (isinstance(span, list) and len(span) == 2 and isinstance(span[0], int) and span[0] >= 1
            and (span[1] is None or (isinstance(span[1], int) and span[1] >= span[0])))


def test_every_table_entry_names_a_known_kernel_and_valid_config_fields():
    from specpilot.kernels import tuning
    from specpilot.kernels.w12 import gemv_gluon, mma, warpk

    w12, decode = _config_classes()
    checks = {"mma": mma.check_config, "warpk": warpk.check_config, "gemv-gluon": gemv_gluon.check_config}
    for op, classes, keys in (("w12", w12, {"n", "k", "rows"}), ("decode", decode, {"epilogue", "n", "k"})):
        for path in _tables(op):
            data = json.loads(path.read_text())
            assert data["schema"] == tuning.SCHEMA and data["op"] == op and data["arch"] == path.stem
            assert data["measured"]["gpu"] and set(data["measured"]["benchmarks"]) <= set(classes)
            for e in data["entries"]:
                assert e["kernel"] in classes, e
                assert keys <= set(e) and set(e) <= keys | {"kernel", "config", "date", "note"}, e
                fields = {f.name for f in dataclasses.fields(classes[e["kernel"]])}
                assert set(e["config"]) == fields, (e, fields)    # every field, named as the dataclass does
                cfg = classes[e["kernel"]](**e["config"])
                if e["kernel"] in checks:
                    checks[e["kernel"]](cfg)
                if "rows" in keys:
                    assert _rows_ok(e["rows"]), e
                assert len(e["date"]) == 10 and e["note"], e
            for rule in data.get("route", []):
                assert rule["kernel"] in classes and set(rule) <= {"kernel", "rows", "n_below", "when_tuned", "note"}
                assert "rows" not in rule or _rows_ok(rule["rows"])
                fields = {f.name for f in dataclasses.fields(classes[rule["kernel"]])}
                assert set(rule.get("when_tuned", {})) <= fields, rule
            if op == "w12":
                assert data["route"][-1] == {"kernel": "gemm", "note": data["route"][-1]["note"]}   # takes the rest
    from specpilot.kernels.attention import decode as attn
    from specpilot.kernels.verify import blas, ring

    def _ring_ok(c):
        ring.check(c)
        return True

    # the attention's split config (by head_dim and rows); the verify GEMMs' library (by rows), skinny and ring
    # configs (by layer and rows)
    skinny_ok = lambda c: c.split >= 1 and c.stages >= 1  # noqa: E731
    split_ok = lambda c: c.target_programs >= 1 and c.stages >= 1  # noqa: E731
    for op, kernels in (("attention", {"split-kv": (attn.SplitConfig, split_ok, {"head_dim"}),
                                       "split-kv-batched": (attn.SplitConfig, split_ok, {"head_dim"})}),
                        ("verify", {"gemm": (blas.GemmConfig, lambda c: c.library in blas.LIBRARIES, set()),
                                    "skinny": (blas.SkinnyConfig, skinny_ok, {"n", "k"}),
                                    "ring": (blas.RingConfig, _ring_ok, {"n", "k"}),
                                    "warpk": (None, None, set())})):   # no knobs: the entry routes the rows
        for path in _tables(op):
            data = json.loads(path.read_text())
            assert data["op"] == op and data["arch"] == path.stem
            bench = set(data["measured"]["benchmarks"])
            assert bench == set(kernels) if op == "verify" else bench <= set(kernels)
            for e in data["entries"]:
                assert e["kernel"] in kernels and _rows_ok(e["rows"]) and len(e["date"]) == 10 and e["note"], e
                cls, ok, keys = kernels[e["kernel"]]
                ranges = {"requests"} if e["kernel"] == "split-kv-batched" else set()   # a batched step's requests
                assert set(e) - ranges == {"kernel", "rows", "config", "date", "note"} | keys, e
                assert "requests" not in e or _rows_ok(e["requests"]), e
                if cls is None:
                    assert e["config"] == {}, e
                    continue
                assert set(e["config"]) == {f.name for f in dataclasses.fields(cls)}, e
                assert ok(cls(**e["config"])), e
    for path in _tables("lm_head"):
        data = json.loads(path.read_text())
        assert data["op"] == "lm_head" and data["arch"] == path.stem
        for e in data["entries"]:
            assert e["kernel"] == "bounds" and _rows_ok(e["rows"])
            assert set(e["config"]) == {"block_v", "block_k", "num_warps", "num_stages"}


def test_tables_are_package_data():
    text = (REPO / "pyproject.toml").read_text()
    assert '"specpilot.kernels" = ["*/tuned/*.json"]' in text


# ---------------------------------------------------------------------------------------------
# no dead knobs
# ---------------------------------------------------------------------------------------------

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (7168, 5120), (34816, 5120), (5120, 17408),
          (1024, 4096), (14336, 4096), (256, 512), (1000, 3000), (8192, 200000), (64, 2048)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33, 64, 100]


def _default_configs(kernel: str):
    """The default-config heuristics' outputs over a grid of layers and row counts."""
    from specpilot.kernels.decode import gemv as dgemv
    from specpilot.kernels.decode import gemv_w12, gemv_w12_gluon
    from specpilot.kernels.w12 import gemm, gemv, gemv_gluon, mma, warpk

    if kernel == "gemv-gluon":
        return [gemv_gluon.default_config(n, k) for n, k in SHAPES]
    if kernel == "mma":
        return [mma.default_config(m, n, k, tma=t, wgmma=t) for n, k in SHAPES for m in ROWS for t in (True, False)]
    if kernel in ("gemm", "gemv", "warpk"):
        mod = {"gemm": gemm, "gemv": gemv, "warpk": warpk}[kernel]
        return [mod.default_config(m, n, k) for n, k in SHAPES for m in ROWS if kernel != "warpk" or m <= 32]
    if kernel == "verify/skinny":
        return []   # no default: a layer without an entry runs on cuBLAS
    if kernel == "attention/split-kv":
        from specpilot.kernels.attention.decode import SplitConfig

        return [SplitConfig()]
    mod = {"decode/gemv": dgemv, "decode/gemv-w12": gemv_w12, "decode/gemv-w12-gluon": gemv_w12_gluon}[kernel]
    return [mod.DEFAULT]


@pytest.mark.parametrize("kernel", ["mma", "warpk", "gemv-gluon", "gemv", "gemm", "decode/gemv", "decode/gemv-w12",
                                    "decode/gemv-w12-gluon", "verify/skinny", "attention/split-kv"])
def test_every_config_field_is_set_by_a_table_entry_or_the_default_heuristic(kernel):
    from specpilot.kernels.attention.decode import SplitConfig
    from specpilot.kernels.verify.skinny import SkinnyConfig

    w12, decode = _config_classes()
    op, name = kernel.split("/") if "/" in kernel else ("w12", kernel)
    classes = {"decode": decode, "w12": w12, "verify": {"skinny": SkinnyConfig}, "attention": {"split-kv": SplitConfig}}
    cls = classes[op][name]
    names = {name, "split-kv-batched"} if op == "attention" else {name}   # one config class for both kinds
    default = cls()
    configs = [cls(**e["config"]) for path in _tables(op) for e in json.loads(path.read_text())["entries"]
               if e["kernel"] in names]
    configs += _default_configs(kernel)
    dead = [f.name for f in dataclasses.fields(cls)
            if all(getattr(c, f.name) == getattr(default, f.name) for c in configs)]
    assert not dead, f"{cls.__name__}: no table entry or default config sets {dead} (move the knob to lab/)"
