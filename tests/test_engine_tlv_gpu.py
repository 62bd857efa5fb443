"""TLV on CUDA (engine/tlv.py): the Q pass through the W12 QPASS kernels in its own CUDA graphs, the
exact pass through the decoder's graphs; lossless against AR, the committed state untouched."""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from specpilot.engine.api import load_engine  # noqa: E402
from specpilot.kernels import tree as T  # noqa: E402
from test_engine_tlv import (CTX, DRAFTERS, PROMPT, after_cycles, check_batched_cycles,  # noqa: E402
                             check_batched_q_pass)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_gpu_tlv_outputs_equal_ar_for_every_drafter(model):
    """fp32 (the W12 view is made through bf16, as on the CPU): graphs and eager, every drafter,
    a budget whose subtree is often empty."""
    base = f"engine:model={model},device=cuda,dtype=float32,ctx={CTX}"
    ref = load_engine(f"{base},mode=ar").generate(PROMPT, 24)
    for name, d in DRAFTERS.items():
        for nodes, graphs in ((6, 1), (1, 1), (6, 0)):
            e = load_engine(f"{base},mode=tlv,{d},nodes={nodes},depth=4,topk=3,graphs={graphs}")
            assert (e.decoder.qrunner is not None) == bool(graphs)
            r = e.generate(PROMPT, 24)
            assert r.output_ids == ref.output_ids, (name, nodes, graphs)
            assert r.tlv["cycles"] == r.steps and r.tlv["q_compared"] == r.tlv["chain_tokens"] >= r.steps


def _committed(model, n_cache):
    out = []
    for blk in model.layers:
        m = blk.mixer
        out += ([m.k_cache[:, :, :n_cache].clone(), m.v_cache[:, :, :n_cache].clone()] if hasattr(m, "k_cache")
                else [m.state.clone(), m.conv_state.clone()])
    return out


