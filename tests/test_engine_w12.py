"""The engine's w12=1 option: projections converted to W12 at load, outputs unchanged on the CPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import one_error

# the fused-path test runs the Triton kernel under the interpreter on a CPU-only machine, which works
# only when Triton is imported after TRITON_INTERPRET is set (as tests/test_w12_gemm.py does)
_TRITON_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specpilot.engine.api import EngineSpec, load_engine
from specpilot.errors import InputError

PROMPT = list(b"abcabcabc hello hello abcabc the cat sat on the mat")


@pytest.mark.parametrize("model,mode", [("tiny", "ar"), ("tiny", "tree"), ("tiny-hybrid", "chain")])
def test_w12_engine_equals_plain_engine_token_for_token(model, mode):
    plain = load_engine(f"engine:model={model},mode={mode},dtype=bfloat16,ctx=256")
    w12 = load_engine(f"engine:model={model},mode={mode},w12=1,ctx=256")  # w12 implies bfloat16
    assert w12.info["dtype"] == "bfloat16" and plain.info["w12"] is None
    info = w12.info["w12"]
    # every projection of every layer: wqkv/wo (or the 2 GDN projections), w13, w2
    expect = 16 if model == "tiny" else 3 * 4 + 4   # GDN layers: in_proj, out_proj
    assert info["path"] == "decoded" and info["tensors"] == expect
    assert 12.0 < info["bits_per_weight"] < 13.0 and info["w12_bytes"] < info["bf16_bytes"]
    a = plain.generate(PROMPT, 24)
    b = w12.generate(PROMPT, 24)
    assert b.output_ids == a.output_ids and b.steps == a.steps
    # the logits of a whole prompt are identical bit for bit (weights restored exactly)
    from specpilot.engine.step_input import StepInput

    for e in (plain, w12):
        e.model.reset()
    n = len(PROMPT)
    pos = torch.arange(n)
    inp = StepInput(torch.tensor(PROMPT), pos, pos, pos[None, :] <= pos[:, None], "seq")
    la, lb = plain.model(inp, kv_len=n), w12.model(inp, kv_len=n)
    assert torch.equal(la.view(torch.int16), lb.view(torch.int16))


def test_w12_spec_parse_print_and_bad_values():
    s = EngineSpec.parse("engine:model=tiny,mode=tree,nodes=32,w12=1")
    assert s.w12 is True and "w12=True" in str(s) and EngineSpec.parse(str(s)) == s
    assert EngineSpec.parse("engine:model=tiny").w12 is False
    for bad in ("w12=2", "w12=yes please", "w12="):
        with pytest.raises(InputError, match="w12"):
            EngineSpec.parse(f"engine:model=tiny,{bad}")


def test_w12_refuses_weights_bf16_cannot_hold():
    # tiny's random fp32 weights are not bf16 values: W12 would change the model
    with pytest.raises(InputError, match="not exactly representable in bf16"):
        load_engine("engine:model=tiny,w12=1,dtype=float32,ctx=64")


def test_w12_fp32_engine_with_bf16_exact_weights_is_exact():
    from specpilot.engine.api import build_model
    from specpilot.engine.decode import Decoder
    from specpilot.engine.w12_loader import convert_engine_model

    torch.set_grad_enabled(False)
    outs = []
    for convert in (False, True):
        m, _, _ = build_model("tiny", True, torch.float32, "cpu", 128)
        for p in m.parameters():  # fp32 weights that are bf16 values (a bf16 checkpoint read as fp32)
            p.copy_(p.to(torch.bfloat16).float())
        if convert:
            rep = convert_engine_model(m)
            assert rep.path == "decoded" and len(rep.tensors) == 16
            assert m.layers[0].w13.weight.dtype == torch.float32
        outs.append(Decoder(m, "ar").generate(PROMPT, 16).output_ids)
    assert outs[0] == outs[1]


@pytest.mark.skipif(_TRITON_LATE and not torch.cuda.is_available(),
                    reason="Triton was imported before TRITON_INTERPRET was set")
def test_w12_fused_path_under_the_interpreter(monkeypatch):
    """The fused path (W12Projection -> w12_linear), run on the CPU by Triton's interpreter."""
    pytest.importorskip("triton")
    from specpilot.engine import w12_loader as ew
    from specpilot.engine.api import build_model
    from specpilot.engine.step_input import StepInput

    torch.set_grad_enabled(False)
    m, _, _ = build_model("tiny", True, torch.bfloat16, "cpu", 64)
    ref = {name: getattr(parent, attr).weight.clone() for parent, attr, name in ew.projections(m)}
    rep = ew.convert_engine_model(m, fused=True)
    assert rep.path == "fused"
    proj = m.layers[0].w13
    assert isinstance(proj, ew.W12Projection) and not hasattr(proj, "weight")
    # rows beyond the per-launch limit are cut into chunks; each row matches x @ W.T in fp32
    monkeypatch.setattr(ew, "KERNEL_MAX_ROWS", 2)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = proj(x)
    want = x.float() @ ref["layers.0.w13"].float().T
    scale = x.float().abs() @ ref["layers.0.w13"].float().abs().T
    assert y.shape == (5, 256) and float(((y.float() - want).abs() / (scale + 1e-6)).max()) < 1e-2
    # a forward through the first layer (its four projections on the kernel) and the LM head gives
    # the plain model's logits up to bf16 rounding (the interpreter is slow: one layer, three rows)
    plain, _, _ = build_model("tiny", True, torch.bfloat16, "cpu", 64)
    toks = torch.tensor(PROMPT[:3])
    pos = torch.arange(3)
    mask = torch.zeros(3, 64, dtype=torch.bool)
    mask[:, :3] = pos[None, :] <= pos[:, None]
    la = plain(StepInput(toks, pos, pos, mask, "seq"), kv_len=64, layers=1).float()
    lb = m(StepInput(toks, pos, pos, mask, "seq"), kv_len=64, layers=1).float()
    assert (la - lb).abs().max() < 0.05 * la.abs().max()


