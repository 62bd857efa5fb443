"""The engine's decoder: Llama / Qwen2 / Qwen3 dense layers and Gated DeltaNet hybrids.

Modelled on gpt-fast: a static KV cache indexed by slot, one ``forward`` for prefill, AR decode,
chain and tree verification (rows at given slots and positions, with an explicit attention
mask), fused q/k/v and gate/up projections, CUDA-graph friendly (no data-dependent shapes in a
step). ``forward`` serves one request whose cache lives in the layers; ``hidden_batch`` /
``greedy_batch`` run the rows of several requests through the same weight stream, each request
attending to its own cache slot of a :class:`~specpilot.engine.batch.cache.BatchCache`
(:class:`~specpilot.engine.step_input.BatchStepInput`: which rows belong to which slot,
continuous batching). A hybrid's linear-attention layers are
:class:`~specpilot.engine.gated_deltanet.GatedDeltaNet` (how a step's ``gdn_rows`` treat their
states is described there).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.engine.attention import attend, store_and_attend
from specpilot.engine.gated_deltanet import GatedDeltaNet
from specpilot.engine.norm import rms_norm
from specpilot.engine.spec import GDNS, HEADS, check_choice
from specpilot.engine.step_input import BatchStepInput, StepInput
from specpilot.errors import EnvironmentMissing, InputError
from specpilot.models import FULL_ATTENTION, ModelSpec


@contextmanager
def weights_left_unset():
    """Modules built inside keep their ``nn.Linear`` and ``nn.Embedding`` weights as allocated
    (``torch.empty``), for a model whose every parameter is written next (a checkpoint, or
    ``init_random``): the default init is a pass of random numbers over every weight, most of a
    small model's build on a CPU (SmolLM2: 0.8 of 1.0 s on one thread). Not thread-safe: the two
    classes' ``reset_parameters`` are swapped for the duration."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def rope_tables(spec: ModelSpec, max_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rot = int(spec.head_dim * spec.partial_rotary_factor)
    rot -= rot % 2
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    scaling = spec.raw.get("rope_scaling") or (spec.raw.get("text_config") or {}).get("rope_scaling") \
        or spec.raw.get("rope_parameters") or {}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    t = torch.arange(max_pos, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], -1).float()
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x, cos, sin):
    """x [T, H, D]; cos/sin [T, rot]. Rotates the first ``rot`` dims (rotate-half layout, as HF)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat([-x2, x1], -1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    out = xr * c + rotated * s
    return torch.cat([out, xp], -1) if xp.shape[-1] else out


def weight_bytes(spec: ModelSpec, dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (projections, MoE experts, convolutions, the
    embedding and an untied LM head; norms and biases are too small to count)."""
    return spec.total_params() * torch.empty((), dtype=dtype).element_size()


def smaller_weights_hint(dtype) -> str:
    """What a user can do when the weights alone do not fit."""
    wide = torch.empty((), dtype=dtype).element_size() > 2
    return "a smaller model" + (" or 16-bit weights: --dtype bfloat16" if wide else "")


