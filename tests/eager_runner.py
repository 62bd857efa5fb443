"""``GraphRunner``'s contract (full-cache steps of fixed rows) run eagerly, so CPU tests cover the
decoder's padded verify steps: what a CUDA graph replays, without CUDA."""

import torch

from specpilot.engine.model import StepInput
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
