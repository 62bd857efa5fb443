"""CUDA: graph-replayed AR equals eager AR; tree and chain equal AR; probe rows uses graphs."""

import pytest

pytestmark = pytest.mark.gpu


def test_cuda_graph_ar_and_tree_equal_eager_ar():
    from specpilot.engine.api import load_engine

    prompt = list(b"abcabcabc hello hello abcabc")
    eager = load_engine("engine:model=tiny,mode=ar,dtype=float32,device=cuda,ctx=512,graphs=0").generate(prompt, 48)
    graph = load_engine("engine:model=tiny,mode=ar,dtype=float32,device=cuda,ctx=512,graphs=1").generate(prompt, 48)
    assert graph.output_ids == eager.output_ids
    for mode in ("chain", "tree"):
        r = load_engine(f"engine:model=tiny,mode={mode},dtype=float32,device=cuda,ctx=512").generate(prompt, 48)
        assert r.output_ids == eager.output_ids


def test_probe_rows_cuda(run_cli, tmp_path):
    import json

    out = tmp_path / "rows.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--random-weights", "--rows", "1,4", "--context", "64",
                           "--device", "cuda", "--reps", "5", "--format", "json", "--out", out)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert d["gpu"] and d["method"].startswith("cuda graph")


def test_compiled_layers_equal_eager_in_fp32():
    from specpilot.engine.api import load_engine

    prompt = list(b"compiled layers, same tokens")
    eager = load_engine("engine:model=tiny,mode=ar,dtype=float32,device=cuda,ctx=512,graphs=0,decode=layers"
                        ).generate(prompt, 32)
    comp = load_engine("engine:model=tiny,mode=ar,dtype=float32,device=cuda,ctx=512,compile=1,decode=layers"
                       ).generate(prompt, 32)
    assert comp.output_ids == eager.output_ids
