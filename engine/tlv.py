"""TLV (paper 4.3): two-stage verification that rations exact passes.

One cycle:

1. draft 1: the drafter's lattice, the best-first tree of ``nodes`` nodes (``kernels.tree``);
2. Q pass: the tree scored with the W12 8-bit view of the target's projections
   (:class:`QView`: discarded mantissa bits at their midpoint). GDN layers run the tree as paths
   from the committed state and the K/V it writes lie past the committed prefix (restored on the
   CPU, :func:`scratch`), so the committed cache and the recurrent state end bit-identical
   (:meth:`TLVDecoder.q_pass`);
3. commit chain C: the Q pass's argmax path through the tree plus its bonus token (nothing is
   accepted yet);
4. draft 2: a fresh best-first tree from the end of C (``propose_after``), truncated to
   ``nodes - |C|`` nodes and attached under C (``kernels.tree.truncate`` / ``attach``);
5. exact pass: C + subtree verified with the exact weights (``Decoder.verify_predictions``),
   the longest matching path plus bonus accepted (``Decoder.accept_commit``). It is the only pass
   that writes target state, so the output equals AR's whatever the Q pass picks.

tau counts tokens per exact pass; the cycle's time is split into draft 1, Q pass, draft 2, exact
pass and append (acceptance, KV compaction, GDN commit).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specpilot.engine.decode import Decoder, row_buckets
from specpilot.engine.drafters import Lattice
from specpilot.engine.graphs import GraphRunner
from specpilot.engine.model import Attention, Transformer
from specpilot.engine.step_input import StepInput
from specpilot.errors import InputError
from specpilot.kernels import tree as treelib

PHASES = ("draft1", "qpass", "draft2", "exact", "append")


def cpu_bf16_fast() -> bool:
    """Whether this CPU has bf16 matrix or vector units (AMX, AVX512-BF16), where a bf16 GEMM
    costs about a third of an fp32 one at verify sizes; elsewhere bf16 on the CPU is slower."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def check_fp8_gpu(device) -> None:
    """Refuse ``qview=fp8`` on a GPU without FP8 tensor cores (before sm_89): exit 3."""
    from specpilot.engine.spec import fp8_tensor_cores
    from specpilot.errors import EnvironmentMissing

    if not fp8_tensor_cores(str(device)):
        major, minor = torch.cuda.get_device_capability(device)
        raise EnvironmentMissing(f"qview=fp8 multiplies e4m3 weights on FP8 tensor cores (sm_89 or newer); "
                                 f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: use qview=w12")


class QView:
    """The Q pass's weights: for every projection of the target's layers, its W12 8-bit view
    (``kernels.w12.decode(packed, qpass=True)``) or with ``kind`` fp8 its e4m3 copy
    (``kernels.fp8``), made once at load. :meth:`active` swaps the views into the projections for
    the length of a pass.

    On CUDA an fp8 view (:meth:`build_fp8`) is each projection's e4m3 copy (``fp8``), which the
    fused rows path multiplies with FP8 tensor-core GEMMs while the view is active; on the CPU it is
    the e4m3 weights dequantized, a dense view like the W12 one.

    On CUDA (:meth:`build_packs`) the view is never made dense: each projection's W12 records in
    the kernels' layout (``packs``; a W12 target's own) are read by the QPASS variants of the W12
    kernels, which the fused rows path (``engine/fused_verify.py``) calls while the view is active.

    The views are bf16 numbers. On a float32 model on a CPU with bf16 units the Q pass keeps
    them in bf16 and runs under CPU autocast with a bf16 copy of the LM head: it reads half the
    bytes of the exact pass and its GEMMs run on the bf16 units (an approximate pass may round
    more; only the exact pass accepts). Elsewhere the views take the model's dtype and the LM
    head and embeddings stay exact (W12 converts projections only)."""

    def __init__(self, pairs: list[tuple[torch.nn.Linear, torch.Tensor]], model: Transformer | None = None,
                 head: torch.nn.Linear | None = None, packs: list[tuple[torch.nn.Module, object]] | None = None,
                 fp8: list[tuple[torch.nn.Module, object]] | None = None, kind: str = "w12"):
        self.pairs = pairs
        self.model, self.head = model, head   # head: the bf16 LM head of a bf16 Q pass (None: exact)
        self.packs = packs or []              # CUDA: (projection, KernelPack) pairs
        self.fp8 = fp8 or []                  # CUDA, kind fp8: (projection, Fp8Weight) pairs
        self.kind = kind

    @property
    def dtype(self) -> torch.dtype | None:
        return self.pairs[0][1].dtype if self.pairs else torch.bfloat16 if self.packs or self.fp8 else None

    def extra_bytes(self) -> int:
        """Device or host memory the view adds to the target's (a W12 target's packs are its own)."""
        own = {id(getattr(lin, "kp", None)) for lin, _ in self.packs}
        return (sum(q.numel() * q.element_size() for _, q in self.pairs)
                + sum(kp.nbytes() for _, kp in self.packs if id(kp) not in own)
                + sum(fw.nbytes() for _, fw in self.fp8))

    @classmethod
    def for_model(cls, model: Transformer, kind: str, views: dict[str, torch.Tensor] | None = None) -> "QView":
        """The view ``kind`` (w12 or fp8) a TLV engine on ``model`` runs its Q pass with: on CUDA the
        W12 kernel packs or the e4m3 copies (fp8 refused before sm_89), on the CPU a dense view
        (``views``: the W12 loader's 8-bit views)."""
        if model.device.type != "cuda":
            return cls.build(model, views, kind=kind)
        if kind == "fp8":
            check_fp8_gpu(model.device)
            return cls.build_fp8(model)
        return cls.build_packs(model)

    @classmethod
    @torch.no_grad()
    def build_fp8(cls, model: Transformer) -> "QView":
        """The CUDA fp8 view: every projection's e4m3 copy with its power-of-two scale
        (``kernels.fp8.quantize_weight``), from the weight, or from a W12 target's records restored
        one projection at a time. A projection whose sides are not multiples of 16 keeps its exact
        weights in the Q pass."""
        from specpilot.engine.w12_loader import projections
        from specpilot.kernels.fp8 import linear as fp8

        pairs = []
        for parent, attr, _ in projections(model, w12=True):
            lin = getattr(parent, attr)
            kp = getattr(lin, "kp", None)
            if kp is not None:
                from specpilot.kernels.w12.restore import restore

                w = restore(kp)
            else:
                w = lin.weight.detach()
            if fp8.supported(w):
                pairs.append((lin, fp8.quantize_weight(w)))
            del w
        return cls([], model, fp8=pairs, kind="fp8")

    @classmethod
    @torch.no_grad()
    def build_packs(cls, model: Transformer) -> "QView":
        """The CUDA view: every projection's W12 records in the kernels' layout, a W12 target's
        own (``W12Projection.kp``) or encoded now from the weight rounded to bf16 (12 bits per
        weight beside the exact weights; the Q pass reads their 8-bit part)."""
        from specpilot.engine.w12_loader import projections
        from specpilot.kernels.w12 import encode
        from specpilot.kernels.w12.pack import KernelPack

        packs = []
        for parent, attr, _ in projections(model, w12=True):
            lin = getattr(parent, attr)
            kp = getattr(lin, "kp", None)
            if kp is None:
                kp = KernelPack.from_w12(encode(lin.weight.detach().to(torch.bfloat16)), device=lin.weight.device)
            packs.append((lin, kp))
        return cls([], model, packs=packs)

    @classmethod
    @torch.no_grad()
    def build(cls, model: Transformer, views: dict[str, torch.Tensor] | None = None,
              bf16_pass: bool | None = None, kind: str = "w12") -> "QView":
        """``views``: 8-bit views by projection name from the W12 loader (``w12=1``: the records
        the engine already holds); otherwise the view of each weight rounded to bf16 (a float32
        weight has no exact W12 form; the Q pass only needs an approximation), computed without
        building the records (``kernels.w12.qpass_view``); with ``kind`` fp8 each weight's e4m3
        copy dequantized (``kernels.fp8.naive``). ``bf16_pass``: run the pass in bf16 (default: a
        float32 model on a CPU with bf16 units)."""
        from specpilot.engine.model import weights_left_unset
        from specpilot.engine.w12_loader import projections
        from specpilot.kernels.fp8 import naive as fp8
        from specpilot.kernels.w12 import qpass_view

        w = model.lm_head.weight
        if bf16_pass is None:
            bf16_pass = w.device.type == "cpu" and w.dtype == torch.float32 and cpu_bf16_fast()
        dtype = torch.bfloat16 if bf16_pass else w.dtype
        pairs = []
        for parent, attr, name in projections(model):
            lin = getattr(parent, attr)
            q = views.get(name) if views and kind == "w12" else None
            if kind == "fp8":
                q = fp8.dequantize_weight(*fp8.quantize_weight(lin.weight.detach()))
            elif q is None:
                q = qpass_view(lin.weight.detach().to(torch.bfloat16))
            pairs.append((lin, q.to(dtype).to(lin.weight.device)))
        head = None
        if bf16_pass and w.dtype != torch.bfloat16:
            with weights_left_unset():   # the copy below writes every weight
                head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16, device=w.device)
            head.weight.copy_(w.detach())
        return cls(pairs, model, head, kind=kind)

    @contextmanager
    def active(self):
        if self.packs or self.fp8:
            attr, pairs = ("qkp", self.packs) if self.packs else ("q8", self.fp8)
            try:
                for lin, w in pairs:
                    setattr(lin, attr, w)
                yield
            finally:
                for lin, _ in pairs:
                    setattr(lin, attr, None)
            return
        exact = [lin.weight.data for lin, _ in self.pairs]
        lm_head = self.model.lm_head if self.head is not None else None
        try:
            for lin, q in self.pairs:
                lin.weight.data = q
            if self.head is None:
                yield
            else:
                self.model.lm_head = self.head
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    yield
        finally:
            for (lin, _), w in zip(self.pairs, exact):
                lin.weight.data = w
            if lm_head is not None:
                self.model.lm_head = lm_head


