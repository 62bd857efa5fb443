"""Gated DeltaNet kernels: ``naive`` (plain torch reference of the gated delta rule) and ``path``
(tree verification along root paths without snapshots, commit by replay)."""
