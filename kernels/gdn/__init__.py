"""Gated DeltaNet: tree verification along root paths without snapshots, commit by replay.

* :mod:`.path`   ``row_paths``, ``path_verify``, ``commit`` and the causal-conv windows
  (``conv_windows``, ``chain_windows``, ``causal_conv``)
* :mod:`.naive`  the gated delta rule in plain torch (``recurrent``, ``step``)
"""

from .path import causal_conv, chain_windows, commit, conv_windows, path_verify, row_paths

__all__ = ["causal_conv", "chain_windows", "commit", "conv_windows", "path_verify", "row_paths"]
