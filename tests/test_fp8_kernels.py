"""The FP8 Q pass's kernels (kernels/fp8) against their plain references, the verify step's row
kernels taking and giving split rows, and the engine's fp8 Q pass (``qview=fp8``).

On the CPU the Triton kernels run under the interpreter (exact here too: the kernels round to e4m3
in float32 arithmetic); ``-m gpu`` runs them at Llama-3.1-8B shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from specpilot.kernels.fp8 import SplitRows, fp8_linear, naive, quantize_weight  # noqa: E402
from specpilot.kernels.fp8 import rows as F  # noqa: E402
from specpilot.kernels.verify import rows as W  # noqa: E402
from kernel_checks import DEV, rope_tables  # noqa: E402


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int16 if
                                                                                              t.element_size() == 2
                                                                                              else torch.int32)


def _same(a: SplitRows, q, s):
    assert torch.equal(_bits(a.data), _bits(q)) and torch.equal(a.scale, s)


def _rows(T, K, dt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=g) * torch.logspace(-3, 1, T)[:, None]).to(dt)
    x[0] = 0                            # a zero row: scale 1, zeros
    x[1, :7] = torch.tensor([17.0, 19.0, 127.9, -255.5, 2.0 ** -12, -(2.0 ** -13) * 3, 0.0])   # ties, carries, tiny
    return x.to(DEV)


def test_pow2_scales_are_exact_powers_of_two():
    s, inv = naive.pow2_scale(torch.tensor([0.0, 1.0, 1.99, 448.0, 3e-37, 2.0 ** -119]))
    assert s.tolist() == [1.0, 2.0 ** -7, 2.0 ** -7, 2.0 ** 1, 1.0, 2.0 ** -126]
    assert torch.equal(s * inv, torch.tensor([1.0] * 6))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_quantize_and_combine_rows_equal_the_reference(dt):
    x = _rows(9, 80, dt)
    q, s = naive.quantize_rows(x)
    got = F.quantize_rows(x)
    _same(got, q, s)
    assert got.dtype == dt and got.rows == 9 and got.shape == (9, 80)
    # hi + lo recombined: about bf16's precision (2^-8 relative to each row's largest value)
    back = naive.combine_rows(q.float(), s, torch.float32)
    assert ((back - x.float()).abs() <= x.float().abs().amax(-1, keepdim=True) * 2.0 ** -9).all()
    y = SplitRows(q.float().to(torch.bfloat16), s, dt)   # a GEMM's product: bf16 split rows
    assert torch.equal(_bits(F.combine_rows(y)), _bits(naive.combine_rows(y.data, s, dt)))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_row_kernels_take_and_give_split_rows(dt):
    T, K = 6, 64
    x, d = _rows(T, K, dt, 1), _rows(T, K, dt, 2)
    gamma = torch.randn(K, generator=torch.Generator().manual_seed(3)).to(dt).to(DEV)
    ref = W.rms_norm_rows(x, gamma, 1e-5)
    _same(W.rms_norm_rows(x, gamma, 1e-5, quant=True), *naive.quantize_rows(ref))
    q, s = naive.quantize_rows(d)
    split = SplitRows(q.float().to(torch.bfloat16), s, dt)
    dense = naive.combine_rows(split.data, s, dt)
    s_ref, h_ref = W.add_rms_norm_rows(x, dense, gamma, 1e-5)
    s_got, h_got = W.add_rms_norm_rows(x, split, gamma, 1e-5, quant=True)
    assert torch.equal(_bits(s_got), _bits(s_ref))
    _same(h_got, *naive.quantize_rows(h_ref))
    gu = _rows(T, 96, dt, 4)
    q, s = naive.quantize_rows(gu)
    sg = SplitRows(q.float().to(torch.bfloat16), s, dt)
    assert torch.equal(_bits(W.silu_mul_rows(sg, 48)), _bits(W.silu_mul_rows(naive.combine_rows(sg.data, s, dt), 48)))
    nh, nkv, hd, S = 4, 2, 16, 32
    qkv = _rows(T, (nh + 2 * nkv) * hd, dt, 5)
    q, s = naive.quantize_rows(qkv)
    sq = SplitRows(q.float().to(torch.bfloat16), s, dt)
    cos, sin = rope_tables(hd, S)
    pos = torch.arange(3, 3 + T, device=DEV)
    caches = [torch.zeros(nkv, S, hd, dtype=dt, device=DEV) for _ in range(4)]
    a = W.rope_store_rows(sq, cos, sin, pos, pos, caches[0], caches[1], nh, nkv)
    b = W.rope_store_rows(naive.combine_rows(sq.data, s, dt), cos, sin, pos, pos, caches[2], caches[3], nh, nkv)
    assert torch.equal(_bits(a), _bits(b)) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # a batched step's rows (continuous batching, a batched FP8 Q pass): each row into its request's caches
    req = torch.tensor([2, 0, 2, 1, 0, 1][:T], device=DEV)
    slots = torch.tensor([5, 5, 6, 9, 6, 10][:T], device=DEV)
    caches = [torch.zeros(3, nkv, S, hd, dtype=dt, device=DEV) for _ in range(4)]
    a = W.rope_store_rows(sq, cos, sin, pos, slots, caches[0], caches[1], nh, nkv, req=req)
    b = W.rope_store_rows(naive.combine_rows(sq.data, s, dt), cos, sin, pos, slots, caches[2], caches[3], nh, nkv,
                          req=req)
    assert torch.equal(_bits(a), _bits(b)) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][2, :, 6].abs().sum() > 0 and caches[0][1, :, 9].abs().sum() > 0   # rows 2 and 3
    assert caches[0][0, :, 9].abs().sum() == 0 and caches[0][2, :, 9].abs().sum() == 0  # row 3 is request 1's


def test_fp8_linear_is_the_reference_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(48, 64, generator=g) * 0.02).to(torch.bfloat16).to(DEV)
    fw = quantize_weight(w)
    assert fw.q.dtype == torch.float8_e4m3fn and fw.nbytes() == 48 * 64 and fw.shape == (48, 64)
    y = fp8_linear(x, fw)
    ref = naive.linear(x, fw.q, fw.scale)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
    exact = x.float() @ w.float().T
    assert ((y.float() - exact).norm() / exact.norm()) < 0.04     # e4m3 weights: about 3% here
    split = fp8_linear(F.quantize_rows(x), fw, split_out=True)
    assert isinstance(split, SplitRows) and torch.equal(split.dense(), y)


def test_fp8_weight_and_rows_refuse_what_cublaslt_cannot_multiply():
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_weight(torch.zeros(48, 40))
    fw = quantize_weight(torch.randn(48, 64))
    with pytest.raises(ValueError, match="rows of 32 columns for an FP8 weight of 64"):
        fp8_linear(torch.zeros(3, 32, device=DEV), fw)


def test_engine_fp8_q_pass_step_matches_the_dense_fp8_view():
    """A 9-row tree step through the fused kernels with the e4m3 copies active against the layer
    modules with the dense view (the same e4m3 weights dequantized; the kernels also split the
    activations): logits within 2%, the same argmax; the copies come off after the pass."""
    from specpilot.engine.api import load_engine
    from specpilot.engine.step_input import StepInput
    from specpilot.engine.tlv import QView, cuda_refusal
    from test_verify_kernels import _tree_step

    ctx, n = 64, 11
    m = load_engine(f"engine:model=tiny,mode=ar,ctx={ctx},device={DEV},dtype=float32,graphs=0,decode=layers").model
    m.layers = m.layers[:2]
    pos = torch.arange(n, device=DEV)
    m.forward(StepInput(torch.arange(60, 60 + n, device=DEV), pos, pos,
                        torch.arange(ctx, device=DEV)[None, :] <= pos[:, None], "seq"), kv_len=ctx)
    step = _tree_step(m, n, ctx, 9, DEV)
    dense = QView.build(m, kind="fp8", bf16_pass=False)
    assert dense.kind == "fp8"
    with dense.active():
        ref = m.forward(step, kv_len=ctx).float()
    assert m.set_decode("fused") == "fused"
    view = QView.build_fp8(m)
    lins = [lin for lin, _ in view.fp8]
    assert len(lins) == 8 and view.extra_bytes() == sum(lin.weight.numel() for lin in lins)
    assert cuda_refusal(m, view, 8) is None
    with view.active():
        assert all(lin.q8 is fw for lin, fw in view.fp8)
        got = m.forward(step, kv_len=ctx).float()
    assert all(lin.q8 is None for lin in lins)
    assert "no projection has both sides a multiple of 16" in cuda_refusal(m, QView([], m, kind="fp8"), 8)
    assert ((got - ref).norm() / ref.norm()) < 0.02
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_fp8_needs_fp8_tensor_cores(monkeypatch):
    from specpilot.engine import tlv
    from specpilot.errors import EnvironmentMissing

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(EnvironmentMissing, match="sm_89 or newer.*sm_80: use qview=w12"):
        tlv.check_fp8_gpu(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 16, 33, 64])
def test_gpu_fp8_kernels_at_llama_shapes(T):
    """Bit for bit against the references at Llama-3.1-8B widths; the GEMM against the reference
    product and the exact one."""
    for K in (4096, 14336):
        x = _rows(T, K, torch.bfloat16, T) if T > 1 else torch.randn(1, K, device="cuda").to(torch.bfloat16)
        _same(F.quantize_rows(x), *naive.quantize_rows(x))
    x = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    gamma = torch.randn(4096, device="cuda").to(torch.bfloat16)
    _same(W.rms_norm_rows(x, gamma, 1e-5, quant=True), *naive.quantize_rows(W.rms_norm_rows(x, gamma, 1e-5)))
    w = (torch.randn(6144, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    fw = quantize_weight(w)
    y = fp8_linear(x, fw)
    # each split part's product is rounded to bf16 and the parts recombined: a sum in another order
    # can move each rounding by one ulp, so two bf16 ulps (2^-6 relative) apart at most
    torch.testing.assert_close(y.float(), naive.linear(x, fw.q, fw.scale).float(), rtol=2 ** -6, atol=1e-2)
    exact = x.float() @ w.float().T
    assert ((y.float() - exact).norm() / exact.norm()) < 0.035


_SM90 = """
from triton.compiler import ASTSource as GluonASTSource   # Triton kernels: the plain AST source
from specpilot.kernels.fp8 import rows as F
from specpilot.kernels.verify import rows as W
k = %s
ptrs = %s
const = %s
div = []
warps = 4
"""


@pytest.mark.parametrize("kernel, ptrs, const", [
    ("F._quantize_rows_kernel", {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"},
     {"XP": 4096, "PDL": True}),
    ("F._dequant_split_kernel", {"y_ptr": "*bf16", "ys_ptr": "*fp32", "o_ptr": "*bf16"}, {"BLOCK": 1024, "PDL": True}),
    ("W._rms_norm_rows_kernel", {"x_ptr": "*bf16", "g_ptr": "*bf16", "y_ptr": "*fp8e4nv", "qs_ptr": "*fp32",
                                 "eps": "fp32"}, {"XP": 4096, "QUANT": True, "PDL": True}),
    ("W._add_rms_norm_rows_kernel", {"x_ptr": "*bf16", "d_ptr": "*bf16", "ds_ptr": "*fp32", "g_ptr": "*bf16",
                                     "s_ptr": "*bf16", "y_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "eps": "fp32"},
     {"XP": 4096, "SPLIT": True, "QUANT": True, "PDL": True}),
    ("W._silu_mul_rows_kernel", {"gu_ptr": "*bf16", "gus_ptr": "*fp32", "y_ptr": "*bf16"},
     {"BLOCK": 1024, "SPLIT": True, "PDL": True}),
    ("W._rope_store_rows_kernel", {n: "*bf16" for n in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr")}
     | {"qkvs_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "req_ptr": "*i64"},
     {"HD": 128, "REQ": False, "SPLIT": True, "PDL": True}),
])
def test_split_row_kernels_compile_for_sm90(kernel, ptrs, const):
    """ptxas for sm_90 takes every kernel that gives or takes split rows (no GPU needed); those that
    write e4m3 convert with the hardware's round-to-nearest (exact here: the values are rounded
    before)."""
    from gluon_ptx import ptxas_report

    r = ptxas_report(_SM90 % (kernel, ptrs, const))
    assert r["rc"] == 0, r["log"][-2000:]
    assert ("e4m3" in r["ptx"]) == (ptrs.get("q_ptr") == "*fp8e4nv" or ptrs.get("y_ptr") == "*fp8e4nv")
