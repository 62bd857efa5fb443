"""SpecPilot's mechanisms packaged for SGLang (docs/bundles.md).

* :mod:`.memory`          the memory of mechanisms (``memory/*.yaml``): load, compose, survival rule
* :mod:`.inspect_sglang`  static (AST) checks of hook targets in an installed SGLang
* :mod:`.sglang_env`      probe a target interpreter for SGLang and SpecPilot without importing SGLang
* :mod:`.activation`      ``apply`` / ``revert`` / ``status``: the atomic activation file
* :mod:`.plugin`          the ``sglang.srt.plugins`` entry point: registers the active hooks
* bundles: :mod:`.lattice_trace`, :mod:`.tree` (+ :mod:`.tree_layout`), :mod:`.w12`
  (+ :mod:`.w12_sglang`, :mod:`.lm_head`), :mod:`.batching` (library only)
* :mod:`.testing`         test support (SGLang wheel location, throw-away environments)
"""
