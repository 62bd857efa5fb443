"""The limits SpecPilot checks on its inputs (docs/formats.md lists them).

Values past these are rejected with exit 2 and the valid range, before they can turn into
absurd figures, huge allocations or integer overflow further down.
"""

from __future__ import annotations

import math

from .errors import InputError

# token ids: what an int32 index tensor holds (no vocabulary comes near it)
MAX_TOKEN_ID = 2**31 - 1

# model config.json values
CONFIG_MAX = {
    "hidden_size": 2**20,
    "intermediate_size": 2**22,
    "moe_intermediate_size": 2**22,
    "shared_expert_intermediate_size": 2**22,
    "num_hidden_layers": 10_000,
    "num_attention_heads": 2**16,
    "num_key_value_heads": 2**16,
    "head_dim": 2**16,
    "vocab_size": 2**24,
    "num_experts": 2**16,
    "num_experts_per_tok": 2**16,
    "n_shared_experts": 2**16,
    "linear_num_key_heads": 2**16,
    "linear_num_value_heads": 2**16,
    "linear_key_head_dim": 2**16,
    "linear_value_head_dim": 2**16,
    "linear_conv_kernel_dim": 2**10,
    "full_attention_interval": 10_000,
    "decoder_sparse_step": 10_000,
    "first_k_dense_replace": 10_000,
}
CONFIG_DEFAULT_MAX = 2**24  # any other integer a config gives

# serving shape (ceiling, profile, probe rows)
MAX_ROWS = 2**16         # rows verified per request per step
MAX_BATCH = 2**16        # requests per step
MAX_CONTEXT = 2**24      # committed context tokens per request
MAX_DRAFT_PASSES = 1024
MAX_TAU = 2**16          # tokens per verification pass (at most rows + 1)
MAX_MS = 3.6e6           # a step time in ms (one hour)
MAX_TBS = 1e4            # bandwidth, TB/s
MAX_TFLOPS = 1e7         # FLOP/s, TFLOP/s

# timed runs of a comparison or a CI check (compare --runs/--max-runs, check --runs)
MAX_RUNS = 100_000

# a throughput in tokens/s (a baseline's samples): far past any machine either way, and the ratio
# of one to a real measurement stays a number
MIN_TPS, MAX_TPS = 1e-9, 1e9
# an audit's bootstrap resamples (each holds one prompt index per prompt): past it the intervals
# gain nothing, and memory runs out
MAX_BOOTSTRAP = 1_000_000

# file sizes read whole into memory
MAX_JSON_BYTES = 1 << 30           # a JSON result file (profile, replay, timing, rows, ceiling)
MAX_CONFIG_BYTES = 64 << 20        # a model config.json
MAX_YAML_BYTES = 16 << 20          # a memory entry or a kernel-class rules file
MAX_JSONL_LINE_BYTES = 256 << 20   # one row of a JSONL file (outputs, prompts, lattice)


def check_int(value, name: str, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi], else InputError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InputError(f"{name} must be a whole number in [{lo}, {hi}], got {value!r}")
    return value


def check_float(value, name: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """``value`` as a finite float in [lo, hi] (or (lo, hi]), else InputError with the range."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > lo if lo_open else value >= lo) and value <= hi)
    if not ok:
        bracket = "(" if lo_open else "["
        raise InputError(f"{name} must be a finite number in {bracket}{lo:g}, {hi:g}], got {value!r}")
    return float(value)
