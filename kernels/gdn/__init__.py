"""Gated DeltaNet: tree verification along root paths without snapshots, commit by replay.

* :mod:`.path`   ``row_paths``, ``path_verify``, ``commit`` and the causal-conv windows
  (``conv_windows``, ``chain_windows``, ``causal_conv``)
* :mod:`.rows`    the GPU kernels of the engine's GDN layers: ``conv_rows``, ``gdn_rows`` (the path
  walk: AR step, verify rows, commit), ``gated_norm_rows``, ``decay_rows``
* :mod:`.wy`      ``wy_verify``: the same outputs as ``path_verify`` from raw q/k in one Triton
  kernel (TreeWY: one triangular solve and matrix products over all rows; R <= 64)
* :mod:`.prefill` ``chunk_prefill``: prompts through fla-core's chunked kernel (CUDA)
* :mod:`.naive`   the gated delta rule in plain torch (``recurrent``, ``step``)
* ``tuned/<arch>.json``  which verify kernel is faster per row count (measured)
"""

from .path import causal_conv, chain_windows, commit, conv_windows, path_verify, row_paths

__all__ = ["causal_conv", "chain_windows", "commit", "conv_windows", "path_verify", "row_paths", "wy_verify"]


def __getattr__(name):
    # wy_verify on first use: importing the package (the engine's torch GDN layer does) stays
    # free of Triton and of the interpreter switch triton_env sets on machines without CUDA
    if name == "wy_verify":
        from .wy import wy_verify
        return wy_verify
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
