"""The engine's ``head=certified``: the certified INT8 LM head (kernels/lm_head) as the greedy head.

On the CPU its Triton kernels run under the interpreter (tiny vocabulary); on a GPU the same tests
run on cuda, AR steps in CUDA graphs (so the head's device fallback is captured too). The engine is
float32 in both, where the exact head (fp64 dot rounded to fp32) and ``lm_head`` agree except at
ties of one fp32 ulp, which random tiny models do not produce."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from specpilot.engine.api import EngineSpec, load_engine  # noqa: E402
from specpilot.engine.step_input import StepInput  # noqa: E402
from specpilot.errors import InputError  # noqa: E402
from specpilot.kernels.lm_head import exact_argmax  # noqa: E402

CTX = 256
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ON = f"device={DEV},dtype=float32"      # the engine's spec keys for this machine
PROMPT = [ord(c) for c in "the cat sat on the mat. the cat sat on the"]


def test_greedy_rows_equal_the_exact_head():
    e = load_engine(f"engine:model=tiny,mode=ar,ctx={CTX},{ON},head=certified")
    m = e.model
    assert e.info["head"] == "certified" and m.certified_head is not None
    m.reset()
    n = len(PROMPT)
    pos = torch.arange(n, device=DEV)
    mask = torch.arange(CTX, device=DEV)[None, :] <= pos[:, None]
    inp = StepInput(torch.tensor(PROMPT, device=DEV), pos, pos, mask, "seq")
    got = m.greedy(inp, kv_len=CTX)
    m.reset()
    h = m.hidden(inp, kv_len=CTX)
    assert torch.equal(got, exact_argmax(h, m.lm_head.weight.detach()))
    assert torch.equal(got, m.lm_head(h).argmax(-1))     # fp32: no near-ties here
    m.reset()
    last = m.greedy(inp, kv_len=CTX, last=True)
    assert last.shape == (1,) and int(last[0]) == int(got[-1])


@pytest.fixture(scope="module")
def ar_outputs():
    """AR's tokens with the certified head and with the linear one (the same for every variant)."""
    ref = load_engine(f"engine:model=tiny,mode=ar,ctx={CTX},{ON},head=certified").generate(PROMPT, 16)
    lin = load_engine(f"engine:model=tiny,mode=ar,ctx={CTX},{ON}").generate(PROMPT, 16)
    return ref.output_ids, lin.output_ids


@pytest.mark.parametrize("variant", ["mode=chain,depth=4", "mode=tree,nodes=12,depth=4,topk=3"])
def test_chain_and_tree_with_the_certified_head_equal_ar(variant, ar_outputs):
    ref, lin = ar_outputs
    got = load_engine(f"engine:model=tiny,{variant},ctx={CTX},{ON},head=certified").generate(PROMPT, 16)
    assert got.output_ids == ref == lin


def test_head_option_errors():
    with pytest.raises(InputError):
        EngineSpec.parse("engine:model=tiny,head=int4")
    with pytest.raises(InputError):
        load_engine(f"engine:model=tiny,ctx={CTX},device={DEV},dtype=float16,head=certified")


def test_run_cli_reports_the_head(run_cli):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--nodes", "8", "--depth", "3",
                             "--topk", "2", "--ctx", str(CTX), "--device", DEV, "--dtype", "float32", "--head", "certified",
                             "--prompt", "the cat sat",
                             "--raw", "--max-new-tokens", "6", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["head"] == "certified" and len(doc["results"][0]["output_ids"]) == 6
    code, _, err = run_cli("run", "--model", "tiny", "--head", "int4", "--prompt", "x")
    assert code == 2 and "int4" in err