@pytest.mark.skipif(_TRITON_LATE and not torch.cuda.is_available(),
                    reason="Triton was imported before TRITON_INTERPRET was set")
def test_w12_one_row_step_through_the_fused_decode_kernels(monkeypatch):
    """decode=fused on a W12 model: the one-row step runs the W12 variants of the fused decode
    kernels (kernels/decode/gemv_w12.py) and gives the layer modules' logits and K/V up to bf16
    rounding (W12 is lossless: the modules' weights before the conversion are the records' values,
    and the converted modules agree with them, test_w12_fused_path_under_the_interpreter; the
    interpreter runs it on the CPU). Attention is the torch reference here: Triton's interpreter gets
    bf16 ``tl.dot`` wrong (the fused attention is checked in bf16 on the GPU,
    tests/test_attention_kernel.py)."""
    pytest.importorskip("triton")
    from specpilot.engine import w12_loader as ew
    from specpilot.engine.api import build_model
    from specpilot.engine.fused_decode import ineligible
    from specpilot.engine.step_input import StepInput
    from specpilot.kernels.attention import decode, naive as reference

    if not torch.cuda.is_available():
        monkeypatch.setattr(decode, "masked_gqa_attention",
                            lambda q, k, v, mask, scale, **launch: reference.masked_gqa_attention(q, k, v, mask, scale))
    torch.set_grad_enabled(False)
    ctx = 32
    m, _, _ = build_model("tiny", True, torch.bfloat16, "cpu", ctx)
    m.layers = m.layers[:2]   # a layer into the next one, and the last into the head: half the interpreter's work
    n = 3
    pos = torch.arange(n)
    # the prompt's K/V and the layers' step: before the conversion, through the torch projections (the
    # same weights), not through the interpreted W12 GEMV
    m.forward(StepInput(torch.tensor(PROMPT[:n]), pos, pos, torch.arange(ctx)[None, :] <= pos[:, None], "seq"),
              kv_len=ctx)
    one = StepInput(torch.tensor([PROMPT[n]]), torch.tensor([n]), torch.tensor([n]),
                    torch.arange(ctx)[None, :] <= n, "seq")
    ref = m.forward(one, kv_len=ctx).float()
    kv_ref = [blk.mixer.k_cache[0, :, n].clone() for blk in m.layers]
    for blk in m.layers:
        blk.mixer.k_cache[0, :, n] = 0
    ew.convert_engine_model(m, fused=True)
    assert ineligible(m) is None
    assert m.set_decode("fused") == "fused"
    got = m.forward(one, kv_len=ctx).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    for blk, k in zip(m.layers, kv_ref):
        assert (blk.mixer.k_cache[0, :, n].float() - k.float()).abs().max() < 0.05 * k.float().abs().max()
    m.layers[0].w2.bias = torch.nn.Parameter(torch.zeros(m.layers[0].w2.out_features, dtype=torch.bfloat16))
    assert "down projection has a bias" in ineligible(m)