def q_agreement(q_argmax: list[int], q_path: list[int], exact: list[int]) -> int:
    """How often the Q pass's argmax equals the exact pass's where both predict from the same prefix:
    after the pending token and after each node of C's path (``q_path``: C's nodes in the draft-1
    tree; C's node i is node i of the exact tree, so the exact pass predicted after it at row i+1)."""
    return sum(int(q_argmax[1 + q] if i else q_argmax[0]) == int(exact[i]) for i, q in enumerate([-1] + q_path))


def cycle_record(nodes: int, q_argmax: list[int], commit: list[int], draft2: Lattice, first: Lattice) -> dict:
    """A lattice row's ``tlv`` field and its ``_m`` (the target tokens the row needs): the budget, the
    Q pass's argmax at the root and every node of the draft-1 tree, C, and the draft-2 lattice."""
    return {"tlv": {"nodes": nodes, "q_argmax": [int(x) for x in q_argmax], "commit": [int(x) for x in commit],
                    "draft2": {"tokens": draft2.tokens, "logprobs": draft2.logprobs,
                               "transitions": draft2.transitions}},
            "_m": max(first.m, len(commit) + draft2.m)}


@contextmanager
def scratch(model: Transformer, start: int, rows: int):
    """Run a pass of ``rows`` rows at slots ``start..`` without leaving a trace: the attention
    layers' KV in those slots is restored afterwards and the GDN layers' pending commit data is
    dropped (the pass must run its GDN rows as a tree or a chain, which never advance the state)."""
    attn = [b.mixer for b in model.layers if isinstance(b.mixer, Attention)]
    end = min(start + rows, model.max_seq)
    saved = [(a.k_cache[:, :, start:end].clone(), a.v_cache[:, :, start:end].clone()) for a in attn]
    try:
        yield
    finally:
        for a, (k, v) in zip(attn, saved):
            a.k_cache[:, :, start:end] = k
            a.v_cache[:, :, start:end] = v
        for g in model.gdn_layers():
            g._stash = None