def check_cache_fits(spec: ModelSpec, max_seq: int, dtype, device: str, slots: int = 1,
                     weights: bool = False) -> None:
    """Refuse (EnvironmentMissing) KV caches of ``slots`` x ``max_seq`` positions, and with
    ``weights`` the model's parameters as well, that the device's free memory cannot hold, before
    allocating them: the CPU would hand out the pages lazily and the process be killed when they
    are touched."""
    from specpilot.machine import free_memory

    elem = torch.empty((), dtype=dtype).element_size()
    per = 2 * spec.num_full_attention_layers * spec.num_kv_heads * spec.head_dim * elem
    kv, free = per * max_seq * slots, free_memory(device)
    params = weight_bytes(spec, dtype) if weights else 0
    if free is None or kv + params <= free:
        return
    caches = f"{slots} KV caches of {max_seq} slots" if slots > 1 else f"a KV cache of {max_seq} slots"
    if params:
        dt = str(dtype).replace("torch.", "")
        what = (f"{spec.name} needs {(kv + params) / 1e9:.3g} GB ({dt} weights {params / 1e9:.3g} GB, "
                f"{caches} {kv / 1e9:.3g} GB)")
    else:
        what = f"{caches} {'need' if slots > 1 else 'needs'} {kv / 1e9:.3g} GB for {spec.name}"
    hint = (smaller_weights_hint(dtype) if params > free else
            "a shorter context: --ctx for run and serve, --context for probe rows; fewer requests: --batch")
    raise EnvironmentMissing(f"{what}; {device} has {free / 1e9:.3g} GB free ({hint})")


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, max_seq: int, dtype, device):
        super().__init__()
        d, hd = spec.hidden_size, spec.head_dim
        self.nh, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, hd
        self.gate = spec.attn_output_gate
        q_out = self.nh * hd * (2 if self.gate else 1)
        bias = bool(spec.raw.get("attention_bias", spec.arch == "qwen2"))
        self.q_out, self.kv_out = q_out, self.nkv * hd
        self.wqkv = nn.Linear(d, q_out + 2 * self.kv_out, bias=bias, dtype=dtype, device=device)
        self.wo = nn.Linear(self.nh * hd, d, bias=False, dtype=dtype, device=device)
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(hd, dtype=dtype, device=device))
            self.k_norm = nn.Parameter(torch.ones(hd, dtype=dtype, device=device))
        self.eps = spec.rms_norm_eps
        self.register_buffer("k_cache", torch.zeros(1, self.nkv, max_seq, hd, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, self.nkv, max_seq, hd, dtype=dtype, device=device), persistent=False)
        self.fused = False  # Transformer.set_attention: the Triton kernel instead of the torch reference

    def _project(self, x, cos, sin):
        """q [T, nh, hd], k/v [T, nkv, hd] (q/k normed and rotated) and the output gate (or None)."""
        T = x.shape[0]
        g = None
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.q_out, self.kv_out, self.kv_out], -1)
        if self.gate:
            q, g = q.view(T, self.nh, 2 * self.hd).chunk(2, -1)
            g = g.reshape(T, self.nh * self.hd)
        q = q.reshape(T, self.nh, self.hd)
        k = k.view(T, self.nkv, self.hd)
        v = v.view(T, self.nkv, self.hd)
        if self.qk_norm:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v, g

    def _out(self, o, g):
        if self.gate:
            o = o * torch.sigmoid(g)
        return self.wo(o)

    def forward(self, x, inp: StepInput, cos, sin, kv_len: int):
        q, k, v, g = self._project(x, cos, sin)
        o = store_and_attend(q, k, v, self.k_cache, self.v_cache, inp.slots, inp.mask, kv_len, self.hd ** -0.5,
                             self.fused)
        return self._out(o, g)

    def forward_batch(self, x, inp: BatchStepInput, cos, sin, kv_len: int, cache):
        """Rows of several requests: K/V go to each row's own slot of ``cache.k``/``cache.v``
        [slots, nkv, S, hd]; each segment attends to its slot's first ``kv_len`` positions."""
        q, k, v, g = self._project(x, cos, sin)
        cache.k[inp.req, :, inp.slots] = k.to(cache.k.dtype)   # (a TLV Q pass under CPU autocast: bf16 rows)
        cache.v[inp.req, :, inp.slots] = v.to(cache.v.dtype)
        scale = self.hd ** -0.5
        outs = [attend(q[s.start:s.start + s.rows], cache.k[s.slot, :, :kv_len], cache.v[s.slot, :, :kv_len],
                       inp.mask[s.start:s.start + s.rows, :kv_len], scale, self.fused) for s in inp.segments]
        return self._out(torch.cat(outs) if len(outs) > 1 else outs[0], g)

    def commit(self, start: int, rows: torch.Tensor):
        """Move the KV of accepted rows (slots start + rows) to slots start .. start+len-1."""
        self.move(start + rows, start + torch.arange(rows.numel(), device=rows.device))

    def move(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy the K/V of slots ``src`` to slots ``dst`` (device index tensors of one length;
        gathered before written, so the two may overlap)."""
        self.k_cache[0, :, dst] = self.k_cache[0, :, src]
        self.v_cache[0, :, dst] = self.v_cache[0, :, src]


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, kind: str, max_seq: int, dtype, device):
        super().__init__()
        self.kind = kind
        d = spec.hidden_size
        self.attn_norm = nn.Parameter(torch.ones(d, dtype=dtype, device=device))
        self.mlp_norm = nn.Parameter(torch.ones(d, dtype=dtype, device=device))
        if kind == FULL_ATTENTION:
            self.mixer = Attention(spec, max_seq, dtype, device)
        else:
            self.mixer = GatedDeltaNet(spec, dtype, device)
        self.inter = spec.intermediate_size
        self.w13 = nn.Linear(d, 2 * self.inter, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(self.inter, d, bias=False, dtype=dtype, device=device)
        self.eps = spec.rms_norm_eps

    def forward(self, x, inp, cos, sin, kv_len):
        h = rms_norm(x, self.attn_norm, self.eps)
        if self.kind == FULL_ATTENTION:
            x = x + self.mixer(h, inp, cos, sin, kv_len)
        else:
            x = x + self.mixer(h, inp)
        h = rms_norm(x, self.mlp_norm, self.eps)
        gate, up = self.w13(h).split([self.inter, self.inter], -1)
        return x + self.w2(F.silu(gate) * up)

    def forward_batch(self, x, inp: BatchStepInput, cos, sin, kv_len, cache):
        h = rms_norm(x, self.attn_norm, self.eps)
        if self.kind == FULL_ATTENTION:
            x = x + self.mixer.forward_batch(h, inp, cos, sin, kv_len, cache)
        else:
            x = x + self.mixer.forward_batch(h, inp, cache)
        h = rms_norm(x, self.mlp_norm, self.eps)
        gate, up = self.w13(h).split([self.inter, self.inter], -1)
        return x + self.w2(F.silu(gate) * up)


def _block_call(blk, x, inp, cos, sin, kv_len):
    return blk(x, inp, cos, sin, kv_len)


class Transformer(nn.Module):
    """A decoder with a static cache of ``max_seq`` slots for one request."""

    @staticmethod
    def check_supported(spec: ModelSpec) -> None:
        """Refuse (InputError) a config the engine cannot build, before any memory is asked for it."""
        if spec.moe is not None and any(spec.moe_layers):
            raise InputError(f"{spec.name}: MoE layers are not supported by the embedded engine (dense and GDN only)")
        if spec.is_hybrid and spec.gdn is not None and spec.gdn.num_value_heads % spec.gdn.num_key_heads:
            raise InputError(f"{spec.name}: linear value heads must be a multiple of key heads")

    def __init__(self, spec: ModelSpec, max_seq: int = 2048, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.check_supported(spec)
        self.spec, self.max_seq, self.dtype = spec, max_seq, dtype
        self.device = torch.device(device)
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Block(spec, kind, max_seq, dtype, device) for kind in spec.layer_types)
        self.norm = nn.Parameter(torch.ones(spec.hidden_size, dtype=dtype, device=device))
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        max_pos = max(max_seq, 1) + 1
        cos, sin = rope_tables(spec, max_pos, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._block_call = None
        self.certified_head = None   # set_head("certified")
        self.fused_decode = False    # set_decode("fused"): one-row steps through kernels/decode
        self.invariant = False       # set_deterministic(True): steps of up to 64 rows row-invariant

    def compile_blocks(self, **kw):
        """torch.compile one layer's step (shared by every layer of the same kind: parameters are
        graph inputs), fusing norms, RoPE and activations as gpt-fast does. Dense layers only."""
        if self.spec.is_hybrid:
            raise InputError("compile is for dense models (the GDN path code has data-dependent shapes)")
        self._block_call = torch.compile(_block_call, **kw)
        return self

    def set_attention(self, impl: str) -> str:
        """``torch`` | ``fused`` | ``auto`` (fused on CUDA) for every attention layer; returns the choice."""
        from specpilot.engine.attention import resolve

        asked = impl
        impl = resolve(impl, self.device.type)
        attn = [blk.mixer for blk in self.layers if isinstance(blk.mixer, Attention)]
        if impl == "fused" and attn:
            from specpilot.kernels.attention.decode import supports

            m = attn[0]
            if not supports(m.nh, m.nkv, m.hd):
                if asked == "fused":
                    raise InputError(f"attn=fused: the kernel needs a power-of-two head_dim >= 16 and heads divisible "
                                     f"by KV heads ({self.spec.name}: {m.nh} heads, {m.nkv} KV heads, head_dim {m.hd}); "
                                     "use attn=torch")
                impl = "torch"  # auto: the reference handles every shape
        for m in attn:
            m.fused = impl == "fused"
        return impl

    def set_gdn(self, kind: str) -> str | None:
        """How every GDN layer runs (the engine option ``gdn``): ``naive`` (the plain torch reference,
        kernels/gdn/naive.py and path.py), ``path`` (the row kernels, each verify row walking its
        root path from the committed state), ``wy`` (the row kernels, verify steps of up to 64 rows
        through TreeWY, larger ones through the path walk) or ``auto`` (the kernels on CUDA where
        they take the model, the measured table choosing path or wy per step; the torch reference
        elsewhere). Returns what runs: ``naive``, ``path``, ``wy``, or ``auto`` where the table
        gives some steps to each; None for a model without GDN layers. Asking for something that
        cannot run raises InputError with the reason."""
        check_choice("gdn", kind, GDNS)
        layers = self.gdn_layers()
        if not layers:
            if kind != "auto":
                raise InputError(f"gdn={kind}: {self.spec.name} has no Gated DeltaNet layers (a dense model); "
                                 "leave gdn=auto")
            return None
        why = self.gdn_kernels_refused()
        if why and kind in ("path", "wy"):
            raise InputError(f"gdn={kind}: {why}; use gdn=naive")
        if kind == "auto":   # the layers' own auto (kernels on CUDA) where the kernels take the model
            impl = "auto" if why is None else "torch"
        else:
            impl = "torch" if kind == "naive" else "triton"
        for m in layers:
            m.impl = impl
            m.verify = kind if kind in ("path", "wy") else "auto"
        if not layers[0].runs_kernels(self.device):
            return "naive"
        if kind != "auto":
            return kind
        from specpilot.kernels.gdn.rows import verify_method

        methods = {verify_method(rows, self.device) for rows in range(2, 65)}
        return "path" if methods == {"path"} else "auto"

    def gdn_kernels_refused(self) -> str | None:
        """Why the GDN row kernels (kernels/gdn/rows.py, wy.py) cannot run this model's GDN layers
        here (None when they can): Triton, a CUDA device or Triton's interpreter, power-of-two head
        dims, a float32/bfloat16/float16 model."""
        from specpilot.kernels.triton_env import interpreting, triton

        m = self.gdn_layers()[0]
        if triton is None:
            return "the GDN row kernels need Triton, which is not installed"
        if self.device.type != "cuda" and not interpreting():
            return (f"the GDN row kernels run on {self.device.type} only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 in the environment, the default when no GPU is visible)")
        if m.dk & (m.dk - 1) or m.dv & (m.dv - 1):
            return (f"the GDN row kernels need power-of-two head dims ({self.spec.name}: key head dim {m.dk}, "
                    f"value head dim {m.dv})")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the GDN row kernels take float32, bfloat16 or float16 models, not {self.dtype}"
        return None

    # ---- construction --------------------------------------------------------------
    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("norm", "norm.weight")) or name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen)))
            elif name.endswith("conv_weight"):
                p.copy_((torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])).to(p.dtype))
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))
        return self

    @torch.no_grad()
    def init_random_fast(self, seed: int = 0, std: float = 0.02):
        """Random weights generated on the model's device (for big shapes on a GPU)."""
        torch.manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("norm", "dt_bias")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(0, 2.7)
            elif name.endswith("conv_weight"):
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(0, std)
        return self

    @torch.no_grad()
    def load_hf_state(self, state: dict):
        """Load Hugging Face tensor names (model.layers.N.self_attn.q_proj.weight, ...)."""
        def take(name, required=True):
            t = state.get(name)
            if t is None and required:
                raise InputError(f"checkpoint has no tensor {name!r}; is it a {self.spec.arch} model?")
            return t

        written = set()

        def put(param, tensor, name):
            if tuple(param.shape) != tuple(tensor.shape):
                raise InputError(f"{name}: shape {tuple(tensor.shape)} does not match the config ({tuple(param.shape)})")
            param.copy_(tensor.to(param.dtype))
            written.add(id(param))

        put(self.embed.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if not self.spec.tie_word_embeddings:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(blk.attn_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(blk.mlp_norm, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")
            put(blk.w13.weight, torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]), p + "mlp")
            put(blk.w2.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            m = blk.mixer
            if isinstance(m, Attention):
                a = p + "self_attn."
                put(m.wqkv.weight, torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                              take(a + "v_proj.weight")]), a + "qkv")
                if m.wqkv.bias is not None:
                    put(m.wqkv.bias, torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                                take(a + "v_proj.bias")]), a + "qkv bias")
                put(m.wo.weight, take(a + "o_proj.weight"), a + "o_proj.weight")
                if m.qk_norm:
                    put(m.q_norm, take(a + "q_norm.weight"), a + "q_norm.weight")
                    put(m.k_norm, take(a + "k_norm.weight"), a + "k_norm.weight")
            else:
                raise InputError("loading Gated DeltaNet checkpoints is not supported; use --random-weights")
        unset = [n for n, p in self.named_parameters() if id(p) not in written]
        if unset:   # build_model leaves weights unset until here (weights_left_unset)
            raise RuntimeError(f"the checkpoint loader wrote no value into {', '.join(unset[:4])}")
        return self

    # ---- caches --------------------------------------------------------------------
    def reset(self):
        for blk in self.layers:
            if isinstance(blk.mixer, GatedDeltaNet):
                blk.mixer.reset()

    def gdn_layers(self, upto: int | None = None):
        return [b.mixer for b in self.layers[:upto] if isinstance(b.mixer, GatedDeltaNet)]

    def commit_work(self, rows: list[int], gdn_rows: str) -> tuple[list, bool]:
        """What committing ``rows`` touches: the GDN layers that advance, and whether the attention
        layers' K/V move (accepted rows other than the first ones)."""
        return (self.gdn_layers() if gdn_rows in ("chain", "tree") else []), rows != list(range(len(rows)))

    def commit(self, start: int, rows: list[int], gdn_rows: str):
        """Keep the accepted rows (row 0 = the pending token) of the step that began at slot ``start``
        (``gdn_rows``: how that step's rows were laid out for the GDN layers, chain or tree)."""
        gdn, moved = self.commit_work(rows, gdn_rows)
        if not (moved or gdn):
            return
        r = torch.tensor(rows, dtype=torch.long, device=self.device)   # one copy from the host for every layer
        if moved:
            for blk in self.layers:
                if isinstance(blk.mixer, Attention):
                    blk.mixer.commit(start, r)
        for m in gdn:
            m.commit(rows, r[None])

    # ---- forward -------------------------------------------------------------------
    def hidden(self, inp: StepInput, kv_len: int, layers: int | None = None):
        from specpilot.engine import fused_verify

        x = self.embed(inp.tokens)
        if fused_verify.takes_invariant(self, x.shape[0]):   # AR steps too: one arithmetic for all
            return fused_verify.hidden_rows(self, x, inp, kv_len, layers, invariant=True)
        if self.fused_decode and x.shape[0] == 1:
            return self._decode_row(x, inp, kv_len, layers)
        if fused_verify.takes(self, x.shape[0]):
            return fused_verify.hidden_rows(self, x, inp, kv_len, layers)
        cos, sin = self.cos[inp.pos], self.sin[inp.pos]
        call = self._block_call or _block_call
        for blk in self.layers[:layers]:
            x = call(blk, x, inp, cos, sin, kv_len)
        return rms_norm(x, self.norm, self.spec.rms_norm_eps)

    def _decode_row(self, x, inp, kv_len: int, layers: int | None, kvs=None):
        """One row through the fused decode chain (``decode=fused``); ``kvs``: each layer's K/V
        caches [nkv, S, hd] when not the layers' own (a batch cache's slot)."""
        from specpilot.engine.fused_decode import block_step
        from specpilot.kernels.decode.gemv import rms_norm_row

        for i, blk in enumerate(self.layers[:layers]):
            x = block_step(blk, x, inp, self.cos, self.sin, kv_len, kv=None if kvs is None else kvs[i])
        return rms_norm_row(x, self.norm, self.spec.rms_norm_eps)

    # ---- batched forward (continuous batching; caches in a BatchCache) ----------------
    def hidden_batch(self, inp: BatchStepInput, cache, kv_len: int, layers: int | None = None):
        """Final hidden states [T, d] of a batched step; ``cache.layers[i]`` holds layer i's
        per-slot K/V (attention) or state (GDN)."""
        x = self.embed(inp.tokens)
        from specpilot.engine import fused_verify

        if fused_verify.takes_batch(self):
            # one request's AR row of a dense model: the one-row decode chain on its slot (not in a
            # TLV Q pass: the chain reads the exact weights, the multi-row kernels the view's packs)
            if x.shape[0] == 1 and fused_verify.one_row_chain(self):
                s = inp.segments[0].slot
                return self._decode_row(x, inp, kv_len, layers, [(lc.k[s], lc.v[s]) for lc in cache.layers])
            return fused_verify.hidden_rows(self, x, inp, kv_len, layers, cache=cache)
        cos, sin = self.cos[inp.pos], self.sin[inp.pos]
        for blk, lc in zip(self.layers[:layers], cache.layers):
            x = blk.forward_batch(x, inp, cos, sin, kv_len, lc)
        return rms_norm(x, self.norm, self.spec.rms_norm_eps)

    def logits_batch(self, inp: BatchStepInput, cache, kv_len: int, rows=None, layers: int | None = None):
        """Logits of the rows ``rows`` (index tensor; all rows when None) of a batched step."""
        h = self.hidden_batch(inp, cache, kv_len, layers)
        return self.lm_head(h if rows is None else h[rows])

    def greedy_batch(self, inp: BatchStepInput, cache, kv_len: int, rows=None):
        """The target's argmax for the rows ``rows`` (all when None) of a batched step, through the
        certified head when one is set and the rows fit it."""
        h = self.hidden_batch(inp, cache, kv_len)
        if rows is not None:
            h = h[rows]
        return self._argmax(h)

    def forward(self, inp: StepInput, kv_len: int | None = None, layers: int | None = None):
        """Logits [T, vocab] of the step's rows (``layers`` < all: an early-exit self-draft)."""
        kv_len = self.max_seq if kv_len is None else kv_len
        return self.lm_head(self.hidden(inp, kv_len, layers))

    def greedy(self, inp: StepInput, kv_len: int | None = None, last: bool = False):
        """The target's argmax per row (``last``: of the last row only), through the certified head
        when ``set_head("certified")`` made one and the rows fit it, else ``lm_head`` + argmax.
        With the certified head the result is a view of its output buffer (what a CUDA graph
        replays into): read it before the next step."""
        kv_len = self.max_seq if kv_len is None else kv_len
        h = self.hidden(inp, kv_len)
        if last:
            h = h[-1:]
        return self._argmax(h)

    def _argmax(self, h):
        """The greedy token of each final hidden row: the certified head when set and the rows fit
        it, else ``lm_head`` and an argmax (the two small argmax kernels with ``decode=fused``)."""
        head = self.certified_head
        if head is not None and h.shape[0] <= head.max_rows:
            return head.argmax_exact(h)
        if self.fused_decode and h.shape[0] <= 64:
            from specpilot.kernels.decode.argmax import argmax_rows

            if self.invariant:
                from specpilot.kernels.verify import invariant

                return argmax_rows(invariant.linear(h, self.lm_head.weight))
            return argmax_rows(self.lm_head(h))
        return self.lm_head(h).argmax(-1)

    def set_decode(self, kind: str) -> str:
        """``layers`` (the model's default), ``fused`` (one-row steps: AR decode, one-row drafts,
        through the fused decode kernels, engine/fused_decode.py; dense attention models) or
        ``auto`` (fused on CUDA where it applies, the engine spec's default); returns the choice."""
        from specpilot.engine.fused_decode import set_decode

        return set_decode(self, kind)

    def set_deterministic(self, on: bool) -> bool:
        """Row-invariant steps (``EngineSpec.deterministic``): every step of up to 64 rows, AR steps
        included, through the multi-row fused kernels with the row-invariant GEMM and attention
        (``kernels/verify/invariant.py``, ``kernels/attention/invariant.py``) and the GDN layers'
        path walk (TreeWY rounds its sums unlike an AR step), so a token rounds the same in any
        step. Needs the fused steps (``set_decode``: fused) and a one-request model."""
        if on:
            if not self.fused_decode:
                from specpilot.engine.fused_decode import ineligible

                why = ineligible(self) or "decode is not fused"
                raise InputError(f"deterministic runs the fused step kernels, which {self.spec.name} cannot take: {why}")
            from specpilot.engine.w12_loader import W12Projection

            if any(isinstance(m, W12Projection) for m in self.modules()):
                raise InputError("deterministic takes bfloat16, float16 or float32 weights, not W12 projections")
            for m in self.gdn_layers():
                m.verify = "path"
        self.invariant = bool(on)
        return self.invariant

    def set_head(self, kind: str, max_rows: int = 64) -> str:
        """``linear`` (``lm_head`` + argmax, the default) or ``certified``: the certified INT8 head
        (kernels/lm_head) for the argmax of up to ``max_rows`` rows per step: INT8 bounds, exact
        rescoring of the survivors, the full head on the device when too many survive; no host
        sync, so it sits in the CUDA graphs. It returns the *exact* head's argmax (fp64 dot of the
        weights, rounded to fp32), which can differ from ``lm_head``'s where bf16 rounding of the
        logits creates or breaks a tie. More rows than ``max_rows`` use ``lm_head``."""
        if kind == "linear":
            self.certified_head = None
            return kind
        check_choice("head", kind, HEADS)
        if self.lm_head.weight.dtype not in (torch.bfloat16, torch.float32):
            raise InputError("head=certified needs bfloat16 (or float32) weights")
        from specpilot.kernels.lm_head.certified import CertifiedHead

        try:
            self.certified_head = CertifiedHead(self.lm_head.weight.detach(), max_rows=max_rows)
        except ValueError as e:   # e.g. non-finite head weights: no certificate possible
            raise InputError(f"head=certified: {e}") from None
        return kind
