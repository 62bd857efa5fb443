"""Test support for the bundles: the real SGLang wheel, throw-away environments, SGLang source pieces.

* :func:`sglang_dir`: the real SGLang wheel installed with ``--no-deps`` by
  ``scripts/install_sglang.sh`` (``cache/sglang/<version>``, or ``$SPECPILOT_SGLANG_DIR``).
* :func:`env_fixture`: the ``env`` fixture (a module's target environment) for a test module that
  imports it; :func:`purelib`: an environment's site-packages.
* :func:`make_env`: a throw-away Python environment (a venv without pip) that sees that SGLang and,
  optionally, this SpecPilot: what ``specpilot apply --python`` is pointed at in the tests.
* :func:`load_sglang_function`: one function from the installed SGLang source, compiled on its own
  (SGLang's heavy imports are not executed), to compare SpecPilot's replacements with the real code.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from specpilot.bundles.contract import SUPPORTED_SGLANG

REPO = Path(__file__).resolve().parents[1]
SGLANG_VERSION = SUPPORTED_SGLANG[-1]


def sglang_dir(version: str = SGLANG_VERSION) -> Path | None:
    d = Path(os.environ.get("SPECPILOT_SGLANG_DIR") or REPO / "cache" / "sglang" / version)
    return d if (d / "sglang" / "srt" / "plugins" / "hook_registry.py").is_file() else None


SKIP_REASON = ("SGLang 0.5.23 wheel not installed: run 'bash scripts/install_sglang.sh' "
               "(or set SPECPILOT_SGLANG_DIR)")


@pytest.fixture(scope="module", name="env")
def env_fixture(tmp_path_factory) -> Path:
    """The ``env`` fixture of a test module that imports it: a target environment (SGLang 0.5.23 and
    this SpecPilot), one per module, skipped without the wheel."""
    root = sglang_dir()
    if root is None:
        pytest.skip(SKIP_REASON)
    return make_env(tmp_path_factory.mktemp("sglenv") / "env", root)


def purelib(py: Path) -> Path:
    """The site-packages folder of the environment whose interpreter is ``py``."""
    return Path(subprocess.run([str(py), "-B", "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def make_env(where: Path, sglang_root: Path | None, with_specpilot: bool = True) -> Path:
    """Create a venv at ``where`` whose site-packages points at ``sglang_root`` (and at this
    interpreter's site-packages when ``with_specpilot``); returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-B", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    if sglang_root is not None:
        (purelib / "_sglang_under_test.pth").write_text(str(sglang_root) + "\n")
    if with_specpilot:
        here = sysconfig.get_paths()["purelib"]
        (purelib / "_specpilot_under_test.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return py


def fake_version_root(where: Path, real_root: Path, version: str) -> Path:
    """A root whose ``sglang`` package is the real one but whose metadata says ``version``."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sglang").symlink_to(real_root / "sglang")
    src = next(real_root.glob("sglang-*.dist-info"))
    dst = where / f"sglang-{version}.dist-info"
    shutil.copytree(src, dst)
    meta = (dst / "METADATA").read_text(encoding="utf-8").splitlines()
    meta = [f"Version: {version}" if line.startswith("Version: ") else line for line in meta]
    (dst / "METADATA").write_text("\n".join(meta) + "\n", encoding="utf-8")
    return where


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) with its sha256: to prove byte-identical."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]
    return out


def load_sglang_function(root: Path, module: str, name: str, namespace: dict, keep_decorators: bool = False):
    """Compile function or class ``name`` of SGLang module ``module`` (source under ``root``) alone, in
    ``namespace`` (which must provide the names it uses); returns the function."""
    path = root / Path(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        path = root / Path(*module.split(".")) / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    body, parts = tree.body, name.split(".")
    for part in parts[:-1]:  # "Class.method": the method, compiled as a plain function
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == part), [])
    name = parts[-1]
    node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
    if node is None:
        raise LookupError(f"{'.'.join(parts)} not found in {path}")
    if not keep_decorators:
        node.decorator_list = []
    mod = ast.Module(body=[node], type_ignores=[])
    exec(compile(mod, str(path), "exec"), namespace)
    return namespace[name]


def load_sglang_module_file(root: Path, module: str, alias: str):
    """Import one SGLang source file under another name (for files with stdlib-only imports,
    such as ``sglang.srt.plugins.hook_registry``)."""
    import importlib.util

    path = root / Path(*module.split(".")).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(alias, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def fresh_hook_registry(root: Path, alias: str):
    """SGLang's ``hook_registry`` module loaded afresh under ``alias``, with an empty registry,
    reset and unloaded again on exit (tests install hooks on stand-in classes through it)."""
    reg = load_sglang_module_file(root, "sglang.srt.plugins.hook_registry", alias)
    reg.HookRegistry.reset()
    try:
        yield reg
    finally:
        reg.HookRegistry.reset()
        sys.modules.pop(alias, None)