@dataclass
class TLVStats:
    """One request's cycles: |C|, the Q pass's top-1 agreement with the exact pass (at the root
    and at each node of C's path: the positions both passes predict from the same prefix) and
    the time of each phase."""

    nodes: int
    cycles: int = 0
    chain_tokens: int = 0
    accepted_tokens: int = 0
    q_agree: int = 0
    q_compared: int = 0
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, other: "TLVStats") -> None:
        self.cycles += other.cycles
        self.chain_tokens += other.chain_tokens
        self.accepted_tokens += other.accepted_tokens
        self.q_agree += other.q_agree
        self.q_compared += other.q_compared
        for k in PHASES:
            self.seconds[k] += other.seconds[k]

    @classmethod
    def from_json(cls, d: dict) -> "TLVStats":
        s = cls(d["nodes"], d["cycles"], d["chain_tokens"], d["accepted_tokens"], d["q_agree"], d["q_compared"])
        s.seconds = {k: d["time_ms"][k] * d["cycles"] / 1e3 for k in PHASES}
        return s

    def count(self, chain: int, accepted: int, agree: int) -> None:
        """One finished cycle: |C|, the tokens its exact pass accepted, and the Q pass's agreeing
        positions (``q_agreement``; |C| of them were compared)."""
        self.cycles += 1
        self.chain_tokens += chain
        self.accepted_tokens += accepted
        self.q_agree += agree
        self.q_compared += chain

    def to_json(self, steps: int | None = None, timed: bool = True) -> dict:
        """The counts and their means; with ``timed`` the mean ms of each phase per cycle, or per
        batched step with ``steps`` (the batch decoder runs every request's cycle in one step)."""
        n = max(self.cycles, 1)
        out = {"nodes": self.nodes, "cycles": self.cycles, "chain_tokens": self.chain_tokens,
               "accepted_tokens": self.accepted_tokens, "q_agree": self.q_agree, "q_compared": self.q_compared,
               "mean_commit_chain": self.chain_tokens / n if self.cycles else 0.0,
               "accepted_per_exact_pass": self.accepted_tokens / n if self.cycles else 0.0,
               "q_top1_agreement": self.q_agree / self.q_compared if self.q_compared else None}
        if timed:
            per = max(steps if steps is not None else self.cycles, 1)
            out["time_ms"] = {k: 1e3 * v / per for k, v in self.seconds.items()}
            out["cycle_ms"] = sum(out["time_ms"].values())
        if steps is not None:
            out["steps"] = steps
        return out


