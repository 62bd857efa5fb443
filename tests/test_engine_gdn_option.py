"""The engine option ``gdn`` (``--gdn naive|path|wy|auto``): how a hybrid's Gated DeltaNet layers run.
On the CPU ``path`` and ``wy`` run the row kernels in Triton's interpreter (tiny-hybrid, a few tokens)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.engine.spec import EngineSpec
from specpilot.errors import InputError

# tiny-hybrid's n-gram drafts for this prompt: nothing for two steps, then two tokens (3 rows), then
# (tree) a branching tree of 6 nodes (7 rows); the tokens generated in each mode to reach that step
# with room for all of its nodes (a request verifies no node deeper than the tokens it can still take)
PROMPT = ",".join(str(b) for b in b"ab path")
NEW = {"chain": 6, "tree": 8}
DRAFTED = {"chain": 3, "tree": 7}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Rows of every verifying launch of the path kernel (``gdn_rows`` with outputs, not a commit)
    and of TreeWY (``wy_verify``) while it lives."""
    from specpilot.kernels.gdn import rows, wy

    calls = {"path": [], "wy": []}
    path_kernel, wy_kernel = rows.gdn_rows, wy.wy_verify

    def spy_path(qkv, *a, **kw):
        if kw.get("output", True):
            calls["path"].append(qkv.shape[0])
        return path_kernel(qkv, *a, **kw)

    def spy_wy(q, *a, **kw):
        calls["wy"].append(q.shape[0])
        return wy_kernel(q, *a, **kw)

    monkeypatch.setattr(rows, "gdn_rows", spy_path)
    monkeypatch.setattr(wy, "wy_verify", spy_wy)
    return calls


