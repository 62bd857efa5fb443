"""SpecPilot's mechanisms packaged for SGLang (docs/bundles.md).

* :mod:`.contract`        the bundle contract: entry fields, hook types, plugin and activation names
* :mod:`.memory`          the memory of mechanisms (``memory_entries/*.yaml``): load, compose, survival rule
* :mod:`.inspect_sglang`  static (AST) checks of hook targets in an installed SGLang
* :mod:`.sglang_env`      probe a target interpreter for SGLang and SpecPilot without importing SGLang
* :mod:`.activation`      ``apply`` / ``revert`` / ``status``: the atomic activation file
* :mod:`.plugin`          the ``sglang.srt.plugins`` entry point: registers the active hooks
* bundles, each a memory entry and its modules:
  ``lattice-trace``: :mod:`.lattice_trace`;
  ``tree``: :mod:`.tree` (+ :mod:`.tree_layout`), :mod:`.dflash_tree_hooks` (+ :mod:`.dflash_tree`);
  ``w12``: :mod:`.w12_quantization` (+ :mod:`.w12_quantization_sglang`), :mod:`.lm_head`;
  ``tlv``: :mod:`.tlv`; ``batching``: :mod:`.batching`
"""
