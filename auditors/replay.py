"""Exact tau replay: how many tokens each draft-tree policy would accept on recorded lattices.

A lattice file (JSONL, ``specpilot.lattice/1``, one row per verification step) records what the
drafter proposed and what the target finally committed. Because greedy verification is exact,
replaying a policy over those rows gives the tau the policy would have had, with no GPU.

A row the engine recorded in TLV mode also carries ``"tlv"``: the budget N, the Q pass's argmax at
the root and every node of the draft-1 tree, the commit chain C and the second draft's lattice
(from the end of C), which is what ``tlv:N`` needs to replay the cycle (:class:`TLVRecord`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specpilot.errors import InputError
from specpilot.fileio import iter_jsonl_numbered, require_file
from specpilot.limits import MAX_TOKEN_ID

from .policies import MAX_NODES, Policy, StepView, parse_policy
from .resample import bootstrap_mean_ci

LATTICE_KIND = "lattice"
REPLAY_SCHEMA = "specpilot.replay/1"
MAX_TRANSITION_SCORES = 1 << 26  # (m-1) x K x K of one step, padded
_KEYS = ("request", "step", "tokens", "logprobs", "transitions", "target")


@dataclass
class LatticeStep(StepView):
    request: object = None
    step: int = 0
    tlv: "TLVRecord | None" = None
    remaining: int | None = None  # tokens the request could still deliver (its limit or EOS); caps tau
    batch_step: int | None = None  # the batch decoder's step that verified it (the requests verified together)
    source: str | None = None  # "file:line" of its row, for a policy's error about it


@dataclass
class TLVRecord:
    """A TLV cycle as the engine ran it: budget, Q-pass argmax per row of the draft-1 tree (root
    first), commit chain, and the draft-2 lattice (``StepView`` with the row's target)."""

    nodes: int
    q_argmax: list[int]
    commit: list[int]
    draft2: StepView


@dataclass
class Lattice:
    path: str
    steps: list[LatticeStep]

    @property
    def requests(self) -> list:
        seen = {}
        for s in self.steps:
            seen.setdefault(_req_key(s.request), None)
        return list(seen)

    @property
    def m(self) -> int:
        return max(s.m for s in self.steps)

    @property
    def k(self) -> int:
        return max(s.k for s in self.steps)

    @property
    def has_transitions(self) -> bool:
        return any(s.transitions is not None for s in self.steps)


def _req_key(r):
    return r if isinstance(r, (int, str)) else str(r)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rows(v, where: str, name: str) -> list[list]:
    if not isinstance(v, list) or not all(isinstance(r, list) for r in v):
        raise InputError(f"{where}: \"{name}\" must be a list of lists ([m][K])")
    return v


def _ints(v, name, where):
    if any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise InputError(f"{where}: \"{name}\" must hold integer token ids")
    if any(x > MAX_TOKEN_ID for x in v):
        raise InputError(f"{where}: \"{name}\" holds a token id above {MAX_TOKEN_ID} (token ids are 0..{MAX_TOKEN_ID})")


def parse_row(row: dict, where: str) -> LatticeStep:
    """Validate one ``specpilot.lattice/1`` row (``where`` = ``file:line``) into a LatticeStep.

    Rows may be ragged (position i has K_i <= K candidates) and a step may have no draft at all
    (``"tokens": []``, tau 1). Ragged rows are padded to the step's K with token -1 and score
    -inf, which no policy ever expands or accepts.
    """
    missing = [k for k in _KEYS if k not in row]
    if missing:
        raise InputError(f"{where}: missing {', '.join(repr(k) for k in missing)} (lattice rows need "
                         f"{', '.join(_KEYS)})")
    step = row["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputError(f"{where}: \"step\" must be a non-negative integer")
    req = row["request"]
    if not isinstance(req, (int, str)) or isinstance(req, bool):
        raise InputError(f"{where}: \"request\" must be an integer or a string")
    raw_tokens = _rows(row["tokens"], where, "tokens")
    raw_lp = _rows(row["logprobs"], where, "logprobs")
    m = len(raw_tokens)
    if len(raw_lp) != m:
        raise InputError(f"{where}: \"logprobs\" has {len(raw_lp)} positions, \"tokens\" has {m}")
    widths = [len(r) for r in raw_tokens]
    k = max(widths, default=0)
    tokens = np.full((m, k), -1, dtype=np.int64)
    logprobs = np.full((m, k), -np.inf)
    for i, (tr_, lr_) in enumerate(zip(raw_tokens, raw_lp)):
        if not tr_:
            raise InputError(f"{where}: \"tokens\"[{i}] is empty; a position needs at least one candidate")
        _ints(tr_, "tokens", where)
        if len(lr_) != len(tr_):
            raise InputError(f"{where}: \"logprobs\"[{i}] has {len(lr_)} scores for {len(tr_)} tokens")
        if not all(_num(x) for x in lr_):
            raise InputError(f"{where}: \"logprobs\"[{i}] must hold numbers")
        if len(set(tr_)) != len(tr_):
            raise InputError(f"{where}: \"tokens\"[{i}] repeats a token; candidates must be distinct")
        if any(t < 0 for t in tr_):
            raise InputError(f"{where}: \"tokens\"[{i}] holds a negative token id")
        tokens[i, :len(tr_)] = tr_
        logprobs[i, :len(lr_)] = lr_
    _check_scores(logprobs[~np.isneginf(logprobs)], where, "logprobs")
    for i, lr_ in enumerate(raw_lp):
        j = next((j for j in range(1, len(lr_)) if lr_[j] > lr_[j - 1]), None)
        if j is not None:
            raise InputError(f"{where}: \"logprobs\"[{i}] is not sorted by score (candidate {j} scores {lr_[j]:g}, "
                             f"above candidate {j - 1}'s {lr_[j - 1]:g}); a position's candidates are sorted best "
                             "first")
    trans = row["transitions"]
    if trans is not None:
        if not isinstance(trans, list) or len(trans) != max(m - 1, 0):
            raise InputError(f"{where}: \"transitions\" must be null or [m-1][K_i][K_i+1] "
                             f"(m-1 = {max(m - 1, 0)} entries)")
        if max(m - 1, 0) * k * k > MAX_TRANSITION_SCORES:
            raise InputError(f"{where}: \"transitions\" of {m - 1} x {k} x {k} scores is more than the "
                             f"{MAX_TRANSITION_SCORES} a step may have")
        t = np.full((max(m - 1, 0), k, k), -np.inf)
        for i, block in enumerate(trans):
            ok = (isinstance(block, list) and len(block) == widths[i]
                  and all(isinstance(r, list) and len(r) == widths[i + 1] and all(_num(x) for x in r) for r in block))
            if not ok:
                raise InputError(f"{where}: \"transitions\"[{i}] must be [{widths[i]}][{widths[i + 1]}] numbers "
                                 "(parent candidates x child candidates)")
            t[i, :widths[i], :widths[i + 1]] = block
        _check_scores(t[~np.isneginf(t)], where, "transitions")
        trans = t
    target = row["target"]
    if not isinstance(target, list):
        raise InputError(f"{where}: \"target\" must be a list of token ids")
    _ints(target, "target", where)
    if any(t < 0 for t in target):
        raise InputError(f"{where}: \"target\" holds a negative token id")
    if len(target) < m + 1:
        raise InputError(f"{where}: \"target\" has {len(target)} tokens, needs at least m+1 = {m + 1}")
    tlv = _parse_tlv(row["tlv"], row, where) if row.get("tlv") is not None else None
    remaining = row.get("remaining")
    if remaining is not None and (isinstance(remaining, bool) or not isinstance(remaining, int) or remaining < 1):
        raise InputError(f"{where}: \"remaining\" must be a positive integer (tokens the request could still "
                         f"deliver), got {remaining!r}")
    batch_step = row.get("batch_step")
    if batch_step is not None and (isinstance(batch_step, bool) or not isinstance(batch_step, int) or batch_step < 0):
        raise InputError(f"{where}: \"batch_step\" must be a whole number >= 0, got {batch_step!r}")
    return LatticeStep(tokens=tokens, logprobs=logprobs, transitions=trans,
                       target=np.array(target, dtype=np.int64), request=req, step=step, tlv=tlv,
                       remaining=remaining, batch_step=batch_step)


def _parse_tlv(rec, row: dict, where: str) -> TLVRecord:
    if not isinstance(rec, dict) or any(k not in rec for k in ("nodes", "q_argmax", "commit", "draft2")):
        raise InputError(f"{where}: \"tlv\" must be an object with nodes, q_argmax, commit and draft2")
    n = rec["nodes"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NODES:
        raise InputError(f"{where}: \"tlv\".nodes must be a whole number in 1..{MAX_NODES} (the engine's --nodes "
                         f"range), got {n!r}")
    for k in ("q_argmax", "commit"):
        if not isinstance(rec[k], list) or not rec[k]:
            raise InputError(f"{where}: \"tlv\".{k} must be a non-empty list of token ids")
        _ints(rec[k], f"tlv.{k}", where)
        if any(t < 0 for t in rec[k]):
            raise InputError(f"{where}: \"tlv\".{k} holds a negative token id")
    d2 = rec["draft2"]
    if not isinstance(d2, dict):
        raise InputError(f"{where}: \"tlv\".draft2 must be an object with tokens, logprobs and transitions")
    lat2 = parse_row({"request": row["request"], "step": row["step"], "tokens": d2.get("tokens"),
                      "logprobs": d2.get("logprobs"), "transitions": d2.get("transitions"),
                      "target": row["target"]}, f"{where} (tlv.draft2)")
    return TLVRecord(n, list(rec["q_argmax"]), list(rec["commit"]), lat2)


def _check_scores(a: np.ndarray, where: str, name: str) -> None:
    if np.isnan(a).any() or np.isposinf(a).any():
        raise InputError(f"{where}: \"{name}\" holds NaN or +inf")
    if (a > 1e-6).any():
        raise InputError(f"{where}: \"{name}\" holds positive values; scores are log-probabilities (<= 0)")


def read_lattice(path) -> Lattice:
    """Read and validate a lattice JSONL file; every error names ``file:line``."""
    steps = []
    p = Path(path)
    require_file(p)
    # the reader checks the schema of every row and reports file:line for JSON errors
    seen = {}
    for lineno, row in iter_jsonl_numbered(p, LATTICE_KIND):
        s = parse_row(row, f"{p}:{lineno}")
        s.source = f"{p}:{lineno}"
        key = (_req_key(s.request), s.step)
        if key in seen:
            raise InputError(f"{p}:{lineno}: request {s.request!r} step {s.step} appears twice (first at line "
                             f"{seen[key]})")
        seen[key] = lineno
        steps.append(s)
    if not steps:
        raise InputError(f"{p}: no lattice rows")
    return Lattice(str(p), steps)


# --------------------------------------------------------------------------------------------

@dataclass
class PolicyResult:
    policy: str
    nodes: int | None               # the budget N (chain: its positions, cut to m); None for oracle
    tau: float
    tau_ci: tuple[float, float]
    accepted_hist: list[int] = field(default_factory=list)  # steps by tau value 1..m+1
    built: float | None = None      # nodes the trees held, mean over steps (below N on a small lattice)
    rows: dict[int, int] | None = None  # steps by rows verified (1 + the tree's nodes), where sizes are known


@dataclass
class ReplayResult:
    lattice: str
    steps: int
    requests: int
    m: int
    k: int
    transitions: bool
    policies: list[PolicyResult]
    curves: dict[str, dict[str, float]] | None = None
    rank_accept: list[float] | None = None
    curve_rows: dict[str, dict[str, dict[str, int]]] | None = None   # per curve point: {rows verified: steps}

    def to_json(self) -> dict:
        d = {"schema": REPLAY_SCHEMA, "lattice": self.lattice, "steps": self.steps,
             "requests": self.requests, "positions": self.m, "candidates": self.k,
             "transitions": self.transitions,
             "policies": [{"policy": p.policy, "nodes": p.nodes, "nodes_built": p.built, "tau": p.tau,
                           "tau_ci": list(p.tau_ci), "tau_hist": p.accepted_hist} for p in self.policies]}
        if self.curves is not None:
            d["curves"] = self.curves
        if self.curve_rows:
            d["curve_rows"] = self.curve_rows
        if self.rank_accept is not None:
            d["sequoia_rank_acceptance"] = self.rank_accept
        return d


def policy_taus(policy: Policy, steps: Sequence[StepView]) -> np.ndarray:
    return np.array([policy.tau(s) for s in steps], dtype=np.float64)


def replay(lattice: Lattice, policies: Sequence[Policy | str], nodes: Sequence[int] | None = None,
           n_boot: int = 1000, seed: int = 0, calibration: Lattice | None = None,
           tick: Callable[[], None] | None = None) -> ReplayResult:
    """tau per policy (mean over steps, 95% CI resampling requests), and tau(N) curves."""
    pols = [parse_policy(p) if isinstance(p, str) else p for p in policies]
    if not pols:
        raise InputError("give at least one --policy")
    calib_steps = (calibration or lattice).steps
    for p in pols:
        if p.family == "sequoia" and lattice.m and not any(st.m for st in calib_steps):
            # acceptance by rank is 0/0 there: a shape from it would be made up
            raise InputError(f"sequoia: {(calibration or lattice).path} has no draft positions to measure acceptance "
                             "by rank from; calibrate on a lattice of a speculative run")
        p.calibrate(calib_steps, depth=lattice.m)   # the shape as deep as the drafts it is replayed on
    ids: dict = {}
    groups = np.array([ids.setdefault(_req_key(s.request), len(ids)) for s in lattice.steps])
    m = lattice.m

    # best-first trees are prefixes of one another (the heap pops the same nodes in the same order
    # whatever the budget), so one tree per step at the largest budget answers every budget
    bf_max = max([p.nodes for p in pols if p.family == "best-first"]
                 + ([max(nodes)] if nodes and any(p.family == "best-first" for p in pols) else []), default=0)
    bf_paths: list[list[int]] | None = None
    bf_sizes: list[int] = []

    def best_first_tau(s_idx: int, n: int) -> tuple[int, int]:
        """(tau, nodes) of the best-first tree of budget n: the first n nodes of the largest one."""
        nonlocal bf_paths
        if bf_paths is None:
            from specpilot.kernels.tree import accept_greedy

            from .policies import best_first_tree

            trees = [best_first_tree(st, bf_max) for st in lattice.steps]
            bf_paths = [accept_greedy(t, st.target)[0] for t, st in zip(trees, lattice.steps)]
            bf_sizes[:] = [len(t) for t in trees]
        path = bf_paths[s_idx]
        k = 0
        while k < len(path) and path[k] < n:
            k += 1
        return k + 1, min(n, bf_sizes[s_idx])

    # a batched run's rows say which requests its decoder verified together; other lattices are
    # taken as a static batch (the requests' steps of one index verify together)
    batches: dict[tuple, list[int]] = {}
    with_bs = sum(s.batch_step is not None for s in lattice.steps)
    if 0 < with_bs < len(lattice.steps) and any(p.family in ("shared", "adaptive") for p in pols):
        raise InputError(f"{lattice.path}: {with_bs} of {len(lattice.steps)} rows carry \"batch_step\" and the others "
                         "do not: a batch policy groups the first by the batched run's steps and the others by step "
                         "index, which mixes runs; replay each run's lattice on its own")
    for i, s in enumerate(lattice.steps):
        batches.setdefault((0, s.batch_step) if s.batch_step is not None else (1, s.step), []).append(i)

    def batch_taus(n: int, adaptive: bool) -> list[tuple[int, int]]:
        """Each batch (``batches``) shares n nodes per request (paper 4.4), built by the batch
        engine's own rules (``specpilot.engine.batch.rules``: each request's share at most
        ``SHARED_CAP`` x n nodes). ``adaptive`` (the engine's default ``block``): first each
        request's block of draft positions from its recent accepted lengths and its draft's
        confidence, and the positions past it cut. Per step: (tau, nodes of its request's tree)."""
        import torch

        from specpilot.engine.batch import rules
        from specpilot.engine.drafters import Lattice as DraftLattice
        from specpilot.kernels.tree import accept_greedy

        sizes = rules.block_sizes(m)
        recent: dict = collections.defaultdict(lambda: collections.deque(maxlen=rules.BLOCK_WINDOW))
        out = [(0, 0)] * len(lattice.steps)
        for key in sorted(batches):   # a request's blocks depend on its earlier steps
            idx = batches[key]
            sts = [lattice.steps[i] for i in idx]
            if len({_req_key(st.request) for st in sts}) < len(sts):   # a request is verified once a step
                raise InputError(f"{lattice.path}: a request has two rows at "
                                 f"{'batch_step' if key[0] == 0 else 'step'} {key[1]}; a batch policy needs one")
            lats = [DraftLattice(st.tokens.tolist(), st.logprobs.tolist(),
                                 None if st.transitions is None else st.transitions.tolist()) for st in sts]
            # padded to this batch's widest position, not the lattice's: one wide row elsewhere
            # must not make every batch [B, m-1, K, K]
            kb = max(max((len(r) for r in lat.tokens), default=1) for lat in lats)
            if any(lat.transitions for lat in lats) and len(sts) * max(m - 1, 0) * kb * kb > MAX_TRANSITION_SCORES:
                raise InputError(f"{lattice.path}: the batch at {'batch_step' if key[0] == 0 else 'step'} {key[1]} "
                                 f"({len(sts)} requests x {m - 1} x {kb} x {kb} transition scores, padded) is more "
                                 f"than the {MAX_TRANSITION_SCORES} a shared or adaptive policy packs")
            tok, lp, tr = rules.pack_lattices(lats, m, kb, "cpu")
            if adaptive and len(sizes) > 1:
                ring = torch.full((len(sts), rules.BLOCK_WINDOW), float("nan"))
                for j, st in enumerate(sts):
                    got = list(recent[_req_key(st.request)])
                    ring[j, :len(got)] = torch.tensor(got, dtype=ring.dtype)
                lp, tr = rules.cut_blocks(lp, tr, rules.choose_blocks(ring, rules.draft_confidence(lp), sizes))
            trees = rules.build_trees(tok, lp, tr, n, "shared", requests=len(sts))
            for j, (i, st) in enumerate(zip(idx, sts)):
                tree = trees.request(j)
                accepted = len(accept_greedy(tree, st.target)[0])
                recent[_req_key(st.request)].append(float(accepted))
                out[i] = (accepted + 1, len(tree))
        return out

    cap = np.array([s.remaining if s.remaining is not None else np.inf for s in lattice.steps], dtype=np.float64)

    def run(p: Policy) -> PolicyResult:
        taus, sizes = [], []
        shared = batch_taus(p.nodes, p.family == "adaptive") if p.family in ("shared", "adaptive") else None
        for i, s in enumerate(lattice.steps):
            if shared is not None:
                tau, size = shared[i]
            elif p.family == "best-first":
                tau, size = best_first_tau(i, p.nodes)
            else:
                tau, size = p.verify(s)
            taus.append(tau)
            sizes.append(size)
            if tick:
                tick()
        # a step delivers no more than its request had left (the run's token limit or EOS)
        t = np.minimum(np.array(taus, dtype=np.float64), cap)
        # a TLV cycle can accept past the lattice's m positions (C, then the second draft)
        hist = np.bincount(t.astype(int), minlength=m + 2)[1:max(m + 2, int(t.max()) + 1)].tolist()
        known = not any(x is None for x in sizes)
        built = float(np.mean(sizes)) if known else None
        rows = dict(sorted(collections.Counter(1 + int(x) for x in sizes).items())) if known else None
        return PolicyResult(p.spec, p.node_count(m), float(t.mean()),
                            bootstrap_mean_ci(t, groups, n_boot, seed), hist, built, rows)

    results = [run(p) for p in pols]
    curves = None
    curve_rows: dict[str, dict[str, dict[str, int]]] = {}
    if nodes:
        curves = {}
        for p, budgets in curve_budgets(pols, nodes, m):
            points = {str(n): run(p.with_nodes(n)) for n in budgets}
            if points:   # a family left with no budget has no curve
                curves[p.curve_key] = {n: r.tau for n, r in points.items()}
                if all(r.rows for r in points.values()):
                    curve_rows[p.curve_key] = {n: {str(k): v for k, v in r.rows.items()} for n, r in points.items()}
    rank = None
    if any(p.family == "sequoia" for p in pols):
        rank = [float(x) for x in next(p for p in pols if p.family == "sequoia").rank_accept]
    return ReplayResult(lattice.path, len(lattice.steps), len(lattice.requests), m, lattice.k,
                        lattice.has_transitions, results, curves, rank, curve_rows or None)


def default_policies(lattice: Lattice) -> list[str]:
    """chain, best-first:32, oracle:K; on a TLV recording also tlv:N, the only policy that replays
    what its exact passes accepted (the others score the draft-1 lattices: tau 1 where the first
    draft was empty, far below the run's own)."""
    n = tlv_budget(lattice)
    # a lattice without any draft (an AR run's, or a drafter that never matched) has no oracle
    return (["chain", "best-first:32"] + ([f"tlv:{n}"] if n else [])
            + ([f"oracle:{lattice.k}"] if lattice.k else []))


def tlv_budget(lattice: Lattice) -> int | None:
    """N of a TLV recording (every row a cycle at budget N), else None."""
    budgets = {s.tlv.nodes if s.tlv is not None else None for s in lattice.steps}
    return budgets.pop() if len(budgets) == 1 and None not in budgets else None


def tlv_hint(lattice: Lattice) -> str | None:
    """Why the default policies leave out tlv:N on a lattice some of whose rows are TLV cycles."""
    with_tlv = [s for s in lattice.steps if s.tlv is not None]
    if not with_tlv or tlv_budget(lattice):
        return None
    budgets = sorted({s.tlv.nodes for s in with_tlv})
    return (f"{len(with_tlv)} of {len(lattice.steps)} rows are TLV cycles (recorded at --nodes "
            f"{', '.join(map(str, budgets))}); tlv:N needs every row to be one at that N, so the default policies "
            "leave it out")


def transitions_share(lattice: Lattice) -> tuple[int, int]:
    """(rows with ``transitions``, rows that could have them): rows of 2 or more draft positions,
    where a parent exists to condition on (a row of no or one position has none either way)."""
    deep = [s for s in lattice.steps if s.m >= 2]
    return sum(s.transitions is not None for s in deep), len(deep)


def mix_warnings(lattice: Lattice, policies: Sequence[Policy] = ()) -> list[str]:
    """One line per sign that the file joins lattices of different runs: rows of 2+ positions with
    and without ``transitions`` (best-first then scores some steps parent-conditioned, the others
    marginal), rows with and without ``batch_step`` (a batched run's and another's; with a batch
    policy in ``policies`` that is replay's refusal, not a warning)."""
    out = []
    have, deep = transitions_share(lattice)
    if 0 < have < deep:
        out.append(f"{have} of {deep} rows of 2+ draft positions carry \"transitions\", {deep - have} do not: "
                   "their trees are scored parent-conditioned and marginal respectively (rows of different "
                   "drafters or runs in one file?)")
    with_bs = sum(s.batch_step is not None for s in lattice.steps)
    if 0 < with_bs < len(lattice.steps) and not any(p.family in ("shared", "adaptive") for p in policies):
        out.append(f"{with_bs} of {len(lattice.steps)} rows carry \"batch_step\" (a batched run's), the others do "
                   "not (rows of different runs in one file?); shared:N and adaptive:N refuse such a file")
    return out


def parse_nodes(text: str | None) -> list[int] | None:
    """``--nodes``: node budgets as ``--rows`` takes row counts (a series such as ``8,16,24,...,64``
    included), sorted."""
    if text is None:
        return None
    from specpilot.options import parse_int_list

    return sorted(parse_int_list(text, "--nodes", 1, MAX_NODES))


def curve_budgets(policies: Sequence[Policy], nodes: Sequence[int] | None, m: int) -> list[tuple[Policy, list[int]]]:
    """The tau(N) curves :func:`replay` computes: the first policy of each family with a curve, and
    the budgets of ``nodes`` it replays (a chain cannot use more nodes than the m draft positions)."""
    out, seen = [], set()
    for p in policies:
        key = p.curve_key
        if key is None or key in seen or not nodes:
            continue
        seen.add(key)
        out.append((p, [n for n in nodes if not (p.family == "chain" and n > m)]))
    return out


def total_work(lattice: Lattice, policies: Sequence[Policy], nodes: Sequence[int] | None) -> int:
    """Steps :func:`replay` goes through (its ``tick`` calls): every policy's, then every curve point's."""
    points = sum(len(b) for _, b in curve_budgets(policies, nodes, lattice.m))
    return len(lattice.steps) * (len(policies) + points)



def synthetic_rows(requests: int = 4, steps: int = 10, m: int = 8, k: int = 8, transitions: bool = False,
                   seed: int = 0, hit: float = 0.8, rank_p: float = 0.5) -> list[dict]:
    """Random ``specpilot.lattice/1`` rows for tests and demos (not measurements).

    At each position the target's token is, with probability ``hit``, the candidate of geometric
    rank (parameter ``rank_p``) under the drafter's ordering, otherwise a token outside the lattice.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(requests):
        for st in range(steps):
            toks = np.stack([rng.choice(50000, size=k, replace=False) for _ in range(m)])
            lp = np.sort(np.log(rng.dirichlet(np.full(k, 0.5), size=m) + 1e-30), axis=1)[:, ::-1]
            tr = np.log(rng.dirichlet(np.full(k, 0.5), size=(m - 1, k)) + 1e-30) if transitions else None
            target = []
            for d in range(m + 1):
                if d < m and rng.random() < hit:
                    j = min(int(rng.geometric(rank_p)) - 1, k - 1)
                    target.append(int(toks[d, j]))
                else:
                    target.append(int(rng.integers(50000, 60000)))
            rows.append({"schema": "specpilot.lattice/1", "request": r, "step": st, "tokens": toks.tolist(),
                         "logprobs": lp.tolist(), "transitions": None if tr is None else tr.tolist(),
                         "target": target})
    return rows
