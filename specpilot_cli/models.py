"""ModelSpec: the shape facts of a decoder that byte floors and the engine need.

Built from a Hugging Face ``config.json`` (a file or a model folder; never the network) or from
the built-in catalog by short name (``specpilot ceiling --model llama-3.1-8b``). Covers dense
decoders (Llama, Qwen2/Qwen3, Mistral, Gemma-style), GQA, tied or untied embeddings, MoE
(routed + shared experts) and hybrid Gated DeltaNet models (Qwen3-Next / Qwen3.5 style).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import InputError
from .limits import CONFIG_DEFAULT_MAX, CONFIG_MAX, MAX_CONFIG_BYTES

# Dense layer kinds
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet

# Weight storage per dtype, in bits per weight (per-channel/group metadata included).
# w12: the paper's 12.013-12.020 bits/weight over 8 models; int4: group-128 bf16 scales.
DTYPE_BITS = {"bf16": 16.0, "fp16": 16.0, "fp32": 32.0, "fp8": 8.0, "w12": 12.02, "int8": 8.0, "int4": 4.125}
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "w12", "int8", "int4")  # the --weight-dtype / --lm-head-dtype choices
KV_DTYPES = ("bf16", "fp16", "fp8")  # the --kv-dtype choices

SUPPORTED_ARCHS = {
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "qwen2_moe", "qwen3_moe",
    "mixtral", "qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "olmo2", "phi3",
}


@dataclass(frozen=True)
class GDNSpec:
    """Gated DeltaNet (linear attention) layer shape."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # channels through the causal conv: q, k, v
        return 2 * self.key_dim + self.value_dim

    def state_elems(self) -> int:
        """fp32 recurrent state per layer and request: [value_heads, key_dim, value_dim]."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    def proj_params(self, hidden: int) -> int:
        # in_proj_qkvz: hidden -> q,k (key heads) + v,z (value heads); in_proj_ba: hidden -> 2 x value heads
        # out_proj: value_dim -> hidden
        return hidden * (2 * self.key_dim + 2 * self.value_dim) + hidden * 2 * self.num_value_heads + self.value_dim * hidden

    def conv_params(self) -> int:
        return self.conv_dim * self.conv_kernel


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_tok: int
    expert_intermediate: int
    shared_intermediate: int = 0  # total intermediate width of the shared expert(s); 0 = none
    shared_expert_gate: bool = False

    def expected_touched(self, routed_rows: int) -> float:
        """Expected distinct routed experts touched by ``routed_rows`` tokens (uniform routing).

        Each token picks k of E experts; an expert is untouched by one token with probability
        1 - k/E, so E[touched] = E * (1 - (1 - k/E) ** rows). At one row this is exactly k.
        """
        if routed_rows <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** routed_rows)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]
    moe: MoESpec | None = None
    gdn: GDNSpec | None = None
    attn_output_gate: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int | None = None
    qk_norm: bool = False
    source: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- layer bookkeeping ------------------------------------------------------------
    @property
    def num_full_attention_layers(self) -> int:
        return sum(t == FULL_ATTENTION for t in self.layer_types)

    @property
    def num_gdn_layers(self) -> int:
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def is_hybrid(self) -> bool:
        return self.num_gdn_layers > 0

    # ---- parameter counts (weights read by a step) ------------------------------------
    def attention_proj_params(self) -> int:
        """q, k, v, o of one full-attention layer (q doubled when the output is gated)."""
        d, hd = self.hidden_size, self.head_dim
        q = d * self.num_heads * hd * (2 if self.attn_output_gate else 1)
        kv = 2 * d * self.num_kv_heads * hd
        o = self.num_heads * hd * d
        return q + kv + o

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def linear_params(self) -> int:
        """Projection weights run as dense GEMMs every step: attention/GDN projections and dense MLPs.

        MoE expert weights are counted separately (only touched experts are read); the router and
        the shared expert are dense and counted here.
        """
        total = 0
        for kind, is_moe in zip(self.layer_types, self.moe_layers):
            if kind == FULL_ATTENTION:
                total += self.attention_proj_params()
            else:
                assert self.gdn is not None
                total += self.gdn.proj_params(self.hidden_size)
            if is_moe:
                assert self.moe is not None
                total += self.hidden_size * self.moe.num_experts  # router
                total += 3 * self.hidden_size * self.moe.shared_intermediate
                total += self.hidden_size if self.moe.shared_expert_gate else 0
            else:
                total += self.dense_mlp_params()
        return total

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return 0 if self.moe is None else 3 * self.hidden_size * self.moe.expert_intermediate

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, kv_bits: float = 16.0) -> float:
        return self.num_full_attention_layers * 2 * self.num_kv_heads * self.head_dim * kv_bits / 8

    def total_params(self) -> int:
        moe = self.num_moe_layers * (self.moe.num_experts * self.expert_params() if self.moe else 0)
        conv = self.num_gdn_layers * (self.gdn.conv_params() if self.gdn else 0)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.lm_head_params()
        return self.linear_params() + moe + conv + embed + head

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "arch": self.arch, "layers": self.num_layers,
            "full_attention_layers": self.num_full_attention_layers, "gdn_layers": self.num_gdn_layers,
            "moe_layers": self.num_moe_layers, "hidden_size": self.hidden_size, "heads": self.num_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "linear_params": self.linear_params(),
            "lm_head_params": self.lm_head_params(), "total_params": self.total_params(),
        }


# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------

def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _req(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise InputError(f"{where}: config has no {key!r}; is this a decoder config.json?")
    v = cfg[key]
    hi = CONFIG_MAX.get(key, CONFIG_DEFAULT_MAX)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= hi:
        raise InputError(f"{where}: {key} must be a whole number in [1, {hi}], got {_shown(v)}")
    return v


def _opt_int(cfg: dict, key: str, where: str, default: int | None = None) -> int | None:
    v = cfg.get(key, default)
    if v is None:
        return default
    hi = CONFIG_MAX.get(key, CONFIG_DEFAULT_MAX)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise InputError(f"{where}: {key} must be a whole number in [0, {hi}], got {_shown(v)}")
    return v


def _opt_float(cfg: dict, key: str, where: str, default: float) -> float:
    v = cfg.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1e12:
        raise InputError(f"{where}: {key} must be a finite number in [0, 1e12], got {_shown(v)}")
    return float(v)


def spec_from_config(cfg: dict, name: str = "", where: str = "config") -> ModelSpec:
    """Build a ModelSpec from a parsed Hugging Face config dict (``text_config`` nesting too)."""
    if not isinstance(cfg, dict):
        raise InputError(f"{where}: expected a JSON object")
    outer = cfg
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    arch = str(cfg.get("model_type") or outer.get("model_type") or "").lower()
    if arch and arch not in SUPPORTED_ARCHS:
        raise InputError(f"{where}: unsupported model_type {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHS))}")
    hidden = _req(cfg, "hidden_size", where)
    layers = _req(cfg, "num_hidden_layers", where)
    heads = _req(cfg, "num_attention_heads", where)
    kv_heads = _opt_int(cfg, "num_key_value_heads", where, heads) or heads
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = _opt_int(cfg, "head_dim", where, None) or (hidden // heads)
    if head_dim < 1:
        raise InputError(f"{where}: hidden_size {hidden} is smaller than num_attention_heads {heads}; give head_dim")
    vocab = _req(cfg, "vocab_size", where)
    tie = bool(cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False)))

    # layer kinds
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise InputError(f"{where}: layer_types must list {layers} entries")
        kinds = []
        for t in layer_types:
            if t in ("full_attention", "attention", "sliding_attention"):
                kinds.append(FULL_ATTENTION)
            elif t in ("linear_attention", "gated_deltanet"):
                kinds.append(LINEAR_ATTENTION)
            else:
                raise InputError(f"{where}: unknown layer type {t!r} in layer_types")
    elif cfg.get("full_attention_interval"):
        k = _opt_int(cfg, "full_attention_interval", where)
        kinds = [FULL_ATTENTION if (i + 1) % k == 0 else LINEAR_ATTENTION for i in range(layers)]
    else:
        kinds = [FULL_ATTENTION] * layers

    gdn = None
    if LINEAR_ATTENTION in kinds:
        try:
            gdn = GDNSpec(
                num_key_heads=_req(cfg, "linear_num_key_heads", where),
                num_value_heads=_req(cfg, "linear_num_value_heads", where),
                key_head_dim=_req(cfg, "linear_key_head_dim", where),
                value_head_dim=_req(cfg, "linear_value_head_dim", where),
                conv_kernel=_opt_int(cfg, "linear_conv_kernel_dim", where, 4) or 4,
            )
        except InputError as e:
            raise InputError(f"{e} (needed by its linear-attention layers)") from None

    # MoE
    moe = None
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    moe_flags = [False] * layers
    if n_exp:
        hi = CONFIG_MAX["num_experts"]
        if isinstance(n_exp, bool) or not isinstance(n_exp, int) or not 0 < n_exp <= hi:
            raise InputError(f"{where}: num_experts must be a whole number in [1, {hi}], got {_shown(n_exp)}")
        k = _req(cfg, "num_experts_per_tok", where)
        if k > n_exp:
            raise InputError(f"{where}: num_experts_per_tok {k} exceeds num_experts {n_exp}")
        inter = _opt_int(cfg, "moe_intermediate_size", where, None) or _req(cfg, "intermediate_size", where)
        shared = _opt_int(cfg, "shared_expert_intermediate_size", where, 0) or 0
        n_shared = _opt_int(cfg, "n_shared_experts", where, 0) or 0
        if n_shared and not shared:
            shared = n_shared * inter
        moe = MoESpec(n_exp, k, inter, shared, shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")))
        step = _opt_int(cfg, "decoder_sparse_step", where, 1) or 1
        dense_only = cfg.get("mlp_only_layers") or []
        if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
            raise InputError(f"{where}: mlp_only_layers must be a list of layer indices")
        dense_only = set(dense_only)
        first_dense = _opt_int(cfg, "first_k_dense_replace", where, 0) or 0
        moe_flags = [(i not in dense_only) and (i >= first_dense) and ((i + 1) % step == 0) for i in range(layers)]
    inter_size = cfg.get("intermediate_size") or 0
    if not all(moe_flags) and not inter_size:
        raise InputError(f"{where}: config has no 'intermediate_size' for its dense MLP layers")
    hi = CONFIG_MAX["intermediate_size"]
    if isinstance(inter_size, bool) or not isinstance(inter_size, int) or not 0 <= inter_size <= hi:
        raise InputError(f"{where}: intermediate_size must be a whole number in [1, {hi}], got {_shown(inter_size)}")

    prf = _opt_float(cfg, "partial_rotary_factor", where, 1.0)
    rope = _opt_float(cfg, "rope_theta", where, 0.0) or None
    if rope is None and isinstance(cfg.get("rope_parameters"), dict):
        rope = _opt_float(cfg["rope_parameters"], "rope_theta", where, 0.0) or None
        prf = _opt_float(cfg["rope_parameters"], "partial_rotary_factor", where, prf)
    max_pos = _opt_int(cfg, "max_position_embeddings", where, None)
    return ModelSpec(
        name=name or str(cfg.get("_name_or_path") or arch or "model"),
        arch=arch or "llama",
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=inter_size, vocab_size=vocab, tie_word_embeddings=tie,
        layer_types=tuple(kinds), moe_layers=tuple(moe_flags), moe=moe, gdn=gdn,
        attn_output_gate=bool(cfg.get("attn_output_gate", arch.startswith(("qwen3_next", "qwen3_5")))),
        rms_norm_eps=_opt_float(cfg, "rms_norm_eps", where, 1e-6), rope_theta=float(rope or 10000.0),
        partial_rotary_factor=prf, max_position_embeddings=max_pos,
        qk_norm=arch.startswith(("qwen3", "gemma3")), source=where, raw=outer,
    )


def catalog_names() -> list[str]:
    files = resources.files("specpilot") / "catalog"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))


def _catalog_config(name: str) -> dict | None:
    key = name.lower()
    f = resources.files("specpilot") / "catalog" / f"{key}.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text())


def load_model_spec(name_or_path: str, also: str = "") -> ModelSpec:
    """A catalog short name, a ``config.json`` file, or a model folder holding one. ``also``: the
    other forms the caller takes, named where a file is none of these (", a .gguf file")."""
    if not str(name_or_path).strip():   # Path("") is the current folder
        raise InputError("empty model name; give a catalog name, a config.json or a model folder" + also)
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise InputError(f"{name_or_path}: folder has no config.json")
    if p.is_file():
        from .fileio import read_json

        try:
            cfg = read_json(p, max_bytes=MAX_CONFIG_BYTES)
        except InputError as e:   # a prompts file or a weights file given as the model: say what a model is
            raise InputError(f"{e}; a model is its config.json, a folder holding one{also} or a known name") from None
        return spec_from_config(cfg, name=p.parent.name if p.name == "config.json" else p.stem, where=str(p))
    cfg = _catalog_config(name_or_path)
    if cfg is None:
        raise InputError(f"unknown model {name_or_path!r}: not a file or folder, and not in the catalog "
                         f"({', '.join(catalog_names())})")
    facts = cfg.pop("_specpilot", {})
    spec = spec_from_config(cfg, name=name_or_path.lower(), where=f"catalog:{name_or_path.lower()}")
    del facts
    return spec


def model_inputs(name_or_path: str | None) -> list[str]:
    """The files a model argument reads from disk, for an output that must not overwrite them: a
    model folder whole; a config or GGUF file with the weights, configs and tokenizer files beside
    it (:data:`MODEL_FILES`; not that folder's other files: a config in the working folder leaves
    the other files there writable); SmolLM2 by name, the cache folder it was converted into. A
    catalog or other built-in name reads nothing of the user's: []."""
    if not name_or_path or not str(name_or_path).strip():
        return []
    if str(name_or_path).strip().lower() in SMOLLM2_NAMES:   # the folder it was converted into, read by name
        from specpilot.engine.weights import SMOLLM2_FOLDER, cache_root

        return [str(cache_root() / SMOLLM2_FOLDER)]
    p = Path(str(name_or_path).strip()).expanduser()
    if p.is_dir():
        return [str(p)]
    if not p.is_file():
        return []
    beside = [q for q in p.parent.iterdir() if q.is_file() and (q.suffix in (".safetensors", ".gguf")
                                                                 or q.name in MODEL_FILES
                                                                 or q.name.endswith(".safetensors.index.json"))]
    return [str(p)] + [str(q) for q in beside if q != p]


# the names the engine loads the real SmolLM2 by (engine/api.py), from its cached folder
SMOLLM2_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")

# a checkpoint folder's files besides its weights (configs and tokenizer) that a model argument reads
MODEL_FILES = frozenset({"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                         "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt"})
