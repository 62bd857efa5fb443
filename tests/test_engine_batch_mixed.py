"""Mixed bucket graphs of the batch decoder (``engine/batch/graphs.py``): a verify step that carries
one prompt chunk replays a bucket of B x N verify rows plus P prompt rows instead of running
eagerly. On the CPU the "graphs" run the fused kernels under Triton's interpreter on the same static
buffers, so the layout, the refreshed segment table and the outputs are checked here; the GPU file
checks it under CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.engine.batch.graphs import mixes
from specpilot.engine.batch.requests import Request
from specpilot.engine.batch.scheduler import BatchDecoder
from specpilot.engine.batch.step import assemble, fits_mixed, prefill_rows, verify_rows
from specpilot.kernels import tree as treelib


@pytest.fixture(scope="module")
def model():
    m = _fused("tiny", 96)
    m.layers = m.layers[:2]
    return m


def _fused(name: str, ctx: int):
    """A float32 CPU model of ``name`` with the fused kernels (Triton's interpreter)."""
    m = load_engine(f"engine:model={name},mode=ar,ctx={ctx},device=cpu,dtype=float32,graphs=0,decode=layers").model
    assert m.set_decode("fused") == "fused"
    return m


def test_assemble_puts_the_prompt_chunk_after_the_bucket_rows():
    verify = [verify_rows(0, 5, treelib.chain_tree([]), 10, "seq"), verify_rows(1, 6, treelib.chain_tree([]), 7, "seq")]
    chunk = prefill_rows(2, list(range(30, 40)), 4, 9, True)     # prompt rows 4..8 of slot 2
    inp, width, need = assemble(verify, 64, torch.device("cpu"), pad=(4, 1), prompt=(chunk, 16))
    assert width == 64 and len(inp.tokens) == 4 + 16
    assert [(s.slot, s.start, s.rows) for s in inp.segments] == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1),
                                                                  (2, 4, 16)]
    assert need == [[0], [1], [4 + 4]]
    assert inp.tokens[4:9].tolist() == [34, 35, 36, 37, 38] and inp.slots[4:9].tolist() == [4, 5, 6, 7, 8]
    # padding rows: past the chunk in its own slot, attending position 0 only
    assert inp.slots[9:20].tolist() == list(range(9, 20)) and inp.req[4:20].tolist() == [2] * 16
    assert inp.mask[9:].sum(1).tolist() == [1] * 11 and inp.mask[9:, 0].all()
    assert inp.mask[4:9, :9].numpy().tolist() == np.tril(np.ones((5, 9), bool), 4).tolist()
    # the bucket's padding rows for the chunk's slot write the cache's last position: the chunk's stay below
    assert inp.slots[2] == 63 and fits_mixed(chunk, 16, 1, 21) and not fits_mixed(chunk, 16, 1, 20)
    assert not fits_mixed(chunk, 4, 1, 64)


def test_assemble_lays_free_slots_padding_at_their_first_positions():
    """Padding rows of a free slot write at its first positions (the attention walks a slot up to the
    highest position its rows write: a tile, not the whole cache); a prefilling request's at the
    cache's last, past anything it holds; a hybrid's dump slot takes both at the same positions."""
    verify = [verify_rows(0, 5, treelib.chain_tree([]), 10, "seq"), verify_rows(2, 6, treelib.chain_tree([]), 7, "seq")]
    for dump in (None, 9):
        inp, _, _ = assemble(verify, 64, torch.device("cpu"), pad=(6, 2), dump=dump, free_from=3)
        # slot 1 runs (prefilling), slots 3-5 are free
        assert inp.slots.tolist() == [10, 11, 62, 63, 7, 8, 0, 1, 0, 1, 0, 1]
        assert inp.req.tolist() == [0, 0] + [1 if dump is None else dump] * 2 + [2, 2] + \
            ([3, 3, 4, 4, 5, 5] if dump is None else [dump] * 6)
        assert inp.mask[6:].sum(1).tolist() == [1] * 6 and inp.mask[6:, 0].all()
    old, _, _ = assemble(verify, 64, torch.device("cpu"), pad=(6, 2))
    assert old.slots[6:].tolist() == [62, 63] * 3


def test_only_the_fused_rows_path_of_a_dense_model_mixes(model):
    assert mixes(model)
    assert not mixes(_fused("tiny-hybrid", 64))
    layers = load_engine("engine:model=tiny,mode=ar,ctx=64,device=cpu,dtype=float32,graphs=0,decode=layers").model
    assert not mixes(layers)
    with pytest.raises(ValueError, match="mixed buckets"):
        BatchDecoder(layers, "ar", batch=2, graphs=True).runner.prepare_mixed([(2, 1, 16)])


def test_prompt_rows_in_an_ar_step_replay_a_mixed_bucket(model):
    """A prompt arriving while three requests decode joins their AR step (``admit=waiting``) through
    the mixed bucket (4, 1, 16): no eager step, and every request's tokens as without graphs."""
    prompts = [[(5 * i + k) % 200 for k in range(6 + i)] for i in range(4)]

    def run(graphs):
        dec = BatchDecoder(model, "ar", batch=4, graphs=graphs, admit="waiting", admit_rows=16)
        assert dec.prompt_sizes() == ([16] if graphs else [])
        if graphs:
            dec.runner.prepare_mixed([(4, 1, 16)])
        res = dec.generate_many([Request(p, 5, id=i, arrival_step=0 if i < 3 else 2) for i, p in enumerate(prompts)])
        return [r.output_ids for r in res], dec.stats

    plain, _ = run(False)
    got, st = run(True)
    assert got == plain
    assert st.mixed_steps == 1 and st.eager_steps == 0 and st.admitted_prompt_rows == len(prompts[3])


def test_mixed_buckets_follow_the_rule_and_fit_the_cache(model):
    """The prompt rows captured: none with ``admit=off``, up to what one prompt may bring under
    ``waiting`` (``admit_rows``) and ``all`` (a prefill chunk), never past the cache (96 slots)."""
    def sizes(admit, **kw):
        return BatchDecoder(model, "ar", batch=2, graphs=True, admit=admit, **kw).prompt_sizes()

    assert sizes("off") == [] and sizes("waiting", admit_rows=40) == [16, 32, 64]
    assert sizes("waiting", admit_rows=16) == [16] and sizes("all") == [16, 32, 64]
    assert BatchDecoder(model, "tree", "ngram", batch=2, graphs=True).prompt_sizes() == []
