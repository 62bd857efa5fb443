"""The stream-K TMA-ring bf16 GEMM of verify steps (kernels/verify/ring.py) against its plain
reference, its schedule, its routing by the table, and bad input.

Gluon kernels do not run under Triton's interpreter: on the CPU the kernel is compiled for sm_90
and checked (the weight copies issued before ``griddepcontrol.wait``, x after it, no spills);
``-m gpu`` runs it at the engine's layer shapes and odd ones, eager and captured."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from specpilot.kernels import tuning  # noqa: E402
from specpilot.kernels.verify import blas, ring  # noqa: E402
from specpilot.kernels.verify import naive as R  # noqa: E402
from kernel_checks import gemm_inputs, within_bf16_rounding  # noqa: E402
from specpilot.engine.graphs import capture  # noqa: E402

needs_hopper_gluon = pytest.mark.skipif(not ring.AVAILABLE, reason="Triton without Gluon's Hopper module")


def _routed_configs() -> list[tuple[dict, int]]:
    """(config, x rows per program) of every ``ring`` entry of the sm90 table."""
    entries = [e for e in json.loads(tuning._path("verify", "sm90").read_text())["entries"] if e["kernel"] == "ring"]
    out = []
    for e in entries:
        for bm in sorted({ring.block_m(m) for m in range(e["rows"][0], e["rows"][1] + 1)}):
            if (e["config"], bm) not in out:
                out.append((e["config"], bm))
    return out


def _setup(cfg: ring.RingConfig, bm: int) -> str:
    return f"""
