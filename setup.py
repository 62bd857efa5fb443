"""Maps the design card's folders under the single import root ``specpilot``.

``specpilot_cli/`` is ``specpilot``; ``probes/``, ``kernels/`` ... are ``specpilot.probes`` ...
Sub-packages (any folder with an ``__init__.py``) are found automatically.
"""
import os

from setuptools import setup

ROOTS = {
    "specpilot": "specpilot_cli",
    "specpilot.probes": "probes",
    "specpilot.kernels": "kernels",
    "specpilot.auditors": "auditors",
    "specpilot.reports": "reports",
    "specpilot.engine": "engine",
    "specpilot.bundles": "bundles",
}


def _packages():
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, folder)
                packages.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir)
