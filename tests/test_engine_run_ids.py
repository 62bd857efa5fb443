"""``Engine.run`` takes a prompt's ids as ``generate`` does (any integer sequence, an empty one
refused) and refuses a prompt with neither ids nor text (InputError, not KeyError)."""

import numpy as np
import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.errors import InputError


@pytest.mark.parametrize("batch", [1, 2])
def test_run_takes_the_ids_generate_takes(batch):
    e = load_engine(f"engine:model=tiny,mode=tree,batch={batch}")
    want = e.run([{"id": 0, "ids": [97, 98, 99]}], 4).results[0]["output_ids"]
    for ids in (np.array([97, 98, 99]), torch.tensor([97, 98, 99]), (97, 98, 99)):
        r = e.run([{"id": 0, "ids": ids}], 4).results[0]
        assert r["prompt_ids"] == [97, 98, 99] and all(type(t) is int for t in r["prompt_ids"])
        assert r["output_ids"] == want
    for bad, words in (({"id": 0, "ids": []}, "prompt 0: empty prompt"),
                       ({"id": 0, "ids": [], "text": "ab"}, "prompt 0: 'ids' or 'text', not both"),   # not the text instead
                       ({"id": 3}, "prompt 3: a prompt needs 'ids' (token ids) or 'text'"),
                       ({"id": 0, "ids": [1.5, 2]}, "prompt_ids must be a sequence of integer token ids")):
        with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
            e.run([bad], 4)


def test_a_cpu_engines_requests_import_no_gpu_kernel_modules():
    """The step path imported the verify GEMM's Triton modules inside the first request on a CPU
    (half a second of its prefill, 0.23-0.48 s against 2 ms for the same prompt next): its tokens/s
    and the run's totals were off. A fresh process, so that no other test imported them first."""
    import subprocess
    import sys

    code = ("import sys\nfrom specpilot.engine.api import load_engine\n"
            "e = load_engine('model=tiny,mode=tree')\ne.generate([1, 2, 3], 4)\n"
            "print(sorted(m for m in sys.modules if m.startswith('specpilot.kernels.verify')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