def _run(run_cli, mode: str, gdn: str) -> dict:
    code, out, err = run_cli("run", "--model", "tiny-hybrid", "--mode", mode, "--gdn", gdn, "--ctx", "64",
                             "--prompt-ids", PROMPT, "--max-new-tokens", NEW[mode], "--format", "json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def naive_tokens():
    """tiny-hybrid's AR tokens through the torch reference."""
    e = load_engine("engine:model=tiny-hybrid,mode=ar,ctx=64,gdn=naive")
    return e.generate(list(b"ab path"), max(NEW.values())).output_ids


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gdn", ["naive", "path", "wy"])
def test_every_gdn_choice_gives_the_same_tokens(run_cli, kernel_calls, naive_tokens, mode, gdn):
    """``run --gdn`` in chain and tree modes: AR's tokens whichever way the GDN layers run, and the
    choice is what ran: no kernel for naive, verify steps of several rows through the path kernel
    (path) or TreeWY (wy)."""
    doc = _run(run_cli, mode, gdn)
    assert doc["output_ids"] == naive_tokens[:NEW[mode]] and doc["gdn"] == gdn
    assert f"gdn={gdn}" in doc["engine"]
    drafted = DRAFTED[mode]
    if gdn == "naive":
        assert kernel_calls == {"path": [], "wy": []}
    elif gdn == "path":
        assert drafted in kernel_calls["path"] and not kernel_calls["wy"]
    else:
        assert drafted in kernel_calls["wy"] and drafted not in kernel_calls["path"]


@pytest.mark.parametrize("gdn,impl,verify,reported", [("naive", "torch", "auto", "naive"),
                                                      ("path", "triton", "path", "path"),
                                                      ("wy", "triton", "wy", "wy"),
                                                      ("auto", "auto", "auto", "naive")])
def test_the_option_sets_every_gdn_layer(gdn, impl, verify, reported):
    """Every GDN layer of the target takes the choice (the self drafter runs the target's own
    layers); on the CPU auto is the torch reference."""
    e = load_engine(f"engine:model=tiny-hybrid,mode=tree,drafter=self,draft_layers=1,ctx=64,gdn={gdn}")
    layers = e.model.gdn_layers()
    assert layers and all((m.impl, m.verify) == (impl, verify) for m in layers)
    assert e.info["gdn"] == reported and e.decoder.drafter.target is e.model


def test_the_option_reaches_a_hybrid_draft_model():
    """A draft model's GDN layers run as asked too, also under a dense target (which reports None)."""
    e = load_engine("engine:model=tiny-hybrid,mode=chain,drafter=model,draft_model=tiny-hybrid,ctx=64,gdn=wy")
    assert all((m.impl, m.verify) == ("triton", "wy") for m in e.draft["model"].gdn_layers())
    dense = load_engine("engine:model=tiny,mode=chain,drafter=model,draft_model=tiny-hybrid,ctx=64,gdn=path")
    assert dense.info["gdn"] is None
    assert all((m.impl, m.verify) == ("triton", "path") for m in dense.draft["model"].gdn_layers())
    e = load_engine("engine:model=tiny-hybrid,mode=chain,drafter=model,draft_model=tiny,ctx=64,gdn=path")
    assert e.info["gdn"] == "path" and not e.draft["model"].gdn_layers()


def test_set_gdn_refuses_what_cannot_run(monkeypatch):
    dense = load_engine("engine:model=tiny,mode=ar,ctx=32").model
    assert dense.set_gdn("auto") is None
    for kind in ("naive", "path", "wy"):
        with pytest.raises(InputError, match=f"gdn={kind}: tiny has no Gated DeltaNet layers"):
            dense.set_gdn(kind)
    hybrid = load_engine("engine:model=tiny-hybrid,mode=ar,ctx=32").model
    with pytest.raises(InputError, match="unknown gdn 'fast'"):
        hybrid.set_gdn("fast")
    m = hybrid.gdn_layers()[0]
    monkeypatch.setattr(m, "dk", 12)
    with pytest.raises(InputError, match="gdn=path: the GDN row kernels need power-of-two head dims .*key head dim 12"):
        hybrid.set_gdn("path")
    monkeypatch.undo()
    from specpilot.kernels import triton_env

    monkeypatch.setattr(triton_env, "interpreting", lambda: False)   # a CPU model on a machine with a GPU
    with pytest.raises(InputError, match="gdn=wy: .*only under Triton's interpreter"):
        hybrid.set_gdn("wy")
    assert hybrid.set_gdn("auto") == "naive" and all(g.impl == "torch" for g in hybrid.gdn_layers())
    _as_if_on_cuda(hybrid, monkeypatch)   # auto where the kernels cannot run: the reference, not an error
    monkeypatch.setattr(triton_env, "triton", None)
    assert hybrid.set_gdn("auto") == "naive" and all(g.impl == "torch" for g in hybrid.gdn_layers())
    with pytest.raises(InputError, match="gdn=path: the GDN row kernels need Triton"):
        hybrid.set_gdn("path")


def _as_if_on_cuda(m, monkeypatch):
    """``m`` answering choices as a CUDA model with the fused attention would (nothing runs)."""
    monkeypatch.setattr(m, "device", torch.device("cuda"))
    for blk in m.layers:
        if hasattr(blk.mixer, "fused"):
            monkeypatch.setattr(blk.mixer, "fused", True)


def test_naive_keeps_the_ar_step_on_the_layers(monkeypatch):
    """The fused one-row step runs GDN layers through the row kernels: gdn=naive refuses decode=fused
    (a rule between options) and keeps decode=auto on the layers."""
    with pytest.raises(InputError, match="decode=fused .* gdn=naive"):
        EngineSpec.from_options(device="cuda", decode="fused", gdn="naive")
    m = load_engine("engine:model=tiny-hybrid,mode=ar,ctx=32,gdn=naive").model
    with pytest.raises(InputError, match="decode=fused: tiny-hybrid: .*gdn=naive"):
        m.set_decode("fused")
    _as_if_on_cuda(m, monkeypatch)
    assert m.set_decode("auto") == "layers"
    assert m.set_gdn("path") == "path" and m.set_decode("auto") == "fused"


def test_auto_reports_what_the_measured_table_picks(monkeypatch):
    """On CUDA auto runs the kernels and reports path where the table gives every step to the path
    kernel (a GPU without entries), auto where it gives some to TreeWY."""
    from specpilot.kernels.gdn import rows

    m = load_engine("engine:model=tiny-hybrid,mode=ar,ctx=32").model
    _as_if_on_cuda(m, monkeypatch)
    monkeypatch.setattr(rows, "verify_method", lambda n, device: "path")
    assert m.set_gdn("auto") == "path" and all((g.impl, g.verify) == ("auto", "auto") for g in m.gdn_layers())
    monkeypatch.setattr(rows, "verify_method", lambda n, device: "wy" if n > 2 else "path")
    assert m.set_gdn("auto") == "auto"


def test_wy_takes_the_path_walk_above_64_rows(kernel_calls):
    """gdn=wy: a verify step of more rows than TreeWY holds walks the paths (a 65-row star tree:
    every path two tokens long, cheap in the interpreter)."""
    from specpilot.engine.step_input import StepInput
    from specpilot.kernels.gdn import path as gpath

    model = load_engine("engine:model=tiny-hybrid,mode=ar,ctx=128,gdn=wy").model
    layer, rows = model.gdn_layers()[0], 65
    pos = torch.arange(rows)
    inp = StepInput(torch.zeros(rows, dtype=torch.long), pos, pos, torch.ones(rows, 128, dtype=torch.bool), "tree",
                    gpath.row_paths([-1] + [0] * (rows - 1)))
    proj = torch.randn(rows, layer.in_proj.out_features, generator=torch.Generator().manual_seed(0))
    assert layer.mix(proj, inp).shape == (rows, layer.value_dim)
    assert kernel_calls == {"path": [rows], "wy": []}


def test_spec_text_round_trips():
    spec = EngineSpec.parse("engine:model=tiny-hybrid,mode=tree,gdn=wy")
    assert spec.gdn == "wy" and str(spec) == "engine:model=tiny-hybrid,mode=tree,gdn=wy"
    assert EngineSpec.parse(str(spec)) == spec and str(EngineSpec()) == "engine:model=smollm2,mode=tree"


def _specpilot(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specpilot", *args], capture_output=True, text=True, timeout=120)


def test_cli_refuses_a_kernel_that_cannot_run_and_a_bad_value():
    """The real command: one error line and exit 2 for a GDN kernel on a dense model and for a bad value
    (as a flag and in a spec text)."""
    p = _specpilot("run", "--model", "tiny", "--gdn", "wy", "--prompt", "hi", "--max-new-tokens", "2")
    assert p.returncode == 2 and p.stdout == ""
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert errors == ["specpilot: error: gdn=wy: tiny has no Gated DeltaNet layers (a dense model); leave gdn=auto"]
    assert "Traceback" not in p.stderr
    p = _specpilot("run", "--model", "tiny-hybrid", "--gdn", "fast", "--prompt", "hi")
    assert p.returncode == 2 and "'fast' is not one of 'auto', 'naive', 'path', 'wy'" in p.stderr
    p = _specpilot("run", "--engine", "engine:model=tiny-hybrid,gdn=fast", "--prompt", "hi")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == "specpilot: error: unknown gdn 'fast'; choose one of auto, naive, path, wy"
