"""``GraphRunner``'s contract (full-cache steps of fixed rows) run eagerly, so CPU tests cover the
decoder's padded verify steps: what a CUDA graph replays, without CUDA; and a captured graph's
stand-in (:func:`eager_capture`) for the CPU tests of the graph code itself."""

import torch

from specpilot.engine.step_input import StepInput
from specpilot.kernels.gdn.path import row_paths


class EagerRunner:
    def __init__(self, model):
        self.model, self.calls = model, []

    def run(self, tokens, pos, slots, mask, paths=None):
        self.calls.append(len(tokens))
        if self.model.spec.is_hybrid and len(tokens) > 1:   # GraphRunner lays hybrid rows out as a tree
            if paths is None:
                paths = row_paths(list(range(-1, len(tokens) - 1)))
            inp = StepInput(tokens, pos, slots, mask, "tree", paths)
        else:
            inp = StepInput(tokens, pos, slots, mask, "seq")
        return self.model.greedy(inp, kv_len=self.model.max_seq)

    def ar_step(self, token, n_cache):
        dev = self.model.device
        one = torch.tensor([n_cache], device=dev)
        mask = (torch.arange(self.model.max_seq, device=dev) <= n_cache)[None]
        return int(self.run(torch.tensor([token], device=dev), one, one, mask)[0])

    def commit(self, start, rows, gdn_rows):
        """No commit graphs here: the decoder commits eagerly."""
        return False


class EagerGraph:
    """A captured graph's stand-in on the CPU: a replay runs the captured function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def eager_capture(fn, warmup, pool=None):
    """``engine.graphs.capture`` without CUDA (monkeypatch it in): the call's output and a stand-in."""
    return EagerGraph(fn), fn()


def live_state(m) -> list:
    """Every K/V cache and GDN state (recurrent and conv) of model ``m``, the tensors themselves."""
    kv = [t for blk in m.layers for t in (getattr(blk.mixer, "k_cache", None), getattr(blk.mixer, "v_cache", None))
          if t is not None]
    return kv + [t for g in m.gdn_layers() for t in (g.state, g.conv_state)]


def model_state(m) -> list:
    """Copies of :func:`live_state`."""
    return [t.clone() for t in live_state(m)]


def check_commit_graph(e, prompt, tree, rows, monkeypatch):
    """One step of ``tree`` after ``prompt`` through a real ``GraphRunner`` (capture stood in by
    eager replays), then ``rows`` committed through its commit graph and, from the same state,
    eagerly (``Transformer.commit``): the K/V caches and GDN states must end equal. Returns the
    runner."""
    from specpilot.engine import graphs

    monkeypatch.setattr(graphs, "capture", eager_capture)
    d, m = e.decoder, e.model
    n = len(prompt)
    pending = d.prefill(prompt)
    runner = graphs.GraphRunner(m, warmup=0)
    runner.run(*d.padded_rows(pending, tree, n, 1 + len(tree)))
    stepped, stashes = model_state(m), [g._stash for g in m.gdn_layers()]
    assert runner.commit(n, rows, "tree")
    got = model_state(m)
    for t, v in zip(live_state(m), stepped):
        t.copy_(v)
    for g, st in zip(m.gdn_layers(), stashes):
        g._stash = st
    m.commit(n, rows, "tree")
    assert all(torch.equal(a, b) for a, b in zip(got, model_state(m)))
    assert all(g._stash is None for g in m.gdn_layers())
    return runner
