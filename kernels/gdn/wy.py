"""TreeWY verification of a GDN tree: every row's output from a few matrix products (paper 4.2).

What: :func:`wy_verify` gives each tree row its Gated DeltaNet output at the end of its own root
path, the numbers :func:`.path.path_verify` gives on :func:`.naive.prepare`d inputs, in one
kernel launch, without walking the paths.

Why: the path kernel holds one [dk, dv] state per row and applies its path's rank-one updates one
after another. Written the TreeWY way, the updates of all rows become one lower-triangular solve
over the rows plus matrix products, and the big products run on tensor cores.

The math, per value head (S [dk, dv]; a_j = exp(g_j); P(i) the root path of row i including i;
G_i the sum of g over P(i), Gamma_i = exp(G_i); kn, qn normalised as in ``naive.prepare``)::

    delta_j = beta_j (v_j - a_j S_parent(j)^T kn_j)
    S_i     = Gamma_i S0 + sum_{j in P(i)} exp(G_i - G_j) kn_j delta_j^T
    (I + A) Delta = diag(beta) (V - diag(Gamma) Kn S0),  A_jl = beta_j exp(G_j - G_l) kn_j.kn_l
                                                          for l a strict ancestor of j
    O = diag(Gamma) Qn S0 + (M o L) Delta,               L_ij = exp(G_i - G_j) qn_i.kn_j

M is the ancestor-or-self mask, built from ``paths`` on the device. Parents precede children, so
A is strictly lower triangular. The solve: the 16x16 diagonal blocks of I + A are inverted
(all blocks at once, by recursive doubling), then block forward substitution, block row by block
row: Delta_I = Tb_I (rhs_I - sum_{J<I} A_IJ Delta_J).

Precision: the products with S0 (Q S0, K S0) split the fp32 state into three bf16 pieces,
s1 = bf16(S0), s2 = bf16(S0 - s1), s3 = bf16(S0 - s1 - s2), which hold its 24-bit mantissa
exactly, and multiply them with the RAW bf16 q/k rows (exact in bf16) accumulating in fp32; the
per-row normalisation (and Gamma, beta) scales the fp32 result afterwards. K K^T and Q K^T are
raw too. fp32 inputs take fp32 (``ieee``) dots. The [R, R] and [R, R] x [R, dv] parts are fp32.

Grid: (value head, dv block[, request]); a program holds all rows of its head, padded to 16/32/64
(:func:`wy_verify_segments`: the rows of one request of a batched step, from that request's
state). A tree of 2^k + 1 rows (33 = root + 32 nodes) would need the next tile: the program
applies the root to its state columns first (one delta-rule step) and the nodes, a forest under
it, fill the smaller tile. Rows above :data:`MAX_ROWS` are refused (ValueError): the caller uses
the path kernel then.
Nothing here syncs with the host, so the launch can be captured in a CUDA graph; for the same
reason ``paths`` is trusted as ``row_paths`` builds it (topological order, -1 padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.triton_env import interpreting, tl, triton

MAX_ROWS = 64      # rows of a tree a program holds (root + 63 nodes)
BLOCK = 16         # rows of a diagonal block of the solve (the smallest tensor-core tile)
BLOCK_V = 32       # dv columns per program: 32 heads x 4 blocks fill an H200's SMs at dv=128
SMALL_DOT = "ieee"  # precision of the small fp32 products ([R, R] x [R, R], [R, R] x [R, BV])


if triton is not None:

    @triton.jit
    def _raw_dot(a, b, acc, BF16: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b, fp32 accumulation. bf16 operands go to tensor cores as they are (their
        products are exact in fp32); the interpreter's bf16 dot is wrong, so there they go up
        to fp32 first (exact too)."""
        if BF16 and not UPCAST:
            return tl.dot(a, b, acc, out_dtype=tl.float32)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def _wy_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, p_ptr, o_ptr, seg_ptr,
                   R, D, DK, DV, GROUP, scale,
                   sq_r, sq_h, sq_d, sk_r, sk_h, sk_d, sv_r, sv_h, sv_d,
                   sg_r, sg_h, sb_r, sb_h, ss_b, ss_h, ss_k, ss_v, sp_r, sp_d, so_r, so_h,
                   RP: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr,
                   BF16: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROOT: tl.constexpr,
                   SEGS: tl.constexpr):
        h = tl.program_id(0)
        start = 0
        if SEGS:   # several requests: segment (first row, rows, state slot); paths name rows of the launch
            seg = tl.program_id(2)
            start = tl.load(seg_ptr + seg * 3)
            R = tl.load(seg_ptr + seg * 3 + 1)
            s_ptr += tl.load(seg_ptr + seg * 3 + 2).to(tl.int64) * ss_b
            q_ptr += start * sq_r
            k_ptr += start * sk_r
            v_ptr += start * sv_r
            g_ptr += start * sg_r
            b_ptr += start * sb_r
            p_ptr += start * sp_r
            o_ptr += start * so_r
        kh = h // GROUP                      # GQA: repeat_interleave of the key heads
        dks = tl.arange(0, DKP)
        dvs = tl.program_id(1) * BV + tl.arange(0, BV)
        km, vm = dks < DK, dvs < DV
        s = tl.load(s_ptr + h * ss_h + dks[:, None] * ss_k + dvs[None, :] * ss_v,
                    mask=km[:, None] & vm[None, :], other=0.0)
        if ROOT:
            # row 0 (the root) applied to this program's columns of the state, one delta-rule step
            # as naive.step; the tile then holds the nodes (rows 1..R), a forest under the root
            q0 = tl.load(q_ptr + kh * sq_h + dks * sq_d, mask=km, other=0.0).to(tl.float32)
            k0 = tl.load(k_ptr + kh * sk_h + dks * sk_d, mask=km, other=0.0).to(tl.float32)
            q0 = q0 * (tl.math.rsqrt(tl.sum(q0 * q0, 0) + 1e-6) * scale)
            k0 = k0 * tl.math.rsqrt(tl.sum(k0 * k0, 0) + 1e-6)
            v0 = tl.load(v_ptr + h * sv_h + dvs * sv_d, mask=vm, other=0.0).to(tl.float32)
            s = s * tl.exp(tl.load(g_ptr + h * sg_h).to(tl.float32))
            d0 = (v0 - tl.sum(s * k0[:, None], 0)) * tl.load(b_ptr + h * sb_h).to(tl.float32)
            s = s + k0[:, None] * d0[None, :]
            tl.store(o_ptr + h * so_h + dvs, tl.sum(s * q0[:, None], 0), mask=vm)
            q_ptr += sq_r
            k_ptr += sk_r
            v_ptr += sv_r
            g_ptr += sg_r
            b_ptr += sb_r
            o_ptr += so_r
        rows = tl.arange(0, RP)
        rm = rows < R

        # raw q/k rows, kept in their dtype for the dots; the norms in fp32 as in naive.prepare
        qk_m = rm[:, None] & km[None, :]
        q = tl.load(q_ptr + rows[:, None] * sq_r + kh * sq_h + dks[None, :] * sq_d, mask=qk_m, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * sk_r + kh * sk_h + dks[None, :] * sk_d, mask=qk_m, other=0.0)
        qf, kf = q.to(tl.float32), k.to(tl.float32)
        rq = tl.math.rsqrt(tl.sum(qf * qf, 1) + 1e-6) * scale
        rk = tl.math.rsqrt(tl.sum(kf * kf, 1) + 1e-6)

        # Qn S0 and Kn S0 from the raw rows and the state's three bf16 pieces (or fp32 as is)
        zero = tl.zeros((RP, BV), dtype=tl.float32)
        if BF16:
            s1 = s.to(tl.bfloat16)
            r1 = s - s1.to(tl.float32)       # exact in fp32
            s2 = r1.to(tl.bfloat16)
            s3 = (r1 - s2.to(tl.float32)).to(tl.bfloat16)
            # smallest piece first: the fp32 accumulator takes the large terms last
            qs = _raw_dot(q, s1, _raw_dot(q, s2, _raw_dot(q, s3, zero, BF16, UPCAST), BF16, UPCAST), BF16, UPCAST)
            ks = _raw_dot(k, s1, _raw_dot(k, s2, _raw_dot(k, s3, zero, BF16, UPCAST), BF16, UPCAST), BF16, UPCAST)
        else:
            qs = _raw_dot(qf, s, zero, BF16, UPCAST)
            ks = _raw_dot(kf, s, zero, BF16, UPCAST)
        qs = qs * rq[:, None]
        ks = ks * rk[:, None]

        # ancestor-or-self mask: anc[i, j] = row j lies on row i's root path, i.e. row i's entry
        # at row j's depth is j. Two loads, not one per depth (a path is at most R <= RP long, so
        # the first RP entries of a row hold all of it)
        p_row = p_ptr + rows[:, None] * sp_r
        pt = tl.load(p_row + rows[None, :] * sp_d, mask=rm[:, None] & (rows[None, :] < D), other=-1)
        depth = tl.sum((pt >= 0).to(tl.int32), 1) - 1
        at = tl.load(p_row + depth[None, :] * sp_d, mask=rm[:, None] & rm[None, :], other=-1)
        anc = at == rows[None, :] + start
        g = tl.load(g_ptr + rows * sg_r + h * sg_h, mask=rm, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + rows * sb_r + h * sb_h, mask=rm, other=0.0).to(tl.float32)
        G = tl.sum(tl.where(anc, g[None, :], 0.0), 1)
        gam = tl.exp(G)
        # decay from row j to its descendant i; -inf off the mask so no inf * 0 appears
        E = tl.exp(tl.where(anc, G[:, None] - G[None, :], float("-inf")))

        zr = tl.zeros((RP, RP), dtype=tl.float32)
        kk = _raw_dot(k, tl.trans(k), zr, BF16, UPCAST) * (rk[:, None] * rk[None, :])
        qk = _raw_dot(q, tl.trans(k), zr, BF16, UPCAST) * (rq[:, None] * rk[None, :])
        A = tl.where(rows[:, None] > rows[None, :], beta[:, None] * E * kk, 0.0)
        LM = E * qk

        v = tl.load(v_ptr + rows[:, None] * sv_r + h * sv_h + dvs[None, :] * sv_d,
                    mask=rm[:, None] & vm[None, :], other=0.0).to(tl.float32)
        rhs = beta[:, None] * (v - gam[:, None] * ks)

        # the rows in NB blocks of BS: A4[I, i, J, l] = A[I*BS + i, J*BS + l]
        NB: tl.constexpr = RP // BS
        LOG_BS: tl.constexpr = BS.bit_length() - 1
        bi = tl.arange(0, NB)
        A4 = tl.reshape(A, (NB, BS, NB, BS))
        A3 = tl.sum(tl.where(bi[:, None, None, None] == bi[None, None, :, None], A4, 0.0), 2)  # diagonal blocks

        # Tb: inverse of every diagonal block of I + A, all blocks at once, by recursive doubling:
        # with T the inverse on blocks of 2^s rows, the inverse on blocks of 2^(s+1) rows is
        # T - T A_s T, A_s the lower-left 2^s-block inside each 2^(s+1)-block (the two halves'
        # inverses are T's diagonal blocks, the corner is -T22 A21 T11). Three levels of small
        # batched dots instead of a 15-step row recurrence, whose row reductions cross warps.
        ii = tl.arange(0, BS)[None, :, None]
        ll = tl.arange(0, BS)[None, None, :]
        Tb = tl.where(ii == ll, 1.0, 0.0) - tl.where(ii // 2 == ll // 2, A3, 0.0)   # blocks of 2 rows
        for lvl in tl.static_range(1, LOG_BS):
            As = tl.where(((ii >> (lvl + 1)) == (ll >> (lvl + 1))) & ((ii >> lvl) != (ll >> lvl)), A3, 0.0)
            Tb = Tb - tl.dot(Tb, tl.dot(As, Tb, input_precision=PREC), input_precision=PREC)

        # block forward substitution, one block row at a time:
        # Delta_I = Tb_I (rhs_I - sum_{J < I} A_IJ Delta_J); only the blocks below the diagonal
        # are multiplied (a dense T (I + A)^-1 product would do 3-4x the fp32 work, and spill)
        nb3 = bi[:, None, None]
        rhs3 = tl.reshape(rhs, (NB, BS, BV))
        x3 = tl.zeros((NB, BS, BV), dtype=tl.float32)
        for I in tl.static_range(NB):
            r_i = tl.sum(tl.where(nb3 == I, rhs3, 0.0), 0)
            if I > 0:  # rows of block I against all rows (blocks >= I of x3 are still zero)
                a_i = tl.reshape(tl.sum(tl.where(bi[:, None, None, None] == I, A4, 0.0), 0), (BS, RP))
                r_i = r_i - tl.dot(a_i, tl.reshape(x3, (RP, BV)), input_precision=PREC)
            x_i = tl.dot(tl.sum(tl.where(nb3 == I, Tb, 0.0), 0), r_i, input_precision=PREC)
            x3 = tl.where(nb3 == I, x_i[None, :, :], x3)
        x = tl.reshape(x3, (RP, BV))

        o = gam[:, None] * qs + tl.dot(LM, x, input_precision=PREC)
        tl.store(o_ptr + rows[:, None] * so_r + h * so_h + dvs[None, :], o, mask=rm[:, None] & vm[None, :])


def _check(q, k, v, g, beta, state, paths):
    """Shapes, dtypes and devices, host metadata only (no syncs); ValueError with the reason."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [R, nk, dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    R, nk, dk = q.shape
    if R < 1 or R > MAX_ROWS:
        raise ValueError(f"wy_verify takes 1..{MAX_ROWS} rows, got R={R} (use path_verify for more)")
    if v.dim() != 3 or v.shape[0] != R:
        raise ValueError(f"v must be [R={R}, nv, dv], got {tuple(v.shape)}")
    nv, dv = v.shape[1], v.shape[2]
    if nk < 1 or nv % nk:
        raise ValueError(f"nv={nv} value heads must be a multiple of nk={nk} key heads")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (R, nv):
            raise ValueError(f"{name} must be [R={R}, nv={nv}], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if tuple(state.shape) != (nv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [nv={nv}, dk={dk}, dv={dv}], got {state.dtype} {tuple(state.shape)}")
    if paths.dim() != 2 or paths.shape[0] != R or paths.shape[1] < 1 or paths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paths must be an integer [R={R}, D>=1] tensor, got {paths.dtype} {tuple(paths.shape)}")
    if q.dtype != k.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q and k must share a dtype among bf16/fp16/fp32, got {q.dtype} and {k.dtype}")
    if not v.is_floating_point():
        raise ValueError(f"v must be floating point, got {v.dtype}")
    devices = {t.device for t in (q, k, v, g, beta, state, paths)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if not q.is_cuda and not interpreting():
        raise ValueError("wy_verify runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")


def padded_rows(rows: int) -> int:
    """The rows a program holds for a tree of ``rows`` rows (tiles are powers of two, at least 16;
    a tree of 2^k + 1 rows is its root, applied first in the kernel, and a tile of 2^k nodes)."""
    return max(BLOCK, triton.next_power_of_2(rows - 1 if root_first(rows) else rows))


def root_first(rows: int) -> bool:
    """Whether the kernel applies the root of a ``rows``-row tree first (its nodes fit a smaller tile)."""
    return rows > 1 and max(BLOCK, triton.next_power_of_2(rows - 1)) < max(BLOCK, triton.next_power_of_2(rows))


@dataclass(frozen=True)
class Config:
    """Launch config of the WY kernel: dv columns per program, warps, and the precision of the small
    fp32 products ("tf32x3" moves them to tensor cores at near-fp32 accuracy). The default won at
    every tile (16, 32, 64 rows) at Qwen3.5-9B shapes on the H200 (``lab/gdn/wy_sweep.py``)."""
    block_v: int = BLOCK_V
    warps: int = 4
    small_dot: str = SMALL_DOT


def node_paths(paths: torch.Tensor) -> torch.Tensor:
    """The nodes' paths without the root, in node numbering (row r -> r - 1): the tile's paths when
    the kernel applies the root first."""
    return (paths[1:, 1:] - 1).clamp(min=-1)


def _launch(config: Config | None, R: int, dk: int, nv: int, dv: int, out, device):
    """(config, padded dk, dv block, output [R, nv, dv] fp32: ``out`` checked, or a new tensor)."""
    cfg = config or Config()
    if out is not None and (out.shape != (R, nv, dv) or out.dtype != torch.float32 or out.stride(2) != 1):
        raise ValueError(f"out must be fp32 [R={R}, nv={nv}, dv={dv}] with contiguous rows, got {tuple(out.shape)}")
    o = out if out is not None else torch.empty((R, nv, dv), dtype=torch.float32, device=device)
    return cfg, max(16, triton.next_power_of_2(dk)), min(cfg.block_v, max(16, triton.next_power_of_2(dv))), o


def wy_verify(q, k, v, g, beta, state, paths, out=None, nodes=None, config: Config | None = None):
    """Every row's GDN output at the end of its root path, [R, nv, dv] fp32 (into ``out`` if given).

    q, k [R, nk, dk] raw (unnormalised) bf16/fp32; v [R, nv, dv]; g (log decay) and beta [R, nv];
    state [nv, dk, dv] fp32 (not modified); paths [R, D] from :func:`.path.row_paths` (rows in
    topological order, row 0 the root), on the device. Value head h reads key head h // (nv // nk).
    Equals ``path_verify(*naive.prepare(q_rep, k_rep, v, g, beta), state, paths)`` with q, k
    repeated over the value heads. ``nodes``: :func:`node_paths` of ``paths`` where the caller keeps
    it (a tree of 2^k + 1 rows needs it; made here otherwise). R > 64 (and bad shapes) raise
    ValueError."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("wy_verify needs triton")
    _check(q, k, v, g, beta, state, paths)
    R, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    root = root_first(R)
    RP = padded_rows(R)
    cfg, DKP, BV, o = _launch(config, R, dk, nv, dv, out, q.device)
    if root:
        if nodes is None:
            nodes = node_paths(paths)
        elif tuple(nodes.shape) != (R - 1, paths.shape[1] - 1):
            raise ValueError(f"nodes must be [{R - 1}, {paths.shape[1] - 1}] (node_paths of paths), "
                             f"got {tuple(nodes.shape)}")
    tile_paths = nodes if root else paths
    _wy_kernel[(nv, triton.cdiv(dv, BV))](
        q, k, v, g, beta, state, tile_paths, o, tile_paths,
        R - root, tile_paths.shape[1], dk, dv, nv // nk, float(dk) ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), 0, *state.stride(),
        *tile_paths.stride(), o.stride(0), o.stride(1),
        RP=RP, DKP=DKP, BV=BV, BS=BLOCK, BF16=q.dtype == torch.bfloat16, UPCAST=interpreting(),
        PREC=cfg.small_dot, ROOT=root, SEGS=False, num_warps=cfg.warps)
    return o


def wy_verify_segments(q, k, v, g, beta, states, paths, segs, most: int, out=None,
                       config: Config | None = None):
    """:func:`wy_verify` for the verify rows of several requests in one launch (continuous
    batching): ``segs`` [n, 3] int32 on the device (first row, rows, state slot) cuts the rows into
    requests; request i's rows start from ``states[slot]`` ([slots, nv, dk, dv] fp32, not modified)
    and ``paths`` [R, D] give every row's root path as rows of the launch (within its request's
    rows, topological order). ``most``: the most rows of a request (host value, <= 64; it sets the
    tile, so every request of the launch runs the same arithmetic). The tile holds a request's root
    with its nodes (no root-first split). Output [R, nv, dv] fp32 (into ``out`` if given)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("wy_verify needs triton")
    if states.dim() != 4:
        raise ValueError(f"states must be [slots, nv, dk, dv], got {tuple(states.shape)}")
    R, nk, dk = q.shape
    if not 1 <= most <= MAX_ROWS:
        raise ValueError(f"wy_verify_segments takes requests of 1..{MAX_ROWS} rows, got most={most}")
    _check(q[:1], k[:1], v[:1], g[:1], beta[:1], states[0], paths[:1])
    if v.shape[0] != R or g.shape[0] != R or beta.shape[0] != R or paths.shape[0] != R:
        raise ValueError(f"q, k, v, g, beta and paths must have the same rows, got {q.shape[0]}, {v.shape[0]}, "
                         f"{g.shape[0]}, {beta.shape[0]}, {paths.shape[0]}")
    if segs.dim() != 2 or segs.shape[1] != 3 or segs.dtype != torch.int32 or segs.device != q.device:
        raise ValueError("segs must be an int32 [n, 3] table (first row, rows, slot) on the rows' device")
    nv, dv = v.shape[1], v.shape[2]
    cfg, DKP, BV, o = _launch(config, R, dk, nv, dv, out, q.device)
    _wy_kernel[(nv, triton.cdiv(dv, BV), segs.shape[0])](
        q, k, v, g, beta, states, paths, o, segs,
        0, paths.shape[1], dk, dv, nv // nk, float(dk) ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *states.stride(),
        *paths.stride(), o.stride(0), o.stride(1),
        RP=max(BLOCK, triton.next_power_of_2(most)), DKP=DKP, BV=BV, BS=BLOCK, BF16=q.dtype == torch.bfloat16,
        UPCAST=interpreting(), PREC=cfg.small_dot, ROOT=False, SEGS=True, num_warps=cfg.warps)
    return o
