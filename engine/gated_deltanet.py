"""The Gated DeltaNet (linear-attention) layer of the engine's hybrid models (Qwen3.5 /
Qwen3-Next layouts): :class:`GatedDeltaNet`, the mixer of a :class:`~specpilot.engine.model.Block`
whose layer kind is not full attention, on the torch reference (kernels/gdn/naive.py, path.py) or
the GDN row kernels, one request's rows or several requests' (each on its own state slot of a
:class:`~specpilot.engine.batch.cache.BatchCache`).

GDN (linear-attention) layers keep a fp32 recurrent state and a conv state per layer. How a step
treats them is given by ``gdn_rows``:

- ``"seq"``: rows are consecutive tokens; states advance in place (prefill, AR, drafting).
- ``"chain"``: rows are a chain; per-row state snapshots are kept (stock verification) and
  :meth:`~specpilot.engine.model.Transformer.commit` picks the one of the last accepted row.
- ``"tree"``: rows form a tree (``paths``); each row walks its root path from the committed state
  (no snapshots) and :meth:`~specpilot.engine.model.Transformer.commit` replays the accepted rows
  (paper 4.2).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.engine.norm import rms_norm
from specpilot.engine.step_input import BatchStepInput, Segment, StepInput, Walk, walk_table
from specpilot.kernels.gdn import naive as gdn_ref
from specpilot.kernels.gdn import path as gdn_path
from specpilot.kernels.gdn import prefill
from specpilot.models import ModelSpec


class GatedDeltaNet(nn.Module):
    """Qwen3.5-style GDN layer. One input projection ``in_proj`` gives, per row, the conv input
    (q | k | v), the output gate z and the raw b (write strength) and a (decay) values.

    ``impl`` picks the arithmetic: ``torch`` is the plain reference (kernels/gdn/naive.py, path.py);
    ``triton`` runs the conv and the gated delta rule through :mod:`specpilot.kernels.gdn.rows`
    (one kernel body for the AR step, chain/tree verification and commit, so they agree bit for
    bit) and long prompts through fla's chunked kernel (:mod:`specpilot.kernels.gdn.prefill`);
    ``auto`` is triton on CUDA, torch elsewhere. ``verify`` picks the kernel of a triton verify step:
    ``path`` (each row walks its root path, bitwise AR's arithmetic) or ``wy`` (TreeWY, one
    bf16 ulp from it, up to 64 rows; :mod:`specpilot.kernels.gdn.wy`); ``auto`` takes the measured
    faster one. :meth:`.model.Transformer.set_gdn` sets both (the engine option ``gdn``).
    ``batch_prefill``: a batched step's prompt chunks go through fla in one variable-length call
    (:meth:`_prefill_segments`); off, one request at a time (what benchmarks compare it with)."""

    batch_prefill = True

    def __init__(self, spec: ModelSpec, dtype, device):
        super().__init__()
        g = spec.gdn
        d = spec.hidden_size
        self.nk, self.nv, self.dk, self.dv, self.kernel = (g.num_key_heads, g.num_value_heads, g.key_head_dim,
                                                           g.value_head_dim, g.conv_kernel)
        self.key_dim, self.value_dim, self.conv_dim = g.key_dim, g.value_dim, g.conv_dim
        self.in_proj = nn.Linear(d, self.conv_dim + self.value_dim + 2 * self.nv, bias=False, dtype=dtype,
                                 device=device)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel, dtype=dtype, device=device))
        self.dt_bias = nn.Parameter(torch.ones(self.nv, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.zeros(self.nv, dtype=torch.float32, device=device))
        self.norm = nn.Parameter(torch.ones(self.dv, dtype=dtype, device=device))
        self.out_proj = nn.Linear(self.value_dim, d, bias=False, dtype=dtype, device=device)
        self.eps = spec.rms_norm_eps
        self.register_buffer("state", torch.zeros(self.nv, self.dk, self.dv, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("conv_state", torch.zeros(self.kernel - 1, self.conv_dim, dtype=dtype, device=device),
                             persistent=False)
        self.impl = "auto"
        self.verify = "auto"   # path | wy | auto (the measured table): how kernel steps verify rows
        self._stash = None

    def reset(self):
        self.state.zero_()
        self.conv_state.zero_()

    def split_proj(self, proj):
        """(mixed, z, ab) views of ``in_proj``'s output rows."""
        return proj.split([self.conv_dim, self.value_dim, 2 * self.nv], -1)

    def uses_kernels(self, x) -> bool:
        return self.runs_kernels(x.device)

    def runs_kernels(self, device) -> bool:
        """Whether this layer's steps on ``device`` go through the GDN row kernels."""
        return self.impl == "triton" or (self.impl == "auto" and torch.device(device).type == "cuda")

    def forward(self, x, inp: StepInput):
        return self.out_proj(self.mix(self.in_proj(x), inp))

    def _decay(self, ab):
        b, a = ab.float().chunk(2, -1)
        return -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float()), torch.sigmoid(b)

    def _gated_norm(self, out, z):
        T = out.shape[0]
        o = rms_norm(out.to(z.dtype), self.norm, self.eps) * F.silu(z.reshape(T, self.nv, self.dv))
        return o.reshape(T, self.value_dim)

    def _forward_torch(self, mixed, z, ab, inp: StepInput):
        T = mixed.shape[0]
        if inp.gdn_rows == "tree":
            windows = gdn_path.conv_windows(inp.paths.cpu(), self.kernel).to(mixed.device)
        else:
            windows = gdn_path.chain_windows(T, self.kernel).to(mixed.device)
        conv = gdn_path.causal_conv(mixed, self.conv_state, windows, self.conv_weight)
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = q.reshape(T, self.nk, self.dk)
        k = k.reshape(T, self.nk, self.dk)
        v = v.reshape(T, self.nv, self.dv)
        if self.nv != self.nk:
            q = q.repeat_interleave(self.nv // self.nk, dim=1)
            k = k.repeat_interleave(self.nv // self.nk, dim=1)
        g, beta = self._decay(ab)
        q, k, v, g, beta = gdn_ref.prepare(q, k, v, g, beta)
        if inp.gdn_rows == "tree":
            out = gdn_path.path_verify(q, k, v, g, beta, self.state, inp.paths.to(mixed.device))
            self._stash = ("tree", mixed, (q, k, v, g, beta))
        else:
            out, states = gdn_ref.recurrent(q, k, v, g, beta, self.state, keep_states=inp.gdn_rows == "chain")
            if inp.gdn_rows == "seq":
                if T:
                    self.state.copy_(states[-1])
                    self._advance_conv(mixed)
                self._stash = None
            else:
                self._stash = ("chain", mixed, states)
        return self._gated_norm(out, z)

    def mix(self, proj, inp: StepInput):
        """The layer's rows after its input projection ``proj`` (conv, gated delta rule, gated norm:
        the kernels on CUDA, the torch reference elsewhere; states advanced or the step's commit data
        kept as ``inp.gdn_rows`` says): the output projection's input [T, value_dim]."""
        mixed, z, ab = self.split_proj(proj)
        if self.uses_kernels(proj):
            return self._forward_kernels(mixed, z, ab, inp)
        return self._forward_torch(mixed, z, ab, inp)

    def _forward_kernels(self, mixed, z, ab, inp: StepInput):
        from specpilot.kernels.gdn import rows as gdn_rows, wy

        T = mixed.shape[0]
        mode = inp.gdn_rows
        self._stash = None
        if mode == "seq" and T == 1:   # the AR step: conv state and state advance in the kernels
            conv = gdn_rows.conv_rows(mixed, self.conv_state, self.conv_weight, advance=True)
            o = gdn_rows.gdn_rows(conv, ab, self.A_log, self.dt_bias, self.state, None, self.nk, new_state=self.state)
            return gdn_rows.gated_norm_rows(o.view(1, self.nv, self.dv), z, self.norm, self.eps)
        if mode == "seq" and not gdn_rows.walks_prompt(T, mixed.device):   # a prompt
            conv = gdn_rows.conv_rows(mixed, self.conv_state, self.conv_weight)
            q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], -1)
            g, beta = gdn_rows.decay_rows(ab, self.A_log, self.dt_bias)
            if prefill.available(mixed.device):
                out = prefill.chunk_prefill(q.reshape(T, self.nk, self.dk), k.reshape(T, self.nk, self.dk),
                                            v.reshape(T, self.nv, self.dv), g, beta, self.state)
            else:
                rep = self.nv // self.nk
                qp, kp, vp, gp, bp = gdn_ref.prepare(q.reshape(T, self.nk, self.dk).repeat_interleave(rep, 1),
                                                     k.reshape(T, self.nk, self.dk).repeat_interleave(rep, 1),
                                                     v.reshape(T, self.nv, self.dv), g, beta)
                out, last = gdn_ref.recurrent(qp, kp, vp, gp, bp, self.state, keep_states=False)
                self.state.copy_(last[0])
            self._advance_conv(mixed)
            return gdn_rows.gated_norm_rows(out.contiguous(), z, self.norm, self.eps)
        # chain / tree verification (and short multi-row seq steps): every row's output at the end
        # of its root path, by the path walk or by TreeWY (up to its 64 rows), whichever the table
        # says is faster
        paths = inp.paths.to(mixed.device) if mode == "tree" else gdn_rows.chain_paths(T, mixed.device)
        conv = gdn_rows.conv_rows(mixed, self.conv_state, self.conv_weight, None if mode != "tree" else paths)
        method = self.verify if self.verify != "auto" else gdn_rows.verify_method(T, mixed.device)
        if method == "wy" and mode != "seq" and T <= wy.MAX_ROWS:
            o = self._wy(conv, ab, paths, inp)
        else:
            o = gdn_rows.gdn_rows(conv, ab, self.A_log, self.dt_bias, self.state, paths, self.nk).view(T, self.nv, self.dv)
        out = gdn_rows.gated_norm_rows(o, z, self.norm, self.eps)
        if mode == "seq":
            self._replay(mixed, conv, ab, list(range(T)))
        else:
            self._stash = ("rows", mixed, (conv, ab))
        return out

    def _wy(self, conv, ab, paths, inp: StepInput):
        """TreeWY outputs [T, nv, dv] of a verify step. A tree of 2^k + 1 rows (33 = root + 32 nodes)
        has its root applied first inside the kernel, on the nodes' root-less paths (made once per
        step, kept in ``inp.node_paths``)."""
        from specpilot.kernels.gdn import rows as gdn_rows, wy

        T = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k, v = q.view(T, self.nk, self.dk), k.view(T, self.nk, self.dk), v.view(T, self.nv, self.dv)
        g, beta = gdn_rows.decay_rows(ab, self.A_log, self.dt_bias)
        nodes = None
        if wy.root_first(T):
            nodes = inp.node_paths
            if nodes is None or nodes.shape[0] != T - 1:
                nodes = inp.node_paths = wy.node_paths(paths)
        return wy.wy_verify(q, k, v, g, beta, self.state, paths, nodes=nodes)

    def _replay(self, mixed, conv, ab, rows: list[int], path: torch.Tensor | None = None):
        """Commit ``rows`` of a kernel step: replay them into the state, advance the conv state.
        ``path``: the rows as a device tensor [1, L] (the model builds it once for all layers: each
        copy from the host waits for the GPU)."""
        from specpilot.kernels.gdn import rows as gdn_rows

        if path is None:
            path = torch.tensor([rows], dtype=torch.long).to(conv.device, non_blocking=True)
        gdn_rows.gdn_rows(conv, ab, self.A_log, self.dt_bias, self.state, path, self.nk, output=False,
                          new_state=self.state)
        self._advance_conv(mixed[path[0]])

    def _advance_conv(self, rows_in):
        buf = torch.cat([self.conv_state, rows_in.to(self.conv_state.dtype)], 0)
        self.conv_state.copy_(buf[buf.shape[0] - (self.kernel - 1):])

    def commit(self, rows: list[int], path: torch.Tensor | None = None):
        """Commit the accepted rows of the last chain/tree step (row 0 first); ``path``: the same
        rows as a [1, L] device tensor, when the caller has one."""
        kind, mixed, data = self._stash
        if kind == "rows":
            self._stash = None
            self._replay(mixed, *data, rows, path)
            return
        if kind == "chain":
            self.state.copy_(data[rows[-1]])
        else:
            self.state.copy_(gdn_path.commit(*data, self.state, rows))
        self._advance_conv(mixed[torch.tensor(rows, device=mixed.device)])
        self._stash = None

    def forward_batch(self, x, inp: BatchStepInput, cache):
        """Rows of several requests (:meth:`mix_batch`); the input and output projections run once
        over every request's rows (one pass of the weights)."""
        return self.out_proj(self.mix_batch(self.in_proj(x), inp, cache))

    def mix_batch(self, proj, inp: BatchStepInput, cache):
        """:meth:`mix` for the rows of several requests, each on its own slot's state
        (``cache.state``/``cache.conv``). With the kernels, one conv and one delta-rule launch serve
        every request that brings one AR row (its state advanced in place), or every request's
        chain/tree verify rows (:class:`Walk`: each row walking its root path from its request's
        committed state, the path kernel's AR-exact arithmetic; the stash per slot for
        :meth:`commit_slot`). Other segments (prompt chunks, a request's lone AR row in an eager
        verify step, the CPU's torch path) run :meth:`mix` on their slot's state, swapped in as
        this layer's buffers."""
        kern = self.uses_kernels(proj)
        if kern and inp.walk is None and all(sg.rows == 1 and sg.gdn_rows == "seq" for sg in inp.segments):
            from specpilot.kernels.gdn import rows as gdn_rows

            mixed, z, ab = self.split_proj(proj)
            conv = gdn_rows.conv_rows(mixed, cache.conv, self.conv_weight, advance=True, slots=inp.req)
            o = gdn_rows.gdn_rows(conv, ab, self.A_log, self.dt_bias, cache.state, None, self.nk,
                                  new_state=cache.state, slots=inp.req)
            return gdn_rows.gated_norm_rows(o.view(-1, self.nv, self.dv), z, self.norm, self.eps)
        if kern and inp.walk is None:
            inp.walk = walk_table(inp.segments, proj.device)
        outs = dict(zip(inp.walk.segments, self._walk(proj, inp.walk, inp.segments, cache))) \
            if kern and inp.walk is not None else {}
        prompts = [i for i, sg in enumerate(inp.segments) if i not in outs and sg.gdn_rows == "seq" and sg.rows > 1]
        if kern and self.batch_prefill and len(prompts) > 1 and prefill.available(proj.device):
            outs.update(zip(prompts, self._prefill_segments(proj, [inp.segments[i] for i in prompts], cache)))
        own = self.state, self.conv_state
        try:
            for i, sg in enumerate(inp.segments):
                if i in outs:
                    continue
                self.state, self.conv_state = cache.state[sg.slot], cache.conv[sg.slot]
                r = slice(sg.start, sg.start + sg.rows)
                outs[i] = self.mix(proj[r], StepInput(inp.tokens[r], inp.pos[r], inp.slots[r], inp.mask[r],
                                                      sg.gdn_rows, sg.paths))
                stash, self._stash = self._stash, None
                if stash is not None:
                    cache.stash[sg.slot] = stash
        finally:
            self.state, self.conv_state = own
        return torch.cat([outs[i] for i in range(len(inp.segments))]) if len(outs) > 1 else outs[0]

    def _prefill_segments(self, proj, segs: list[Segment], cache) -> list[torch.Tensor]:
        """Several requests' prompt chunks (``segs``) at once: one conv launch (each row from its
        request's window), one variable-length chunked delta-rule call (each chunk from its slot's
        state, the state left there), one gated norm; each slot's conv window advanced past its
        chunk. What :meth:`mix` does for one chunk, without a launch sequence per request."""
        from specpilot.kernels.gdn import rows as gdn_rows

        lengths = [sg.rows for sg in segs]
        slots = [sg.slot for sg in segs]
        starts = list(itertools.accumulate(lengths, initial=0))[:-1]
        if all(b.start == a.start + a.rows for a, b in zip(segs, segs[1:])):
            proj = proj[segs[0].start:segs[-1].start + segs[-1].rows]
        else:
            rows = [r for sg in segs for r in range(sg.start, sg.start + sg.rows)]
            proj = proj.index_select(0, torch.tensor(rows).to(proj.device, non_blocking=True))
        mixed, z, ab = self.split_proj(proj)
        T = mixed.shape[0]
        dev = mixed.device
        row_slot = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)]).to(dev, non_blocking=True)
        row_start = torch.tensor([a for a, n in zip(starts, lengths) for _ in range(n)]).to(dev, non_blocking=True)
        conv = gdn_rows.conv_rows(mixed, cache.conv, self.conv_weight, slots=row_slot, starts=row_start)
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        g, beta = gdn_rows.decay_rows(ab, self.A_log, self.dt_bias)
        o = prefill.chunk_prefill_segments(q.reshape(T, self.nk, self.dk), k.reshape(T, self.nk, self.dk),
                                           v.reshape(T, self.nv, self.dv), g, beta, cache.state, slots, lengths)
        gdn_rows.advance_conv_segments(cache.conv, mixed, slots, starts, lengths)
        out = gdn_rows.gated_norm_rows(o.contiguous(), z, self.norm, self.eps)
        return [out[a:a + n] for a, n in zip(starts, lengths)]

    def _walk(self, proj, walk: Walk, segments: list[Segment], cache) -> list[torch.Tensor]:
        """The walked segments' rows in one conv and one verification launch (the path kernel, or
        TreeWY where it is the faster for the segments' rows, as for one request): each segment's
        outputs, its stash left in ``cache.stash[slot]`` as :meth:`mix` leaves it."""
        from specpilot.kernels.gdn import rows as gdn_rows, wy

        proj = proj if walk.rows is None else proj[walk.rows]
        conv = None
        if cache.keep is not None:   # a bucket graph's step: the commit's rows in the buckets' shared buffers
            kproj, kconv = cache.keep
            if kproj.shape[0] < proj.shape[0] or kproj.shape[1:] != proj.shape[1:] or kproj.dtype != proj.dtype:
                raise ValueError(f"GDN walk: kept rows {tuple(kproj.shape)} {kproj.dtype} cannot hold the step's "
                                 f"{tuple(proj.shape)} {proj.dtype}")
            proj = kproj[:proj.shape[0]].copy_(proj)
            conv = kconv[:proj.shape[0]]
        mixed, z, ab = self.split_proj(proj)
        conv = gdn_rows.conv_rows(mixed, cache.conv, self.conv_weight, walk.paths, slots=walk.slots, out=conv)
        method = self.verify if self.verify != "auto" else gdn_rows.verify_method(walk.most, mixed.device)
        if method == "wy" and walk.most <= wy.MAX_ROWS:
            T = conv.shape[0]
            q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], -1)
            g, beta = gdn_rows.decay_rows(ab, self.A_log, self.dt_bias)
            o = wy.wy_verify_segments(q.view(T, self.nk, self.dk), k.view(T, self.nk, self.dk),
                                      v.view(T, self.nv, self.dv), g, beta, cache.state, walk.paths, walk.segs,
                                      walk.most)
        else:
            o = gdn_rows.gdn_rows(conv, ab, self.A_log, self.dt_bias, cache.state, walk.paths, self.nk,
                                  slots=walk.slots)
        out = gdn_rows.gated_norm_rows(o.view(-1, self.nv, self.dv), z, self.norm, self.eps)
        res, at, by_slot = [], 0, {}
        for i in walk.segments:
            sg = segments[i]
            r = slice(at, at + sg.rows)
            cache.stash[sg.slot] = ("rows", mixed[r], (conv[r], ab[r]))
            by_slot[sg.slot] = (at, cache.stash[sg.slot])
            res.append(out[r])
            at += sg.rows
        cache.walked = (mixed, conv, ab, by_slot)
        return res

    def commit_walked(self, cache, plan) -> list[int]:
        """Commit the requests of ``plan`` (:class:`~specpilot.engine.batch.commit.CommitPlan`) whose
        rows this layer walked in one launch in the last step: one replay launch over their accepted
        paths (each into its own slot's state, the arithmetic of :meth:`commit`) and one conv-state
        advance. Returns the slots left to commit one by one (stashes from another path)."""
        from specpilot.kernels.gdn import rows as gdn_rows

        w = cache.walked

        def walked_here(s: int, at: int) -> bool:   # this layer's walk made the slot's stash, at that row
            got = w[3].get(s)
            return got is not None and got[0] == at and cache.stash.get(s) is got[1]

        if w is None or not all(walked_here(s, at) for s, at in zip(plan.slots, plan.starts)):
            return list(plan.slots)
        mixed, conv, ab, _ = w
        gdn_rows.gdn_rows(conv, ab, self.A_log, self.dt_bias, cache.state, plan.paths, self.nk, output=False,
                          new_state=cache.state, slots=plan.slots_t)
        old = cache.conv[plan.slots_t]
        kept = old.gather(1, plan.old_row[..., None].expand(-1, -1, old.shape[-1]))
        cache.conv[plan.slots_t] = torch.where(plan.use_old[..., None], kept, mixed[plan.mix_row].to(old.dtype))
        for s in plan.slots:
            del cache.stash[s]
        return []

    def commit_slot(self, cache, slot: int, rows: list[int]):
        """:meth:`commit` for slot ``slot`` of a batch cache."""
        own = self.state, self.conv_state, self._stash
        try:
            self.state, self.conv_state, self._stash = cache.state[slot], cache.conv[slot], cache.stash.pop(slot)
            self.commit(rows)
        finally:
            self.state, self.conv_state, self._stash = own
