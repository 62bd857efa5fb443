import sys
from pathlib import Path

# `python -m specpilot` in a source checkout puts the checkout on sys.path, where its folders
# (kernels/, engine/, ...) would shadow packages of the same name: transformers imports Hugging
# Face's `kernels` when it loads a tokenizer. They are importable only as specpilot.* anyway.
_checkout = Path(__file__).resolve().parents[1]
if Path(__file__).resolve().parent.name == "specpilot_cli":
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _checkout]

from specpilot.entry import main  # noqa: E402

main()
