"""Gated DeltaNet rows on the GPU: the causal conv and the gated delta rule along root paths.

Two kernels serve every GDN step of the engine except long prefills (:mod:`.prefill`), two small
ones beside them:

* :func:`conv_rows`: depthwise causal conv + SiLU of R rows, each over its own window along its
  root path (``paths``, as :func:`.path.row_paths` builds them; a chain is the lower-triangular
  path table), reading the committed conv state for positions before the root. With
  ``advance=True`` (one row, the AR step) the program that owns a channel block also shifts the
  conv state by that row.
* :func:`gdn_rows`: program (row r, value head h, block of 32 state columns) starts from the
  committed fp32 state of head h and walks r's root path one token at a time, applying
  :func:`.naive.step` (decay, delta-rule write) with the token's own q/k normalisation, decay
  ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` computed in the kernel; at the
  end of the path it reads the state with r's query (paper 4.2: no per-node snapshot is ever
  stored; memory is one working state per row in registers). With ``new_state`` the final state
  is stored, which makes the same kernel the AR step (each row walks only itself) and the commit
  (one row whose path is the accepted rows: a replay, so the committed state equals sequential
  decoding bit for bit).
* :func:`gated_norm_rows`: the layer's gated RMSNorm ``rms_norm(o) * silu(z)`` per head, in the
  activation dtype; :func:`decay_rows`: g and beta for the WY kernel (:mod:`.wy`).

Because AR decode, chain/tree verification and commit all run this one loop body, a row's output
in a path-kernel verify step is bitwise the output AR decoding would have produced for that token
(verify steps the table gives to TreeWY, :mod:`.wy`, are within one bf16 ulp of it). The plain
references are :mod:`.naive` and :mod:`.path` (fp32 torch); the kernels also run under Triton's
interpreter (CPU tests).
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_env import interpreting, pdl_args, tl, triton

WALKED_PROMPT_ROWS = 64  # a plain sequence up to this long may go through the path walk (O(rows^2))
PATH_CHUNK = 16         # path tokens gathered per load in the walk
BLOCK_V = 32            # state columns per program: 4 programs per head at dv = 128
_CHAINS: dict = {}


def walks_prompt(rows: int, device) -> bool:
    """Whether a plain sequence of ``rows`` rows (a prompt chunk) takes the path walk rather than the
    chunked prefill (fla) or the torch recurrence: a short one on a GPU without fla. Never under
    Triton's interpreter, where the walk's O(rows^2) interpreted token steps cost seconds per layer
    and the torch recurrence milliseconds."""
    from . import prefill

    return rows <= WALKED_PROMPT_ROWS and not prefill.available(device) and not interpreting()


def chain_paths(rows: int, device) -> torch.Tensor:
    """The path table of a chain of ``rows`` rows (row r walks rows 0..r), a view of one cached
    lower-triangular table per device (grown to the next power of two when a longer chain comes;
    no allocation per step, CUDA-graph friendly)."""
    if rows < 1:
        raise ValueError(f"a chain has at least one row, got {rows}")
    key = torch.device(device)
    t = _CHAINS.get(key)
    if t is None or t.shape[0] < rows:
        n = max(64, 1 << (rows - 1).bit_length())
        i = torch.arange(n)
        t = torch.where(i[None, :] <= i[:, None], i[None, :], torch.full_like(i[None, :], -1)).to(key)
        _CHAINS[key] = t
    return t[:rows, :rows]


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _decay(a, b, A):
        """(log decay ``A * softplus(a)``, write strength ``sigmoid(b)``); ``a`` has dt_bias added,
        ``A = -exp(A_log)``. Softplus with torch's threshold of 20."""
        sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        return A * sp, 1.0 / (1.0 + tl.exp(-b))

    @triton.jit
    def _path_len(paths_ptr, r, stride_p, D, CH: tl.constexpr):
        """Tokens on row ``r``'s root path: its entries >= 0, in chunks of ``CH`` over the table's ``D``
        columns (a loop, not a block of ``D``: one compiled kernel serves every path length)."""
        cc = tl.arange(0, CH)
        n = 0
        for c0 in range(0, D, CH):
            p = tl.load(paths_ptr + r * stride_p + c0 + cc, mask=c0 + cc < D, other=-1)
            n += tl.sum((p >= 0).to(tl.int32), axis=0)
        return n

    @triton.jit(do_not_specialize=["stride_p", "D"])
    def _conv_rows_kernel(x_ptr, stride_x, cs_ptr, w_ptr, out_ptr, stride_o, paths_ptr, stride_p, slots_ptr,
                          stride_cs, C, D, KW: tl.constexpr, BC: tl.constexpr, SEQ: tl.constexpr,
                          SLOTS: tl.constexpr, SELF: tl.constexpr, SEG: tl.constexpr, ADVANCE: tl.constexpr,
                          PDL: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        if SLOTS:     # continuous batching: row r belongs to the request whose conv state is slots[r]
            cs_ptr += tl.load(slots_ptr + r).to(tl.int64) * stride_cs
        seg0 = 0
        if SELF:      # row r is one token of its own: its path is itself
            depth = 1
        elif SEQ:     # consecutive rows: row r's path is rows 0..r
            depth = r + 1
        elif SEG:     # consecutive rows of its request from row paths[r] (the request's first row) to r
            seg0 = tl.load(paths_ptr + r)
            depth = r - seg0 + 1
        else:
            depth = _path_len(paths_ptr, r, stride_p, D, 16)
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros([BC], tl.float32)
        for j in tl.static_range(KW):
            pos = depth - KW + j          # position along the path; < 0: the committed conv state
            if SELF:
                src = r
            elif SEQ or SEG:
                src = seg0 + tl.maximum(pos, 0)
            else:
                src = tl.load(paths_ptr + r * stride_p + tl.maximum(pos, 0))
            posv = pos + tl.zeros([BC], tl.int32)   # a block, so the masks below are blocks too
            on_path = posv >= 0
            xv = tl.load(x_ptr + src * stride_x + c, mask=cm & on_path, other=0.0)
            sv = tl.load(cs_ptr + (posv + KW - 1) * C + c, mask=cm & (posv < 0), other=0.0).to(dt)
            val = tl.where(on_path, xv, sv)
            wv = tl.load(w_ptr + c * KW + j, mask=cm, other=0.0)
            acc += (val.to(tl.float32) * wv.to(tl.float32)).to(dt).to(tl.float32)  # the layer's bf16 products
        o = acc.to(dt).to(tl.float32)
        tl.store(out_ptr + r * stride_o + c, (o / (1.0 + tl.exp(-o))).to(out_ptr.dtype.element_ty), mask=cm)
        if ADVANCE:   # one row: the conv state drops its oldest row and takes this one
            tl.debug_barrier()   # every read of the old state above comes first
            for j in tl.static_range(KW - 2):
                nxt = tl.load(cs_ptr + (j + 1) * C + c, mask=cm)
                tl.store(cs_ptr + j * C + c, nxt, mask=cm)
            xl = tl.load(x_ptr + r * stride_x + c, mask=cm)
            tl.store(cs_ptr + (KW - 2) * C + c, xl.to(cs_ptr.dtype.element_ty), mask=cm)

    @triton.jit(do_not_specialize=["stride_p", "D"])
    def _gdn_rows_kernel(qkv_ptr, stride_qkv, ab_ptr, stride_ab, alog_ptr, dtb_ptr,
                         state_ptr, new_state_ptr, paths_ptr, stride_p, D, out_ptr, stride_o, slots_ptr, stride_s,
                         KEY_DIM, NV,
                         DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, RATIO: tl.constexpr,
                         CH: tl.constexpr, SELF: tl.constexpr, SLOTS: tl.constexpr,
                         OUTPUT: tl.constexpr, WRITE_STATE: tl.constexpr, PDL: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        v0 = tl.program_id(2) * BV
        if SLOTS:  # continuous batching: row r reads (and with WRITE_STATE writes) state slots[r]
            sl = tl.load(slots_ptr + r).to(tl.int64) * stride_s
            state_ptr += sl
            new_state_ptr += sl
        kh = h // RATIO
        dk = tl.arange(0, DK)
        dv = v0 + tl.arange(0, BV)
        sidx = h * DK * DV + dk[:, None] * DV + dv[None, :]
        A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        s = tl.load(state_ptr + sidx)
        if OUTPUT:   # the row's own query, read while the walk runs
            qr = tl.load(qkv_ptr + r * stride_qkv + kh * DK + dk).to(tl.float32)
        cc = tl.arange(0, CH)
        if SELF:     # the AR step: the row's path is the row itself; no path table to wait for
            L = 1
        else:
            L = _path_len(paths_ptr, r, stride_p, D, CH)
        for c0 in range(0, L, CH):
            # one gather per CH path tokens, so the walk waits on memory once per chunk, not per token;
            # each token's values are picked out exactly (one nonzero term per sum), and CH, BV and
            # the warps are the same for every call, so AR steps, verify rows and commits run the
            # same arithmetic
            ok = c0 + cc < L
            if SELF:
                tt = r + cc * 0
            else:
                tt = tl.load(paths_ptr + r * stride_p + c0 + cc, mask=ok, other=0)
            rows = qkv_ptr + tt[:, None] * stride_qkv
            kt = tl.load(rows + KEY_DIM + kh * DK + dk[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            vt = tl.load(rows + 2 * KEY_DIM + h * DV + dv[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            bt = tl.load(ab_ptr + tt * stride_ab + h, mask=ok, other=0.0).to(tl.float32)
            at = tl.load(ab_ptr + tt * stride_ab + NV + h, mask=ok, other=0.0).to(tl.float32)
            for j in range(0, tl.minimum(CH, L - c0)):
                sel = cc == j
                kr = tl.sum(tl.where(sel[:, None], kt, 0.0), axis=0)
                v = tl.sum(tl.where(sel[:, None], vt, 0.0), axis=0)
                b = tl.sum(tl.where(sel, bt, 0.0), axis=0)
                a = tl.sum(tl.where(sel, at, 0.0), axis=0) + dtb
                kn = kr * tl.math.rsqrt(tl.sum(kr * kr, axis=0) + 1e-6)
                g, beta = _decay(a, b, A)
                s = s * tl.exp(g)
                kv_mem = tl.sum(s * kn[:, None], axis=0)
                delta = (v - kv_mem) * beta
                s = s + kn[:, None] * delta[None, :]
        if WRITE_STATE:
            tl.store(new_state_ptr + sidx, s)
        if OUTPUT:
            qn = qr * tl.math.rsqrt(tl.sum(qr * qr, axis=0) + 1e-6) * (DK ** -0.5)
            tl.store(out_ptr + r * stride_o + h * DV + dv, tl.sum(s * qn[:, None], axis=0))


if triton is not None:

    @triton.jit
    def _decay_kernel(ab_ptr, stride_ab, alog_ptr, dtb_ptr, g_ptr, beta_ptr, NV, NVP: tl.constexpr):
        r = tl.program_id(0)
        h = tl.arange(0, NVP)
        hm = h < NV
        b = tl.load(ab_ptr + r * stride_ab + h, mask=hm, other=0.0).to(tl.float32)
        a = tl.load(ab_ptr + r * stride_ab + NV + h, mask=hm, other=0.0).to(tl.float32)
        a = a + tl.load(dtb_ptr + h, mask=hm, other=0.0).to(tl.float32)
        A = -tl.exp(tl.load(alog_ptr + h, mask=hm, other=0.0).to(tl.float32))
        g, beta = _decay(a, b, A)
        tl.store(g_ptr + r * NV + h, g, mask=hm)
        tl.store(beta_ptr + r * NV + h, beta, mask=hm)

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, stride_z, w_ptr, y_ptr, eps, DV: tl.constexpr, PDL: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        NVt = tl.num_programs(1)
        dv = tl.arange(0, DV)
        dt = y_ptr.dtype.element_ty
        of = tl.load(o_ptr + (r * NVt + h) * DV + dv).to(dt).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(of * of, axis=0) / DV + eps)
        xn = (of * rstd).to(dt).to(tl.float32)
        y = (tl.load(w_ptr + dv).to(tl.float32) * xn).to(dt).to(tl.float32)
        zf = tl.load(z_ptr + r * stride_z + h * DV + dv).to(tl.float32)
        sz = (zf / (1.0 + tl.exp(-zf))).to(dt).to(tl.float32)
        tl.store(y_ptr + (r * NVt + h) * DV + dv, (y * sz).to(dt))


def decay_rows(ab: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) [R, nv] fp32 from the raw b | a rows ``ab`` [R, 2 nv]: the log decay
    ``-exp(A_log) softplus(a + dt_bias)`` and ``sigmoid(b)``, as the row kernel computes them."""
    R, nv2 = ab.shape
    nv = nv2 // 2
    if ab.stride(1) != 1 or A_log.numel() != nv or dt_bias.numel() != nv:
        raise ValueError("decay_rows: ab [R, 2 nv] with contiguous rows and A_log, dt_bias [nv] expected")
    g = torch.empty(R, nv, dtype=torch.float32, device=ab.device)
    beta = torch.empty_like(g)
    _decay_kernel[(R,)](ab, ab.stride(0), A_log, dt_bias, g, beta, nv, NVP=triton.next_power_of_2(nv), num_warps=1)
    return g, beta


def gated_norm_rows(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    pdl: bool = False) -> torch.Tensor:
    """``rms_norm(o) * silu(z)`` per head for GDN outputs o [R, nv, dv] fp32 (:func:`gdn_rows`' or
    the WY kernel's), in z's dtype [R, nv * dv], rounded where the layer rounds."""
    R, nv, dv = o.shape
    if not o.is_contiguous() or z.shape != (R, nv * dv) or z.stride(1) != 1 or dv & (dv - 1):
        raise ValueError("gated_norm_rows: o [R, nv, dv] contiguous and z [R, nv * dv] expected")
    y = torch.empty(R, nv * dv, dtype=z.dtype, device=o.device)
    _gated_norm_kernel[(R, nv)](o, z, z.stride(0), norm_weight, y, float(eps), DV=dv, num_warps=1, **pdl_args(pdl, o))
    return y


def verify_method(rows: int, device) -> str:
    """``wy`` or ``path``: the faster GDN verification for a step of ``rows`` rows on ``device``, from
    the measured table ``kernels/gdn/tuned/<arch>.json`` (kernel ``verify``); ``path`` off CUDA,
    above the WY kernel's 64 rows, and where the table has no entry."""
    from specpilot.kernels import tuning

    arch = tuning.device_arch(device)
    if arch is None or rows > 64:
        return "path"
    found = tuning.lookup("gdn", "verify", arch, rows=rows)
    return found[0]["config"]["method"] if found else "path"


def default_warps(dk: int, dv: int) -> int:
    """Warps of the GDN row kernel. One value per head shape for every call, because the layout
    decides the order of the kernel's sums, and AR steps, verify rows and commits must agree bit
    for bit."""
    return 4


def _check_paths(paths: torch.Tensor, rows: int, device) -> None:
    if paths.dim() != 2 or paths.shape[0] != rows or paths.device != device or paths.dtype != torch.long:
        raise ValueError(f"paths must be an int64 [{rows}, depth] table on {device}, got "
                         f"{tuple(paths.shape)} {paths.dtype} on {paths.device}")
    if paths.shape[1] < 1 or paths.stride(1) != 1:
        raise ValueError("paths must have contiguous rows of at least one entry")


def conv_rows(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, paths: torch.Tensor | None = None,
              advance: bool = False, pdl: bool = False, slots: torch.Tensor | None = None,
              starts: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of rows ``x`` [R, C] along their root paths (``paths`` None:
    consecutive tokens), the committed ``conv_state`` [KW-1, C] supplying positions before the
    root; ``weight`` [C, KW]. Returns [R, C] in x's dtype. ``advance`` (R = 1): shift ``conv_state``
    in place by the row. ``slots`` [R] (continuous batching): row r belongs to the request whose
    conv state is ``conv_state[slots[r]]`` ([requests, KW-1, C]); without ``paths`` each row is the
    next token of its own request, and ``advance`` shifts each row's own state (rows of distinct
    slots); with ``paths`` (rows of x, every path within one request's rows) the rows are several
    requests' verify rows. ``starts`` [R] (with ``slots``, without ``paths``): several requests'
    prompt chunks one after another, row r the next token after rows ``starts[r] .. r - 1`` of
    its request (``starts[r]``: the chunk's first row). ``out``: an [R, C] tensor of x's dtype with
    contiguous rows to write the result into."""
    R, C = x.shape
    KW = weight.shape[1]
    cs = conv_state if slots is None else conv_state[0]
    if (weight.shape[0] != C or cs.shape != (KW - 1, C) or x.stride(1) != 1 or not conv_state.is_contiguous()
            or (slots is not None and (conv_state.dim() != 3 or slots.shape != (R,)))):
        raise ValueError(f"conv_rows: x [R, {C}] (contiguous rows), conv_state [{KW - 1}, {C}] (with slots [R]: "
                         f"[requests, {KW - 1}, {C}]), weight [{C}, {KW}] expected, got {tuple(x.shape)}, "
                         f"{tuple(conv_state.shape)}, {tuple(weight.shape)}")
    if advance and ((R != 1 and slots is None) or paths is not None):
        raise ValueError("conv_rows: advance shifts the conv state by one row only (one per slot, no paths)")
    if paths is not None:
        _check_paths(paths, R, x.device)
    if starts is not None and (slots is None or paths is not None or advance or starts.shape != (R,)):
        raise ValueError("conv_rows: starts [R] go with slots, without paths or advance")
    if out is not None and (out.shape != (R, C) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"conv_rows: out must be a {x.dtype} [{R}, {C}] tensor with contiguous rows")
    weight = weight.contiguous()
    if out is None:
        out = torch.empty(R, C, dtype=x.dtype, device=x.device)
    BC = 512
    D = paths.shape[1] if paths is not None else 1
    _conv_rows_kernel[(R, triton.cdiv(C, BC))](
        x, x.stride(0), conv_state, weight, out, out.stride(0), paths if paths is not None else
        (starts if starts is not None else x), paths.stride(0) if paths is not None else 0,
        x if slots is None else slots, conv_state.stride(0) if slots is not None else 0, C, D,
        KW=KW, BC=BC, SEQ=paths is None and slots is None, SLOTS=slots is not None,
        SELF=paths is None and slots is not None and starts is None, SEG=starts is not None, ADVANCE=advance,
        num_warps=4,
        **pdl_args(pdl, x))
    return out


def advance_conv_segments(conv_state: torch.Tensor, x: torch.Tensor, slots: list[int], starts: list[int],
                          lengths: list[int]) -> None:
    """Advance the conv states ``conv_state[slots[i]]`` ([requests, KW-1, C]) past rows
    ``starts[i] .. starts[i] + lengths[i] - 1`` of ``x`` [R, C]: each keeps the last KW-1 tokens
    of its old window followed by its rows (one gather and one indexed write for all requests)."""
    w = conv_state.shape[1]
    S = len(slots)
    idx = []
    for s, (a, n) in enumerate(zip(starts, lengths)):
        for j in range(w):   # position n + j of (old window ++ rows): the window's row j afterwards
            at = n + j
            idx.append(s * w + at if at < w else S * w + a + at - w)
    dev = x.device
    sl = torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True)
    src = torch.cat([conv_state.index_select(0, sl).reshape(S * w, -1), x.to(conv_state.dtype)])
    new = src.index_select(0, torch.tensor(idx, dtype=torch.long).to(dev, non_blocking=True))
    conv_state.index_copy_(0, sl, new.view(S, w, -1))


def gdn_rows(qkv: torch.Tensor, ab: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             state: torch.Tensor, paths: torch.Tensor | None, nk: int, *, output: bool = True,
             new_state: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = False,
             warps: int | None = None, slots: torch.Tensor | None = None) -> torch.Tensor | None:
    """The gated delta rule of every row along its root path (see the module doc).

    ``qkv`` [R, 2 * nk * dk + nv * dv]: the conv outputs (q | k | v, raw: normalised in the kernel);
    ``ab`` [R, 2 * nv]: the raw b (-> beta) then a (-> decay) projections; ``state`` [nv, dk, dv] fp32,
    the committed state (not modified unless it is ``new_state``); ``paths`` [P, depth] int64, or
    None: each row walks only itself (the AR step). Returns o [R, nv * dv] fp32 (the layer's gated
    norm is :func:`gated_norm_rows`). ``new_state``: the final state of the (single) row's path is
    written there (one path row; it may be ``state`` itself). ``output=False`` skips the output: a
    commit, whose single path (``paths`` [1, L]) lists the accepted rows of ``qkv``/``ab`` to replay.
    ``out``: a [R, nv * dv] fp32 view to write o into. ``warps``: for benchmarks (the default keeps
    every call's arithmetic the same, :func:`default_warps`). ``slots`` [R] (continuous batching):
    row r starts from the state of its request, ``state[slots[r]]`` ([requests, nv, dk, dv]);
    without ``paths`` each row is the next token of its own request, and with ``new_state``
    (``state`` itself) every row advances its own; with ``paths`` (every path within one request's
    rows) the rows are several requests' verify rows, outputs only; with ``paths`` [P, L],
    ``output=False`` and ``new_state`` the state itself, ``slots`` [P] (distinct) name the state
    each path is replayed into: the commit of several requests."""
    R = qkv.shape[0]
    P = paths.shape[0] if paths is not None else R
    if slots is not None:
        commit = paths is not None and not output and new_state is state
        if (state.dim() != 4 or slots.shape != (P,) or not (output or commit)
                or (new_state is not None and (new_state is not state or (paths is not None and output)))):
            raise ValueError("gdn_rows: slots take states [requests, nv, dk, dv] and either outputs (slots [R]; "
                             "new_state only as the state itself without paths) or a commit (paths [P, L], "
                             "slots [P], output=False, new_state the state itself)")
        nv, dk, dv = state.shape[1:]
    else:
        nv, dk, dv = state.shape
    key_dim = nk * dk
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("gdn_rows: the state must be a contiguous float32 [nv, dk, dv] tensor")
    if nv % nk or qkv.shape[1] != 2 * key_dim + nv * dv or ab.shape != (R, 2 * nv):
        raise ValueError(f"gdn_rows: qkv [R, {2 * key_dim + nv * dv}] and ab [R, {2 * nv}] expected for nk={nk}, "
                         f"state {tuple(state.shape)}; got {tuple(qkv.shape)} and {tuple(ab.shape)}")
    if qkv.stride(1) != 1 or ab.stride(1) != 1 or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError("gdn_rows: contiguous rows and power-of-two head dims expected")
    if new_state is not None and slots is None and (P != 1 or new_state.shape != state.shape
                                                    or not new_state.is_contiguous()):
        raise ValueError("gdn_rows: the state is written for one row's path only, into a tensor like the state")
    if paths is not None:
        _check_paths(paths, R if output else P, qkv.device)
    if out is not None and (out.shape != (R, nv * dv) or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"gdn_rows: out must be a float32 [{R}, {nv * dv}] view with contiguous rows")
    if out is None:
        out = torch.empty(R, nv * dv, dtype=torch.float32, device=qkv.device) if output else state
    bv = min(BLOCK_V, dv)
    _gdn_rows_kernel[(P, nv, dv // bv)](
        qkv, qkv.stride(0), ab, ab.stride(0), A_log, dt_bias,
        state, new_state if new_state is not None else state, paths if paths is not None else ab,
        paths.stride(0) if paths is not None else 0, paths.shape[1] if paths is not None else 1,
        out, out.stride(0) if output else 0, ab if slots is None else slots, state.stride(0) if slots is not None else 0,
        key_dim, nv,
        DK=dk, DV=dv, BV=bv, RATIO=nv // nk, CH=PATH_CHUNK, SELF=paths is None, SLOTS=slots is not None,
        OUTPUT=output, WRITE_STATE=new_state is not None,
        num_warps=warps or default_warps(dk, dv), **pdl_args(pdl, qkv))
    return out if output else None
