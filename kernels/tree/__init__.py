"""Best-first draft trees (paper 4.2, 4.4).

* :mod:`.build`    the tree types (``DraftTree``, ``BatchedTrees``), the host heap builder
  (``build_best_first``, ``build_best_first_shared``, ``chain_tree``), TLV's ``truncate`` and
  ``attach``, ``within_depth`` (a request near its token limit), and what verification needs of a
  tree (``ancestor_mask``, ``positions``, ``ancestor_paths``, ``accept_greedy``, ``accept_predictions``)
* :mod:`.batched`  ``build_batched``: the same trees for a batch of lattices in one Triton kernel
  (one shared node budget), and ``alloc`` for CUDA-graph capture
* :mod:`.naive`    plain references: every root path enumerated; the batched builder in torch
"""

from .build import (BatchedTrees, DraftTree, accept_greedy, accept_predictions, ancestor_mask, ancestor_paths, attach,
                    build_best_first, build_best_first_shared, chain_tree, positions, truncate, within_depth)

__all__ = ["BatchedTrees", "DraftTree", "accept_greedy", "accept_predictions", "alloc", "ancestor_mask",
           "ancestor_paths", "attach", "build_batched", "build_best_first", "build_best_first_shared",
           "chain_tree", "positions", "truncate", "within_depth"]


def __getattr__(name):   # the batched builder imports torch and Triton: on first use only
    if name in ("build_batched", "alloc"):
        from . import batched

        return getattr(batched, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