def run_totals(results: list[dict], batch: dict | None = None) -> dict:
    """TLV's statistics over a run's requests (``results``: each with its ``tlv``): the batch
    decoder's totals where it ran them (its phases per batched step), else every request's cycles
    summed (their phases per cycle)."""
    if batch and batch.get("tlv"):
        return dict(batch["tlv"])
    cycled = [r["tlv"] for r in results if "tlv" in r]
    total = TLVStats(cycled[0]["nodes"])
    for t in cycled:
        total.add(TLVStats.from_json(t))
    return total.to_json()


class QRunner(GraphRunner):
    """The Q pass's CUDA graphs, one per row bucket: captured with the 8-bit view active, so their
    replays run the W12 QPASS kernels or the FP8 GEMMs (the exact pass replays the decoder's own
    runner)."""

    def __init__(self, model: Transformer, qview: QView, warmup: int = 2):
        super().__init__(model, warmup)
        self.qview = qview

    def _capture(self, T: int):
        with self.qview.active():
            return super()._capture(T)


def cuda_refusal(model: Transformer, qview: QView, nodes: int) -> str | None:
    """Why TLV cannot run on this CUDA model (None when it can): its Q pass reads the W12 packs
    through the fused rows path, so the model must take that path for the Q pass's rows."""
    from specpilot.engine import fused_verify
    from specpilot.engine.fused_decode import ineligible

    if qview.kind == "fp8" and not qview.fp8:
        return ("qview=fp8: no projection has both sides a multiple of 16, which cuBLASLt's FP8 GEMM needs; "
                "use qview=w12")
    if not qview.packs and not qview.fp8:
        return "the Q pass's view on CUDA is the W12 kernel packs or the e4m3 copies (QView.build_packs, build_fp8)"
    if not model.fused_decode:
        why = ineligible(model)
        return "the Q pass runs through the fused verify kernels: use decode=fused" + (f" ({why})" if why else "")
    if 1 + nodes > fused_verify.MAX_ROWS and not model.spec.is_hybrid:   # the verify graphs' largest bucket
        return (f"nodes={nodes}: the Q pass's {1 + nodes} rows exceed a verify step's {fused_verify.MAX_ROWS}; "
                f"use nodes <= {fused_verify.MAX_ROWS - 1}")
    return None