from specpilot.kernels.verify import ring as R
k = R._ring_kernel
sl = R.smem_layout()
acc, ep = R.layouts({cfg.block_n}, {bm})
ptrs = {{"y_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "w_desc": f"tensordesc<bf16[{cfg.block_n}, 64],{{sl!r}}>", "x_desc": f"tensordesc<bf16[{bm}, 64],{{sl!r}}>"}}
const = dict(BLOCK_N={cfg.block_n}, BLOCK_M={bm}, STAGES={cfg.stages}, ACC=acc, L_EP=ep, PDL=True,
             INFLIGHT={cfg.inflight}, KB={cfg.kboxes}, TRIGGER={cfg.trigger})
div = ["y_ptr", "ws_ptr", "lock_ptr", "stride_ym"]
warps = 4
"""


@needs_hopper_gluon
def test_every_routed_config_compiles_without_spills_and_copies_weights_before_the_wait():
    """Each routed config at the x rows its entry serves: no spills; the copy warp's first weight
    boxes (``cp.async.bulk.tensor``) are issued before ``griddepcontrol.wait`` and the x boxes after;
    the consumer runs ``wgmma`` on shared-memory operands; the dependents are triggered early
    (``griddepcontrol.launch_dependents``) exactly where the entry says so."""
    import re

    from gluon_ptx import ptxas_report

    routed = _routed_configs()
    assert routed and {c["trigger"] for c, _ in routed} == {0, 1}
    for conf, bm in routed:
        cfg = ring.RingConfig(**conf)
        rep = ptxas_report(_setup(cfg, bm))
        assert rep["rc"] == 0, rep["log"][-2000:]
        assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", rep["log"]), rep["log"]
        assert "C7517" not in rep["log"], rep["log"]       # no wgmma wait injected by ptxas
        ptx = rep["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert 0 < ptx.find("cp.async.bulk.tensor") < wait < ptx.find("cp.async.bulk.tensor", wait)
        assert "wgmma.mma_async" in ptx
        assert ("griddepcontrol.launch_dependents" in ptx) == bool(cfg.trigger)


@pytest.mark.parametrize("nb,kt,programs", [(48, 32, 132), (448, 16, 132), (1, 64, 132), (3, 5, 4), (7, 1, 132),
                                             (64, 56, 264)])
def test_schedule_gives_every_tile_to_one_program_and_sizes_the_slots(nb, kt, programs):
    """Equal runs of (block, tile) pairs, none empty, none past the end; the workspace slots cover
    the most programs any block's tiles span."""
    per, progs, slots = ring.schedule(nb, kt, programs)
    runs = [range(p * per, min(p * per + per, nb * kt)) for p in range(progs)]
    assert progs <= programs and all(len(r) > 0 for r in runs)
    assert sorted(g for r in runs for g in r) == list(range(nb * kt))
    spans = [len({g // per for g in range(b * kt, b * kt + kt)}) for b in range(nb)]
    assert max(spans) <= slots <= progs


def test_input_checks():
    x, w = gemm_inputs(16, 128, 64)
    assert not ring.supported(x, w)        # CPU tensors
    with pytest.raises(ValueError, match="ring_linear takes 1-64 contiguous bf16 rows"):
        ring.ring_linear(x, w)
    assert [ring.block_m(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]


def test_table_routes_the_llama_layers_at_9_to_16_rows():
    """The sm90 table's ``ring`` entries: Llama-3.1-8B's four projections at 9-16 rows; other rows
    and layers take the other kernels; on the CPU every call is ``F.linear``."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        assert [blas._ring("sm90", n, k, m) is not None for m in (8, 9, 16, 17, 33)] == [False, True, True, False,
                                                                                         False]
    assert blas._ring("sm90", 12352, 4096, 16) is None
    x, w = gemm_inputs(12, 128, 32)
    assert torch.equal(blas.linear(x, w), torch.nn.functional.linear(x, w))


gpu = pytest.mark.gpu


def _hopper():
    if not torch.cuda.is_available() or not ring.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU and Gluon")


@gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (200, 130),
                                 (4096, 12352)])
@pytest.mark.parametrize("m", [1, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("cfg", [ring.RingConfig(64, 4, kboxes=4), ring.RingConfig(64, 2, kboxes=4),
                                 ring.RingConfig(128, 3, kboxes=2), ring.RingConfig(64, 4, 2, 128, 1, 2),
                                 ring.RingConfig(128, 6, inflight=0), ring.RingConfig(64, 4, kboxes=4, trigger=1)],
                         ids=lambda c: c.key())
def test_ring_matches_the_reference_on_cuda(k, n, m, cfg):
    """Every row count and config against fp32, bitwise the same on a second call: blocks split
    across programs (the fixed-order sum), N and K not multiples of the tiles (TMA zero fill).
    The routed config (4 stages of 4 boxes) fits shared memory up to 16 x rows only."""
    _hopper()
    if cfg.stages * cfg.kboxes > 8 and m > 16:
        pytest.skip("the ring does not fit an SM's shared memory at this many x rows")
    x, w = gemm_inputs(m, k, n, seed=m + n, device="cuda")
    want = R.linear(x.float(), w.float())
    got = ring.ring_linear(x, w, cfg)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert within_bf16_rounding(got, want), float((got.float() - want).abs().max())
    assert torch.equal(got, ring.ring_linear(x, w, cfg))


@gpu
def test_ring_in_a_cuda_graph_gives_the_eager_bits_and_blas_routes_it(monkeypatch):
    _hopper()
    x, w = gemm_inputs(12, 4096, 4096, seed=3, device="cuda")
    cfg = blas.ring_config(x.device, 4096, 4096, 12)
    assert cfg is not None
    eager = blas.linear(x, w)
    assert torch.equal(eager, ring.ring_linear(x, w, cfg))
    g, y = capture(lambda: blas.linear(x, w), 1)
    x.copy_(gemm_inputs(12, 4096, 4096, seed=4, device="cuda")[0])
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ring.ring_linear(x, w, cfg))

    def refused(*a, **kw):
        raise AssertionError("a step outside the table's rows took the ring GEMM")

    monkeypatch.setattr(ring, "ring_linear", refused)
    x32, _ = gemm_inputs(32, 4096, 4096, seed=5, device="cuda")
    assert within_bf16_rounding(blas.linear(x32, w), R.linear(x32.float(), w.float()))


@gpu
def test_early_trigger_keeps_the_dependents_reading_the_finished_output():
    """A ring that lets its dependents launch at its start (``trigger=1``), followed by PDL kernels
    that read its output (the row kernel of a step, then the next ring GEMM and row kernel), gives
    the bits of the same chain with ``trigger=0``, eager and in a CUDA graph, over many replays."""
    _hopper()
    from specpilot.kernels.verify import rows

    x, w1 = gemm_inputs(16, 4096, 4096, seed=7, device="cuda")
    _, w2 = gemm_inputs(16, 4096, 4096, seed=8, device="cuda")
    resid = torch.randn_like(x)
    gamma = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(trigger):
        cfg = ring.RingConfig(64, 4, kboxes=4, trigger=trigger)
        s, h = rows.add_rms_norm_rows(resid, ring.ring_linear(x, w1, cfg), gamma, 1e-5)
        return rows.add_rms_norm_rows(s, ring.ring_linear(h, w2, cfg), gamma, 1e-5)

    want = chain(0)
    assert all(torch.equal(a, b) for a, b in zip(chain(1), want))
    g, got = capture(lambda: chain(1), 1)
    for _ in range(20):
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_configs_are_refused(monkeypatch):
    monkeypatch.setattr(ring, "supported", lambda x, w: True)
    x, w = gemm_inputs(16, 128, 64)
    for bad in (ring.RingConfig(block_n=96), ring.RingConfig(stages=1), ring.RingConfig(per_sm=0),
                ring.RingConfig(inflight=2), ring.RingConfig(kboxes=3), ring.RingConfig(trigger=2)):
        with pytest.raises(ValueError, match="ring config"):
            ring.ring_linear(x, w, bad)
