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
    # the bucket's padding row for the chunk's slot writes after the chunk's padding, within the cache
    assert inp.slots[2] == 20 and fits_mixed(chunk, 16, 1, 21) and not fits_mixed(chunk, 16, 1, 20)
    assert not fits_mixed(chunk, 4, 1, 64)


def test_assemble_lays_padding_rows_past_what_each_slot_holds():
    """A slot without rows writes its padding rows past what it holds (the attention walks a slot up
    to the highest position its rows write): a free slot at its start, a prefilling request after
    its prefilled rows, a mixed step's chunk slot after the chunk's padding; without ``held`` (or
    where the rows would pass the cache's end) at the cache's last positions. A hybrid's dump slot
    takes the same positions."""
    verify = [verify_rows(0, 5, treelib.chain_tree([]), 10, "seq"), verify_rows(2, 6, treelib.chain_tree([]), 7, "seq")]
    held = {0: 10, 1: 20, 2: 7, 3: 0, 4: 0, 5: 0}   # slot 1 prefilling (20 rows so far), slots 3-5 free
    for dump in (None, 9):
        inp, _, _ = assemble(verify, 64, torch.device("cpu"), pad=(6, 2), dump=dump, held=held)
        assert inp.slots.tolist() == [10, 11, 20, 21, 7, 8, 0, 1, 0, 1, 0, 1]
        assert inp.req.tolist() == [0, 0] + [1 if dump is None else dump] * 2 + [2, 2] + \
            ([3, 3, 4, 4, 5, 5] if dump is None else [dump] * 6)
        assert inp.mask[2:4].sum(1).tolist() == [1, 1] and inp.mask[6:].sum(1).tolist() == [1] * 6
        assert inp.mask[2:4, 0].all() and inp.mask[6:, 0].all()
    old, _, _ = assemble(verify, 64, torch.device("cpu"), pad=(6, 2))
    assert old.slots[2:4].tolist() == [62, 63] and old.slots[6:].tolist() == [62, 63] * 3
    near_end, _, _ = assemble(verify, 64, torch.device("cpu"), pad=(6, 2), held={**held, 1: 63})
    assert near_end.slots[2:4].tolist() == [62, 63]
    # a mixed step: slot 1's chunk (rows 20..24, padded to 16 rows) - its padding row after them
    chunk = prefill_rows(1, list(range(40)), 20, 25, False)
    mixed, _, _ = assemble(verify, 64, torch.device("cpu"), pad=(6, 1), prompt=(chunk, 16), held=held)
    assert mixed.slots[1] == 25 + 11 and mixed.slots[6:11].tolist() == list(range(20, 25))
    assert mixed.slots[11:].tolist() == list(range(25, 36))


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


def test_padding_rows_of_a_prefilling_slot_write_past_its_prompt_rows(model, monkeypatch):
    """A 40-token prompt prefills in 16-row passes (``admit=waiting``, 16 rows) while two requests
    decode and a short prompt rides their step through mixed bucket (4, 1, 16), then decodes: the
    long prompt's passes (one chunk each) replay the same bucket with every verify row padding; its
    slot gets its bucket padding row right after the rows prefilled so far, and in a step that
    carries its own chunk after that chunk's padding; every output equals the graphless decoder's."""
    from specpilot.engine.batch import scheduler as sch

    prompts = [[(3 * i + k) % 200 for k in range(5)] for i in range(2)] + [[(7 * k) % 190 for k in range(40)],
                                                                          [11, 12, 13, 14, 15]]
    seen = []
    real = sch.assemble

    def spy(*a, **kw):
        out = real(*a, **kw)
        if kw.get("pad") == (4, 1):
            seen.append((out[0].slots[:4].tolist(), kw.get("prompt") is not None))
        return out

    def run(graphs):
        dec = BatchDecoder(model, "ar", batch=4, graphs=graphs, admit="waiting", admit_rows=16, prefill_chunk=16,
                           overlap=False)
        if graphs:
            dec.runner.prepare_mixed([(4, 1, 16)])
        res = dec.generate_many([Request(p, 6, id=i, arrival_step=0 if i < 2 else 2) for i, p in enumerate(prompts)])
        return [r.output_ids for r in res], dec.stats

    plain, _ = run(False)
    monkeypatch.setattr(sch, "assemble", spy)
    got, st = run(True)
    assert got == plain and st.mixed_steps == 2 and st.eager_steps == 0
    assert st.prefill_passes == 3 and st.prefill_replays == 2   # the first pass holds two prompts: eager
    assert ([6, 6, 0, 16], True) in seen       # the short prompt's chunk (5 rows in 16): its slot's row at 16
    assert ([7, 7, 16, 5], True) in seen       # the long prompt's first pass (rows 0-15): its slot's row at 16
    assert ([7, 7, 16, 5], False) in seen      # the AR step after it
    assert ([8, 8, 48, 6], True) in seen       # its last 8 rows ride the step: after their padding (32 + 16)


def test_mixed_buckets_follow_the_rule_and_fit_the_cache(model):
    """The prompt rows captured: none with ``admit=off``, up to what one prompt may bring under
    ``waiting`` (``admit_rows``) and ``all`` (a prefill chunk), never past the cache (96 slots)."""
    def sizes(admit, **kw):
        return BatchDecoder(model, "ar", batch=2, graphs=True, admit=admit, **kw).prompt_sizes()

    assert sizes("off") == [] and sizes("waiting", admit_rows=40) == [16, 32, 64]
    assert sizes("waiting", admit_rows=16) == [16] and sizes("all") == [16, 32, 64]
    assert BatchDecoder(model, "tree", "ngram", batch=2, graphs=True).prompt_sizes() == []


def test_no_row_attends_past_its_own_cache_slot():
    """In every step ``assemble`` lays out (decoding rows, chains, free and prefilling slots, a
    hybrid's dump slot, a mixed step's prompt chunk and its padding), each row attends nothing past
    the cache slot it writes: the attention's live walk ends at the highest slot a program's rows
    write, so past it tiles are only checked, never loaded, and padding rows cost what their slot
    holds."""
    verify = [verify_rows(0, 5, treelib.chain_tree([3, 4, 5]), 10, "seq"),
              verify_rows(2, 6, treelib.chain_tree([]), 7, "seq")]
    held = {0: 10, 1: 20, 2: 7, 3: 0, 4: 0, 5: 0}
    chunk = prefill_rows(1, list(range(40)), 20, 25, False)
    steps = [assemble(verify, 64, torch.device("cpu"), pad=(6, 4), dump=dump, held=held)[0] for dump in (None, 9)]
    steps.append(assemble(verify, 64, torch.device("cpu"), pad=(6, 1 + 3), prompt=(chunk, 16), held=held)[0])
    steps.append(assemble(verify + [chunk], 64, torch.device("cpu"))[0])
    for inp in steps:
        last = torch.where(inp.mask, torch.arange(inp.mask.shape[1]), -1).max(1).values
        assert (last >= 0).all() and (last <= inp.slots).all()