def test_run_and_probe_rows_take_w12(run_cli, tmp_path):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--w12", "--prompt", "abcabc abcabc",
                             "--max-new-tokens", "8", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["dtype"] == "bfloat16" and d["w12"]["tensors"] == 16 and "w12=True" in d["engine"]
    code2, out2, _ = run_cli("run", "--model", "tiny", "--mode", "tree", "--dtype", "bfloat16",
                             "--prompt", "abcabc abcabc", "--max-new-tokens", "8", "--format", "json")
    assert code2 == 0 and json.loads(out2)["output_ids"] == d["output_ids"] and json.loads(out2)["w12"] is None
    code, out, err = run_cli("run", "--model", "tiny", "--w12", "--prompt", "abc", "--max-new-tokens", "2")
    assert code == 0 and "W12 decoded: 16 projections" in out
    rows = tmp_path / "rows.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--random-weights", "--w12", "--rows", "1,2",
                           "--context", "16", "--device", "cpu", "--reps", "1", "--warmup", "0", "--threads", "1",
                           "--format", "json", "--out", rows)
    assert code == 0, err
    r = json.loads(rows.read_text())
    assert r["dtype"] == "bfloat16" and r["w12"]["path"] == "decoded"


@pytest.mark.parametrize("args,msg", [
    (["--w12", "--dtype", "float32"], "not exactly representable in bf16"),
    (["--engine", "engine:model=tiny,w12=2"], "w12='2' must be 0 or 1"),
    (["--engine", "engine:model=tiny,w12=on-gpu"], "must be 0 or 1"),
])
def test_run_w12_bad_input_exit_2(run_cli, args, msg):
    model = [] if "--engine" in args else ["--model", "tiny"]
    code, _, err = run_cli("run", *model, "--prompt", "abc", "--max-new-tokens", "2", *args)
    assert code == 2 and msg in one_error(err)


@pytest.mark.slow
def test_w12_hf_benchmark_tiny_dry_run(tmp_path):
    """benchmarks/w12_hf.py --tiny: stock and converted HF Llama give the same greedy tokens on the CPU."""
    import subprocess

    pytest.importorskip("transformers")
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "w12_hf_tiny.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, str(repo / "benchmarks" / "w12_hf.py"), "--tiny", "--context", "20",
                        "--check-steps", "8", "--steps", "2", "--rounds", "1", "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "w12_hf_tiny" and d["tokens_identical"] is True and d["converted"] == 14
    assert d["first_step_max_abs_logit_diff"] == 0.0 and len(d["rows"]) == 4
    assert {"ms_per_token", "bf16_ms_per_token", "speedup", "variant"} <= set(d["rows"][1])
    verify = [r for r in d["rows"] if r["step"] == "verify"]   # --tiny: one 4-row verify step per model
    assert [r["rows"] for r in verify] == [4, 4] and all(r["argmax_rows_equal"] == 4 for r in verify)
    assert verify[1]["max_abs_logit_diff"] == 0.0 and verify[1]["ms_per_step"] > 0


@pytest.mark.parametrize("rows", ["1", "8,x", "65", "8,,16"])
def test_w12_hf_verify_rows_are_checked(rows, capsys):
    """benchmarks/w12_hf.py --verify-rows: 2-64 rows each (the fused kernels' range), else exit 2."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "w12_hf_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "w12_hf.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_verify_rows("8,16,32") == [8, 16, 32] and bench.parse_verify_rows("") == []
    with pytest.raises(SystemExit) as e:
        bench.parse_verify_rows(rows)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--verify-rows wants" in err and len(err.strip().splitlines()) == 1
