"""``benchmarks/read_floor.py``: the TMA read's grid covers every box once, its rings fit the SM,
``--rows`` is checked before any GPU work, and (GPU) the TMA read folds exactly the buffer's words."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "read_floor.py"


def _bench():
    spec = importlib.util.spec_from_file_location("read_floor_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tma_grid_covers_every_box_once():
    rf = _bench()
    for n_blocks in (1, 7, 131, 132, 133, 1000, 9601):
        for per_sm in (1, 2, 4):
            progs, bpp = rf.tma_grid(n_blocks, 132, per_sm, persist=True)
            assert bpp == 0 and progs == min(n_blocks, 132 * per_sm)
            progs, bpp = rf.tma_grid(n_blocks, 132, per_sm, persist=False)
            assert progs * bpp >= n_blocks > (progs - 1) * bpp and progs <= 132 * per_sm
    cfgs = list(rf.tma_configs())
    assert len(cfgs) > 40 and any(c[4] for c in cfgs) and any(not c[4] for c in cfgs)
    assert all(box * 128 * stages * per_sm <= 200 * 1024 for box, _, stages, per_sm, _ in cfgs)


@pytest.mark.parametrize("rows", ["0", "1,x", "65", ""])
def test_rows_out_of_range_are_a_one_line_error(rows, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().parse_rows(rows)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--rows wants" in err and len(err.strip().splitlines()) == 1
    assert _bench().parse_rows("1,32") == [1, 32]


def test_rows_are_checked_before_any_gpu_work():
    r = subprocess.run([sys.executable, str(SCRIPT), "--rows", "1,99"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--rows wants" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("persist", [False, True])
def test_tma_read_folds_every_word(persist):
    import numpy as np
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    from triton.tools.tensor_descriptor import TensorDescriptor

    rf = _bench()
    box, n_blocks = 64, 37
    words = torch.randint(-2**31, 2**31 - 1, (n_blocks * box - 5, 32), dtype=torch.int32, device="cuda")
    progs, bpp = rf.tma_grid(n_blocks, 4, 2, persist)
    out = torch.empty(progs, dtype=torch.int32, device="cuda")
    rf._read_tma_kernel[(progs,)](TensorDescriptor.from_tensor(words, [box, 32]), out, n_blocks, bpp,
                                  BLOCK_R=box, STAGES=3, PERSIST=persist, num_warps=4)
    padded = np.zeros((n_blocks * box, 32), dtype=np.int32)
    padded[:words.shape[0]] = words.cpu().numpy()
    tiles = padded.reshape(n_blocks, box, 32)
    want = []
    for p in range(progs):
        mine = range(p, n_blocks, progs) if persist else range(p * bpp, min((p + 1) * bpp, n_blocks))
        want.append(np.bitwise_xor.reduce(tiles[list(mine)], axis=0).astype(np.int64).sum())
    want = ((np.array(want) + 2**31) % 2**32 - 2**31).astype(np.int32)
    assert out.cpu().numpy().tolist() == want.tolist()