@pytest.mark.parametrize("graphs", [1, 0])
@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_gpu_q_pass_runs_the_qpass_kernels_and_leaves_committed_state_bit_identical(model, graphs, monkeypatch):
    from specpilot.kernels.w12 import routing

    e = load_engine(f"engine:model={model},device=cuda,dtype=bfloat16,ctx={CTX},mode=tlv,drafter=self,"
                    f"draft_layers=1,nodes=12,depth=4,topk=3,graphs={graphs},qview=w12")
    dec = e.decoder
    ctx, n_cache, tree = after_cycles(dec)
    calls = []
    real = routing.w12_linear

    def spy(x, packed, qpass=False, **kw):
        calls.append(qpass)
        return real(x, packed, qpass=qpass, **kw)

    monkeypatch.setattr(routing, "w12_linear", spy)
    n_proj = len(dec.qview.packs)
    for t in (tree, T.chain_tree([])):   # an empty tree runs padded to two rows: no GDN state advances
        before = _committed(e.model, n_cache)
        calls.clear()
        q = dec.q_pass(ctx[-1], t, n_cache)
        assert len(q) == 1 + len(t)
        for a, b in zip(before, _committed(e.model, n_cache)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert all(g._stash is None for g in e.model.gdn_layers())
        # eager: every projection through a QPASS kernel; graphs replay what was captured (no calls)
        assert calls == ([True] * n_proj if not graphs else [])
    # the exact pass of the same tree reads the exact weights (cuBLAS for a bf16 target)
    calls.clear()
    dec.verify_predictions(ctx[-1], tree, n_cache, "tlv")
    assert True not in calls


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_gpu_fp8_q_pass_runs_the_fp8_gemms_and_tlv_equals_ar(model, monkeypatch):
    """qview=fp8: every projection of the Q pass through the FP8 GEMM (eager), the committed state
    bit-identical after it, the exact pass on the exact weights; TLV's output is AR's (fp32)."""
    from specpilot.kernels import fp8

    base = f"engine:model={model},device=cuda,ctx={CTX}"
    e = load_engine(f"{base},dtype=bfloat16,mode=tlv,drafter=self,draft_layers=1,nodes=12,depth=4,topk=3,graphs=0,"
                    "qview=fp8")
    dec = e.decoder
    assert dec.qview.kind == "fp8" and dec.qview.extra_bytes() == sum(fw.nbytes() for _, fw in dec.qview.fp8) > 0
    ctx, n_cache, tree = after_cycles(dec)
    calls = []
    real = fp8.linear.fp8_linear
    monkeypatch.setattr(fp8.linear, "fp8_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(fp8, "fp8_linear", fp8.linear.fp8_linear)
    before = _committed(e.model, n_cache)
    assert len(dec.q_pass(ctx[-1], tree, n_cache)) == 1 + len(tree)
    for a, b in zip(before, _committed(e.model, n_cache)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert len(calls) == len(dec.qview.fp8)
    calls.clear()
    dec.verify_predictions(ctx[-1], tree, n_cache, "tlv")
    assert not calls
    ref = load_engine(f"{base},dtype=float32,mode=ar").generate(PROMPT, 24)
    for graphs in (1, 0):
        r = load_engine(f"{base},dtype=float32,mode=tlv,drafter=self,draft_layers=2,nodes=6,depth=4,topk=3,"
                        f"graphs={graphs},qview=fp8").generate(PROMPT, 24)
        assert r.output_ids == ref.output_ids, graphs


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_gpu_w12_target_q_pass_reads_its_own_records(model):
    """A W12 target (a hybrid's GDN and gated layers too): the Q pass reads the target's own records,
    no copy; the output is W12 AR's."""
    e = load_engine(f"engine:model={model},device=cuda,ctx={CTX},mode=tlv,w12=1,drafter=self,draft_layers=1,"
                    "nodes=8,depth=3,topk=3")
    assert e.model.fused_decode and e.decoder.qview.kind == "w12"
    assert e.decoder.qview.extra_bytes() == 0     # the packs are the target's own
    assert e.decoder.qview.packs and all(lin.kp is kp for lin, kp in e.decoder.qview.packs)
    ref = load_engine(f"engine:model={model},device=cuda,ctx={CTX},mode=ar,w12=1").generate(PROMPT, 16).output_ids
    assert e.generate(PROMPT, 16).output_ids == ref


def test_gpu_run_tlv_cli(run_cli, tmp_path):
    args = ("run", "--model", "tiny", "--device", "cuda", "--dtype", "float32", "--prompt",
            "abcabcabc the cat the cat abc", "--max-new-tokens", "20", "--format", "json")
    code, out, err = run_cli(*args, "--mode", "tlv", "--nodes", "16", "--lattice-out", tmp_path / "t.jsonl")
    assert code == 0, err
    d = json.loads(out)
    assert d["tlv"]["cycles"] == d["steps"] and set(d["tlv"]["time_ms"]) == {"draft1", "qpass", "draft2", "exact",
                                                                          "append"}
    code, ar, _ = run_cli(*args, "--mode", "ar")
    assert json.loads(ar)["output_ids"] == d["output_ids"]
    code, rep, err = run_cli("replay", tmp_path / "t.jsonl", "--policy", "tlv:16", "--format", "json")
    assert code == 0, err
    assert json.loads(rep)["policies"][0]["tau"] == pytest.approx(d["tau"], abs=1e-12)


def test_gpu_tlv_refusals(run_cli):
    code, out, err = run_cli("run", "--model", "tiny", "--device", "cuda", "--mode", "tlv", "--nodes", "64",
                             "--prompt", "abc")
    assert code == 2 and "nodes <= 63" in err
    code, out, err = run_cli("run", "--model", "tiny", "--device", "cuda", "--mode", "tlv", "--decode", "layers",
                             "--prompt", "abc")
    assert code == 2 and "decode=fused" in err


@pytest.mark.parametrize("dtype,qview", [("float32", "w12"), ("bfloat16", "w12"), ("bfloat16", "fp8")])
@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_gpu_batched_tlv(model, dtype, qview):
    """Batched TLV on CUDA (the fused batched step reads the W12 packs or the e4m3 copies in the Q
    pass). fp32: every request's output is AR's and its cycles are its one-request cycles exactly;
    bf16: the batched Q pass leaves every slot bit-identical."""
    if qview == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("qview=fp8 needs FP8 tensor cores (sm_89 or newer)")
    base = f"model={model},device=cuda,dtype={dtype},qview={qview}"
    if dtype == "float32":
        check_batched_cycles(base)
    check_batched_q_pass(base)


def test_gpu_auto_q_view_is_fp8_for_a_bf16_target_with_fp8_tensor_cores():
    """``qview=auto``: the e4m3 copy for a bf16 target where the GPU multiplies e4m3, else (and
    beside a W12 target, whose records are the view) the W12 view."""
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    spec = f"engine:model=tiny,device=cuda,ctx={CTX},mode=tlv,drafter=self,draft_layers=1,nodes=8,depth=3,topk=3"
    e = load_engine(spec)
    assert e.decoder.qview.kind == ("fp8" if fp8 else "w12") == e.spec.resolved().qview
    r = e.generate(PROMPT, 16)
    assert len(r.output_ids) == 16 and r.tlv["cycles"] == r.steps
    assert load_engine(spec + ",w12=1").decoder.qview.kind == "w12"


def test_gpu_batched_tlv_refuses_the_layer_modules(run_cli):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tlv", "--prompt", "abc", "--device", "cuda",
                             "--batch", "2", "--decode", "layers")
    assert code == 2 and out == "" and "decode=fused" in err


def test_gpu_tlv_step_gpu_time_counts_the_q_pass():
    """A cycle's GPU time is both passes': a Q pass made ~20 ms longer on the GPU shows in
    ``gpu_ms``, not in the outside time (which ceiling reads as host overhead)."""
    e = load_engine(f"engine:model=tiny,device=cuda,dtype=bfloat16,ctx={CTX},mode=tlv,drafter=self,"
                    "draft_layers=1,nodes=6,depth=4,topk=3,graphs=1,qview=w12")
    base = e.generate(PROMPT, 12).step_timing()["gpu_ms"]
    real = e.decoder.qrunner.run

    def slow(*a):
        torch.cuda._sleep(40_000_000)   # about 20 ms at 2 GHz, on the stream the events time
        return real(*a)

    e.decoder.qrunner.run = slow
    timing = e.generate(PROMPT, 12).step_timing()
    assert timing["gpu_ms"] - base > 10, (base, timing)
    assert timing["outside_ms"] < 10, timing
