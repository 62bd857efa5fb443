"""lattice-trace: rows recorded through the hooks from SGLang 0.5.23's own scoring function.

``_score_edges`` (what ``CandidateSelector.build_lattice`` returns) and ``_commit_accept`` (what
``_accept_block`` commits) are compiled from the installed wheel and run on CPU; the hooks see the
same call shapes the DFLASH worker makes, and ``specpilot replay`` reads what they wrote.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specpilot.bundles import lattice_trace as lt
from sglang_support import SKIP_REASON, load_sglang_function, sglang_dir

SGL = sglang_dir()
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def sgl():
    if SGL is None:
        pytest.skip(SKIP_REASON)
    ns = {"torch": torch}
    return {"score_edges": load_sglang_function(SGL, "sglang.srt.models.dflash", "_score_edges", ns),
            "commit_accept": load_sglang_function(SGL, "sglang.srt.speculative.dflash_worker_v2", "_commit_accept", ns)}


class _Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend


def _greedy_walk(scores):
    """Stock DFlash2 greedy path over the lattice (what CandidateSelector.sample_path does with
    greedy_mask): argmax of the first edge, then argmax given the chosen predecessor."""
    b, m, k, _ = scores.shape
    idx = scores[:, 0, 0].argmax(-1)
    path = [idx]
    for e in range(1, m):
        idx = scores[torch.arange(b), e, idx].argmax(-1)
        path.append(idx)
    return torch.stack(path, 1)


def _simulate(sgl, steps=6, bs=2, m=4, k=3, vocab=64, rank=4, seed=0):
    """Drive the three hooks the way DFlashWorkerV2.forward_batch_generation does."""
    gen = torch.Generator().manual_seed(seed)
    pred_table, succ_table = torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen)
    streams = [torch.randint(0, vocab, (400,), generator=gen).tolist() for _ in range(bs)]
    pos = [0] * bs
    accepted = []
    worker = SimpleNamespace(_target_tp_rank=0)
    for _ in range(steps):
        cand = torch.zeros(bs, m, k, dtype=torch.long)
        unary = torch.zeros(bs, m, k)
        for b in range(bs):
            for e in range(m):
                want = streams[b][pos[b] + 1 + e]
                others = [t for t in torch.randperm(vocab, generator=gen).tolist() if t != want][: k]
                row = others[:k]
                if torch.rand(1, generator=gen).item() < 0.8:
                    row[int(torch.randint(0, k, (1,), generator=gen))] = want
                vals = torch.sort(torch.randn(k, generator=gen) * 3, descending=True).values
                cand[b, e], unary[b, e] = torch.tensor(row), vals
        anchors = torch.tensor([streams[b][pos[b]] for b in range(bs)])
        hidden = torch.randn(bs, m, rank, generator=gen)

        def forward(self, batch):
            scores = sgl["score_edges"](predecessor_table=pred_table, successor_table=succ_table, candidate_ids=cand,
                                        unary_logits=unary, hidden=hidden, anchor_token_ids=anchors, top_k=k)
            assert lt.after_build_lattice(scores, None, candidate_ids=cand, unary_logits=unary,
                                          hidden_states=hidden, anchor_token_ids=anchors) is None
            path = _greedy_walk(scores)
            drafted = cand.gather(-1, path[..., None])[..., 0]
            candidates = torch.cat([anchors[:, None], drafted], 1)                # [bs, m+1]
            accept = torch.zeros(bs, dtype=torch.long)
            bonus = torch.zeros(bs, dtype=torch.long)
            for b in range(bs):
                t = streams[b][pos[b] + 1: pos[b] + 2 + m]
                a = 0
                while a < m and int(drafted[b, a]) == t[a]:
                    a += 1
                accept[b], bonus[b] = a, t[a]
            out_tokens, commit_lens = sgl["commit_accept"](candidates, accept, bonus)
            result = (accept, commit_lens, bonus, out_tokens, None)
            assert lt.after_accept_block(result, self, candidates=candidates) is None
            for b in range(bs):
                pos[b] += int(commit_lens[b])
            accepted.append(accept.tolist())
            return "stock result"

        batch = SimpleNamespace(forward_mode=_Mode(False), reqs=[SimpleNamespace(rid=f"r{b}") for b in range(bs)],
                                sampling_info=SimpleNamespace(is_all_greedy=True))
        assert lt.around_forward_batch_generation(forward, worker, batch) == "stock result"
    return streams, accepted


@pytest.fixture
def rows(monkeypatch):
    out = []
    monkeypatch.setattr(lt, "_recorder", lt.LatticeRecorder(out.append))
    return out


def test_rows_follow_the_lattice_contract(sgl, rows):
    m, k = 4, 3
    streams, accepted = _simulate(sgl, m=m, k=k)
    assert rows, "no row was written"
    for row in rows:
        assert row["schema"] == "specpilot.lattice/1"
        assert len(row["tokens"]) == m and all(len(t) == k for t in row["tokens"])
        assert len(row["transitions"]) == m - 1 and len(row["transitions"][0]) == k
        for lp in row["logprobs"]:
            assert abs(sum(torch.tensor(lp).exp().tolist()) - 1) < 1e-5
        assert len(row["target"]) == m + 1
    # the target is the stream's greedy continuation after the step's anchor
    by_req = {}
    for row in rows:
        by_req.setdefault(row["request"], []).append(row)
    for rid, rs in by_req.items():
        stream = streams[int(rid[1:])]
        start = 0
        for row in sorted(rs, key=lambda r: r["step"]):
            assert row["target"] == stream[start + 1: start + 2 + m]
            start += accepted[row["step"]][int(rid[1:])] + 1


def test_recorded_transitions_reproduce_stock_acceptance(sgl, rows):
    """Walking the recorded transitions greedily gives the path stock verified: same accept length."""
    _, accepted = _simulate(sgl, seed=1)
    for row in rows:
        t = torch.tensor(row["transitions"])
        lp = torch.tensor(row["logprobs"])
        idx = int(lp[0].argmax())
        path = [row["tokens"][0][idx]]
        for e in range(1, len(row["tokens"])):
            idx = int(t[e - 1, idx].argmax())
            path.append(row["tokens"][e][idx])
        a = 0
        while a < len(path) and path[a] == row["target"][a]:
            a += 1
        assert a == accepted[row["step"]][int(row["request"][1:])]


def test_replay_reads_recorded_lattice(sgl, rows, run_cli, tmp_path):
    _simulate(sgl, steps=8)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("replay", path, "--policy", "chain", "--policy", "best-first:6", "--format", "json",
                             "--bootstrap", "100")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["steps"] == len(rows) and rep["requests"] == 2 and rep["transitions"] is True
    tau = {p["policy"]: p["tau"] for p in rep["policies"]}
    assert tau["best-first:6"] >= 1.0 and tau["chain"] >= 1.0
    # the requests of one decode call verified together: their rows share a batch_step, which the
    # batch policies group by
    calls = {}
    for r in rows:
        calls.setdefault(r["batch_step"], set()).add(r["request"])
    run = lt.recorder().run
    assert len(calls) > 1 and calls[run << 32] == {"r0", "r1"}   # (a request's last rows wait for their target)
    assert all(r["batch_step"] == run << 32 | r["step"] for r in rows)   # here every call decodes both requests
    code, out, err = run_cli("replay", path, "--policy", "shared:3", "--format", "json", "--bootstrap", "100")
    assert code == 0, err


def test_observer_skips_prefill_sampling_and_other_ranks(rows):
    calls = []

    def forward(self, batch):
        calls.append(1)
        assert lt._step.get() is None  # not observing
        return 7

    prefill = SimpleNamespace(forward_mode=_Mode(True), reqs=[])
    assert lt.around_forward_batch_generation(forward, SimpleNamespace(), prefill) == 7
    rank1 = SimpleNamespace(_target_tp_rank=1)
    decode = SimpleNamespace(forward_mode=_Mode(False), reqs=[SimpleNamespace(rid="x")])
    assert lt.around_forward_batch_generation(forward, rank1, decode) == 7
    assert len(calls) == 2 and rows == []


def test_recorder_drops_unfinished_steps_and_forgets_stale_requests():
    out = []
    rec = lt.LatticeRecorder(out.append, run=3)
    tok, lp = [[1, 2], [3, 4]], [[-0.1, -2.0], [-0.2, -1.0]]
    rec.observe("a", tok, lp, None, [5])       # needs 3 target tokens: pending
    rec.end_call()
    rec.observe("a", tok, lp, None, [6, 7])    # first row complete: [5, 6, 7]
    assert [r["target"] for r in out] == [[5, 6, 7]] and out[0]["batch_step"] == 3 << 32
    # two processes' files concatenated: their decode calls stay apart
    other = []
    rec2 = lt.LatticeRecorder(other.append)
    rec2.observe("b", tok, lp, None, [5])
    rec2.observe("b", tok, lp, None, [6, 7])
    assert other[0]["batch_step"] != out[0]["batch_step"] and other[0]["batch_step"] >> 32 == rec2.run
    for _ in range(lt.STALE_CALLS + 2):
        rec.end_call()
    assert rec.pending == {} and rec.dropped == 1