class TLVDecoder(Decoder):
    """The decode loop (:class:`~specpilot.engine.decode.Decoder`) with TLV cycles as its steps.

    On CUDA both passes go through the fused rows path, padded to a row bucket of at least two
    rows (a one-row step is the AR step, which advances GDN state); with a ``runner`` the exact
    pass replays its graphs and the Q pass those of a :class:`QRunner`."""

    def __init__(self, model: Transformer, drafter, qview: QView, *, nodes: int = 32, depth: int = 8, topk: int = 8,
                 eos_ids=(), runner: GraphRunner | None = None):
        super().__init__(model, "tlv", drafter, nodes=nodes, depth=depth, topk=topk, eos_ids=eos_ids, runner=runner)
        self.qview = qview
        self.stats = TLVStats(nodes)
        self._last: dict | None = None
        self.cuda = model.device.type == "cuda"
        if self.cuda:
            why = cuda_refusal(model, qview, nodes)
            if why:
                raise InputError(f"mode=tlv on cuda: {why}")
        self.qrunner = QRunner(model, qview) if runner is not None else None
        self.q_buckets = row_buckets(1 + nodes, least=2)

    def warm_up(self) -> float:
        t0 = time.perf_counter()
        if self.qrunner is not None:
            for b in self.q_buckets:
                self.qrunner.get(b)
        return time.perf_counter() - t0 + super().warm_up()

    def _generate(self, *a, **kw):
        self.stats = TLVStats(self.nodes)
        return super()._generate(*a, **kw)

    def request_summary(self) -> dict:
        return self.stats.to_json()

    @torch.no_grad()
    def q_pass(self, pending: int, tree, n_cache: int) -> list[int]:
        """The Q pass: the argmax after the pending token and after every node of ``tree`` under
        the 8-bit view, leaving the committed KV cache and the recurrent state as they were. On the
        CPU the rows' KV slots are restored too (:func:`scratch`); on CUDA they are left written:
        they lie past the committed prefix, where the exact pass writes each of its rows' K/V
        before any row reads it, so restoring them would only cost launches."""
        if not self.cuda:
            with self.qview.active(), scratch(self.model, n_cache, 1 + len(tree)):
                return self._eager_verify(pending, tree, n_cache, "tlv", keep_state=True)
        T = 1 + len(tree)
        inputs = self.padded_rows(pending, tree, n_cache, next(b for b in self.q_buckets if b >= T))
        if self._times is not None:   # the cycle's GPU time is both passes' (step): the Q pass is no outside time
            self._q_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._q_events[0].record()
        if self.qrunner is not None:
            out = self.qrunner.run(*inputs)
        else:
            tokens, pos, slots, mask, paths = (None if t is None else t.to(self.model.device, non_blocking=True)
                                               for t in inputs)
            with self.qview.active():
                out = self.model.greedy(StepInput(tokens, pos, slots, mask, "tree" if paths is not None else "seq",
                                                  paths))
        if self._times is not None:
            self._q_events[1].record()
        for g in self.model.gdn_layers():
            g._stash = None   # the pass is never committed
        return out[:T].tolist()

    @torch.no_grad()
    def step(self, context: list[int], n_cache: int, mode: str, room: int | None = None):
        if mode != "tlv":
            return super().step(context, n_cache, mode, room)
        pending, st = context[-1], self.stats
        t0 = time.perf_counter()
        lat = self.drafter.propose(context, n_cache, self.depth, self.topk)
        tree1 = treelib.build_best_first(lat.tokens, lat.logprobs, lat.transitions, self.nodes)
        t1 = time.perf_counter()
        self._q_events = None
        qpreds = self.q_pass(pending, tree1, n_cache)
        q_events = self._q_events
        qpath, chain = treelib.accept_predictions(tree1, qpreds)
        t2 = time.perf_counter()
        lat2 = self.drafter.propose_after(context, chain, n_cache, self.depth, self.topk)
        sub = treelib.truncate(treelib.build_best_first(lat2.tokens, lat2.logprobs, lat2.transitions, self.nodes),
                               self.nodes - len(chain))
        if room is not None:   # C is verified whole (its counts compare every node of it)
            sub = treelib.within_depth(sub, room - 1 - len(chain))
        tree = treelib.attach(chain, sub)
        t3 = time.perf_counter()
        preds = self.verify_predictions(pending, tree, n_cache, "tlv")
        t4 = time.perf_counter()
        if self._times is not None and q_events is not None:
            self._times[-1] += q_events
        _, toks = self.accept_commit(tree, preds, n_cache, "tlv")
        t5 = time.perf_counter()
        # C's node i is node i of the exact tree; the Q pass predicted after it at its path node
        st.count(len(chain), len(toks), q_agreement(qpreds, qpath, preds))
        for k, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
            st.seconds[k] += b - a
        self._draft_ms, self._qpass_ms = ((t1 - t0) + (t3 - t2)) * 1e3, (t2 - t1) * 1e3
        self._last = {"q_argmax": [int(x) for x in qpreds], "commit": [int(x) for x in chain], "draft2": lat2}
        return toks, lat, tree

    def lattice_row(self, request, step: int, lat: Lattice, at: int) -> dict:
        """The tree row plus what replaying the cycle needs (``tlv``): the budget, the Q pass's
        argmax at the root and every node of the draft-1 tree, C, and the draft-2 lattice."""
        row = super().lattice_row(request, step, lat, at)
        last = self._last
        row.update(cycle_record(self.nodes, last["q_argmax"], last["commit"], last["draft2"], lat))
        return row
