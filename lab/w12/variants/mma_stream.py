"""Stream-K schedule for the W12 tensor-core kernel (:mod:`.mma`): a fixed number of programs, each
taking an equal run of the layer's (row block, record) pairs.

With one program per (row block, K split), every program pays a prologue (the first records' and
x's round trips) and an epilogue (split-K partial, counter, escapes) of its own, and on small layers
there are only 2-3 waves of short programs: Nsight measured 11 % achieved occupancy and SMs active
73 % of the time at 8-32 rows. Here ``sms * programs_per_sm`` programs walk the pairs
``g = block * KT + t`` in order, ``L`` each, through the same cp.async shared-memory ring as
``wsmem`` (weights and x, ``depth`` records ahead). The ring does not stop at a block's end: the
next block's records are already in flight while the finished block's epilogue runs.

A block's records end up in one program (finished directly) or in a few consecutive ones (each
writes its partial to the block's slot ``program - first program``; the last to arrive sums the
slots in slot order). The split of every block depends only on the shape and ``L``, so results are
bitwise identical run to run, like the other W12 kernels. The plain reference is
:func:`.naive.w12_linear_ref`.

On the H200 it measured slower than the split grid on every layer at 8 and 32 rows
(by 5-30 %; its in-loop epilogue takes 168 registers at
64 x 32), so ``w12_linear`` does not route here; ``MmaConfig(..., wsmem=True, stream=P)`` selects it.
"""

from __future__ import annotations

import torch

from specpilot.kernels.verify.ring import schedule  # noqa: F401 - the same stream-K split (records per program)

from .gemm import KernelPack, _workspace
from .mma import gl, gluon, launch_options


if gluon is not None:
    from .mma import _copy_offsets, _cp_async, _cta_barrier, _epilogue, _finalize, _wsmem_mma, _x_copy, async_copy

    @gluon.jit
    def _w_copy_at(wv_s, wq_s, rec_ptr, g, KT, ok, offc_v, offc_q, BLOCK_N: gl.constexpr, QPASS: gl.constexpr):
        """Start copying pair ``g``'s record (block ``g // KT``, record ``g % KT``): the block's rows'
        view (and nibble) words into one stage of the weight ring (cp.async, 16 bytes per thread)."""
        n0 = (g // KT) * BLOCK_N
        base = ((n0 // 128).to(gl.int64) * KT + g % KT) * 3072
        r_in = n0 % 128
        _cp_async(wv_s, rec_ptr + base + r_in * 16 + offc_v, mask=ok)
        if not QPASS:
            _cp_async(wq_s, rec_ptr + base + r_in * 8 + offc_q, mask=ok)

    @gluon.jit
    def _w12_mma_stream_kernel(
        x_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, NUM_N_BLOCKS, PER, SLOTS,
        stride_xm, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, QPASS: gl.constexpr, ESC_CH: gl.constexpr,
        DEPTH: gl.constexpr, PLAIN: gl.constexpr,
        L_VIEW: gl.constexpr, L_NIB: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr,
        A_OP: gl.constexpr, B_OP: gl.constexpr, L_EP: gl.constexpr, L_XC: gl.constexpr, XS: gl.constexpr,
        L_WC: gl.constexpr, L_QC: gl.constexpr, WSL: gl.constexpr,
    ):
        pid = gl.program_id(0)
        pid_m = gl.program_id(1)
        g_begin = pid * PER
        g_end = gl.minimum(g_begin + PER, NUM_N_BLOCKS * KT)
        rows_c = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_XC))
        kc = gl.arange(0, 64, layout=gl.SliceLayout(0, L_XC))
        XD: gl.constexpr = DEPTH + 1
        xs = gl.allocate_shared_memory(gl.bfloat16, [XD, BLOCK_M, 64], XS)
        wv_s = gl.allocate_shared_memory(gl.int32, [XD, BLOCK_N, 16], WSL)
        wq_s = gl.allocate_shared_memory(gl.int32, [XD, BLOCK_N, 8], WSL)
        offc_v, offc_q = _copy_offsets(0, BLOCK_N, L_WC, L_QC)     # the block's r_in is added per copy
        for i in gl.static_range(DEPTH):
            ok = g_begin + i < g_end
            _w_copy_at(wv_s.index(i), wq_s.index(i), rec_ptr, g_begin + i, KT, ok, offc_v, offc_q, BLOCK_N, QPASS)
            _x_copy(xs.index(i), x_ptr, rows_c, kc, (g_begin + i) % KT, ok, M, K, stride_xm)

        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        for g in range(g_begin, g_end):
            it = g - g_begin
            async_copy.wait_group(DEPTH - 1)        # this thread's copies of pair g have landed
            _cta_barrier()                          # ... everyone's, and stage (it - 1) is free again
            nxt = (it + DEPTH) % XD
            ok = g + DEPTH < g_end
            _w_copy_at(wv_s.index(nxt), wq_s.index(nxt), rec_ptr, g + DEPTH, KT, ok, offc_v, offc_q, BLOCK_N, QPASS)
            _x_copy(xs.index(nxt), x_ptr, rows_c, kc, (g + DEPTH) % KT, ok, M, K, stride_xm)
            acc = _wsmem_mma(acc, xs, wv_s, wq_s, it % XD, BLOCK_M, BLOCK_N, QPASS, L_VIEW, L_NIB, L_X, A_OP, B_OP,
                             PLAIN)
            blk = g // KT
            if (g % KT == KT - 1) | (g == g_end - 1):   # the end of this program's part of block blk
                first = (blk * KT) // PER                 # the programs that hold block blk's records
                last = ((blk + 1) * KT - 1) // PER
                if first == last:
                    _finalize(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, blk * BLOCK_N,
                              pid_m, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)
                else:
                    _epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr,
                              lock_ptr, blk * BLOCK_N, blk, pid - first, pid_m, M, N, NUM_N_BLOCKS, last - first + 1,
                              SLOTS, stride_xm, stride_ym, BLOCK_N, BLOCK_M, True, ESC_CH, MMA, L_EP)
                acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        async_copy.wait_group(0)


def launch(x: torch.Tensor, packed: KernelPack, out: torch.Tensor, qpass: bool, cfg, bm: int, mb: int,
           esc_ch: int, layouts: tuple, wsmem_layouts: tuple) -> None:
    """Launch the stream-K kernel for ``cfg`` (``stream`` programs per SM, the ``wsmem`` ring of
    ``depth`` records); ``x`` is already aligned (:func:`.mma.aligned_x`)."""
    m, k = x.shape
    n, kt = packed.shape[0], packed.k_tiles
    nb = (n + cfg.block_n - 1) // cfg.block_n
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    per, progs, slots = schedule(nb, kt, sms * cfg.stream)
    ws, locks = _workspace(x.device, nb * mb * slots * cfg.block_n * bm if slots > 1 else 1, nb * mb)
    l_view, l_nib, l_x, mma, a_op, b_op, l_ep, l_xc, xs = layouts
    l_wc, l_qc, wsl = wsmem_layouts
    _w12_mma_stream_kernel[(progs, mb)](
        x, out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, nb, per, slots,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, QPASS=qpass, ESC_CH=esc_ch, DEPTH=cfg.depth, PLAIN=cfg.plain_decode,
        L_VIEW=l_view, L_NIB=l_nib, L_X=l_x, MMA=mma, A_OP=a_op, B_OP=b_op, L_EP=l_ep, L_XC=l_xc,
        XS=xs, L_WC=l_wc, L_QC=l_qc, WSL=wsl,
        num_warps=cfg.num_warps, **launch_options(cfg),
    )
