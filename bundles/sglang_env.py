"""Find SGLang and SpecPilot in a target Python environment without importing SGLang.

The probe runs the target interpreter with a short script that uses ``importlib.util.find_spec``
and ``importlib.metadata`` only, so it works on a serving environment whose CUDA stack cannot load
here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specpilot import signals
from specpilot.errors import EnvironmentMissing, InputError

from .contract import PLUGIN_GROUP, SUPPORTED_SGLANG

PROBE_TIMEOUT = 60.0   # seconds the target interpreter has to answer the probe

_PROBE = r"""
import os, sys
# what the environment has installed, not what the current folder happens to hold
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
import importlib.metadata as md, importlib.util, json, sysconfig
out = {"executable": sys.executable, "python": "%d.%d.%d" % sys.version_info[:3], "prefix": sys.prefix,
       "purelib": sysconfig.get_paths()["purelib"], "sglang": None, "specpilot": None}
try:
    spec = importlib.util.find_spec("sglang")
except Exception as e:
    spec = None
if spec is not None and spec.submodule_search_locations:
    try:
        dist = md.distribution("sglang")
        version, meta = dist.version, getattr(dist, "_path", None)
    except md.PackageNotFoundError:
        version = meta = None
    # its metadata folder (.dist-info, .egg-info): beside the package where a .pth leads to it
    out["sglang"] = {"version": version, "package": list(spec.submodule_search_locations)[0],
                     "metadata": str(meta) if meta is not None else None}
try:
    dist = md.distribution("specpilot")
    eps = [ep for ep in dist.entry_points if ep.group == PLUGIN_GROUP]
    out["specpilot"] = {"version": dist.version,
                        "entry_point": {ep.name: ep.value for ep in eps}}
except md.PackageNotFoundError:
    pass
# the general plugins SGLang loads when SGLANG_PLUGINS does not restrict them
out["plugins"] = sorted({ep.name for ep in md.entry_points(group=PLUGIN_GROUP)})
import hashlib
fps = {}
for name in MODULES:
    try:
        spec = importlib.util.find_spec(name)
        fps[name] = "sha256:" + hashlib.sha256(open(spec.origin, "rb").read()).hexdigest()
    except Exception:
        fps[name] = None
out["fingerprints"] = fps
print(json.dumps(out))
"""


@dataclass
class TargetEnv:
    python: str
    executable: str
    python_version: str
    prefix: str
    purelib: str
    sglang_version: str | None
    sglang_package: str | None     # .../sglang
    specpilot_version: str | None
    specpilot_entry_point: dict | None
    fingerprints: dict  # module -> sha256 of its source in the target environment (None: absent)
    plugins: list = field(default_factory=list)   # names of the environment's SGLang plugins (entry points)
    sglang_metadata: str | None = None   # SGLang's .dist-info (or .egg-info) folder, which its version is read from

    @property
    def sglang_root(self) -> Path | None:
        return Path(self.sglang_package).parent if self.sglang_package else None

    @property
    def supported(self) -> bool:
        return self.sglang_version in SUPPORTED_SGLANG


def _probe_shaped(info) -> bool:
    """Whether ``info`` has the shape ``_PROBE`` prints (something else may answer as "python")."""
    def text(x, none_ok=False):
        return isinstance(x, str) or (none_ok and x is None)

    if not isinstance(info, dict) or not all(text(info.get(k)) for k in ("executable", "python", "prefix", "purelib")):
        return False
    sg, sp, fps = info.get("sglang"), info.get("specpilot"), info.get("fingerprints", {})
    if sg is not None and not (isinstance(sg, dict) and text(sg.get("version"), True) and text(sg.get("package"))
                               and text(sg.get("metadata"), True)):
        return False
    if sp is not None and not (isinstance(sp, dict) and text(sp.get("version"))
                               and isinstance(sp.get("entry_point") or {}, dict)):
        return False
    plugins = info.get("plugins", [])
    if not isinstance(plugins, list) or not all(text(p) for p in plugins):
        return False
    return isinstance(fps, dict) and all(text(k) and text(v, True) for k, v in fps.items())


def probe(python: str | None = None, timeout: float | None = None, modules=()) -> TargetEnv:
    """Describe the environment of interpreter ``python`` (default: this one); ``modules``: also
    fingerprint these modules' source files as that environment would import them. ``timeout``
    (default :data:`PROBE_TIMEOUT`) seconds without an answer is a missing environment (exit 3)."""
    if python is not None and not str(python).strip():
        raise InputError("--python: empty path; give the interpreter of the SGLang environment")
    python = python or sys.executable
    exe = Path(python)
    if not exe.exists():
        raise InputError(f"--python {python}: no such file")
    if not os.access(exe, os.X_OK) or exe.is_dir():
        raise InputError(f"--python {python}: not an executable Python interpreter")
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    # -B: the probe must not leave __pycache__ files behind in the target environment
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    script = f"MODULES = {sorted(modules)!r}\nPLUGIN_GROUP = {PLUGIN_GROUP!r}\n" + _PROBE
    try:
        # its own process group: a wrapper script's children end with it on a timeout or a signal;
        # absolute: Path("./py") is "py", which subprocess would look up on $PATH
        proc = signals.spawn([os.path.abspath(exe), "-B", "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    except OSError as e:
        raise InputError(f"--python {python}: cannot run it ({e.strerror or e})") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signals.end(proc, grace=0.5)
        raise EnvironmentMissing(f"--python {python}: did not answer within {timeout:.0f} s") from None
    except BaseException:   # a signal (Interrupted) or another error while it runs
        signals.end(proc, grace=0.5)
        raise
    signals.forget(proc)
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        if len(last) > 160:   # a program that is no Python may echo the whole probe script back
            last = last[:160] + "..."
        raise InputError(f"--python {python}: the probe failed ({last}); is it Python >= 3.10?")
    try:
        info = json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        info = None
    if not _probe_shaped(info):
        raise InputError(f"--python {python}: unexpected probe output") from None
    sg, sp = info.get("sglang"), info.get("specpilot")
    return TargetEnv(
        python=str(python), executable=info["executable"], python_version=info["python"],
        prefix=info["prefix"], purelib=info["purelib"],
        sglang_version=sg and sg.get("version"), sglang_package=sg and sg.get("package"),
        specpilot_version=sp and sp.get("version"), specpilot_entry_point=sp and sp.get("entry_point"),
        fingerprints=info.get("fingerprints") or {}, plugins=info.get("plugins", []),
        sglang_metadata=sg and sg.get("metadata"),
    )
