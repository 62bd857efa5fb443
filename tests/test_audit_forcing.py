"""Token-forcing audit: statistics and verdict rules, the scorer, and the CLI on real files.

The model is a tiny random Llama saved to disk (a real Hugging Face folder); outputs come from
real greedy generation with it (batched / batch 1 / with a planted logit bias).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specpilot.auditors import forcing
from specpilot.auditors.forcing import Scored, audit, phase0, round_delta
from specpilot.auditors.outputs import OutputRow, Outputs, read_outputs, read_prompts, write_outputs
from specpilot.auditors.scorer import TokenScores

V = 96


# ----------------------------------------------------------------------------------------------
# hand-made scores: exact answers
def _scored(name, role, rows, margins, argmax=None):
    outs = Outputs(name, [OutputRow(f"p{i}", p, o) for i, (p, o) in enumerate(rows)], name)
    scores = []
    for i, (m, (_, o)) in enumerate(zip(margins, rows)):
        m = np.asarray(m, np.float32)
        am = np.asarray(o, np.int64) if argmax is None else np.asarray(argmax[i], np.int64)
        scores.append(TokenScores(am, m))
    return Scored(outs, role, scores)


def test_round_delta():
    assert round_delta(None) == 0.125
    assert round_delta(0.0) == 0.125
    assert round_delta(0.01) == 0.125
    assert round_delta(0.125) == 0.125
    assert round_delta(0.126) == 0.25
    assert round_delta(0.6) == 0.625
    assert round_delta(1.0) == 1.0


def test_phase0_uses_first_divergence_and_larger_margin():
    p = [1, 2]
    stock = _scored("stock", "stock", [(p, [5, 6, 7, 8]), (p, [5, 6]), (p, [9, 9])],
                    [[0, 0, 0.3, 2.0], [0, 0], [0, 0]])
    ar = _scored("ar", "ar", [(p, [5, 6, 4, 8]), (p, [5, 6, 7]), (p, [9, 9])],
                 [[0, 0, 0.1, 0], [0, 0, 0], [0, 0]])
    ph = phase0(stock, ar)
    # prompt 0 diverges at 2 (max(0.3, 0.1)); prompt 1 is a prefix (no divergent token); prompt 2 identical.
    # The later 2.0 margin is after the first divergence and does not count.
    assert ph.diverged == 1 and ph.prompts == 3
    assert ph.divergences[0].position == 2 and ph.divergences[0].stock_token == 7
    assert ph.max_margin == pytest.approx(0.3, rel=1e-6)
    assert ph.delta == 0.375


def test_phase0_never_diverges_gives_one_eighth():
    p = [1]
    stock = _scored("stock", "stock", [(p, [3, 4])], [[0, 0]])
    ar = _scored("ar", "ar", [(p, [3, 4])], [[0, 0]])
    assert phase0(stock, ar).delta == 0.125


def _rows(n_prompts, n_tok):
    return [([1, 2], list(range(10, 10 + n_tok))) for _ in range(n_prompts)]


def test_rule_mismatch_rate_increase():
    rows = _rows(10, 100)  # 1000 tokens
    stock = _scored("stock", "stock", rows, [[0.01] * 1 + [0] * 99 for _ in rows])  # 1.0%, all near ties
    ok = _scored("ok", "system", rows, [[0.01] * 1 + [0] * 99 for _ in rows[:5]] +
                 [[0.01] * 2 + [0] * 98 for _ in rows[5:]])  # 1.5%: +0.5 pp, not more -> pass
    bad = _scored("bad", "system", rows, [[0.01] * 2 + [0] * 98 for _ in rows])  # 2.0%: +1.0 pp -> reject
    res = audit([ok, bad], stock, delta=0.125, bootstrap=200)
    by = {s.name: s for s in res.systems}
    assert by["ok"].verdict == "pass"
    assert by["ok"].diff_vs_stock == pytest.approx(0.005)
    assert by["bad"].verdict == "reject" and "exceeds stock" in by["bad"].reasons[0]
    assert by["bad"].mismatch_rate == pytest.approx(0.02)
    assert by["bad"].events == 0 and by["bad"].margins.near_ties == 20
    assert res.verdict == "reject"
    lo, hi = by["stock"].mismatch_ci
    assert lo == pytest.approx(0.01) and hi == pytest.approx(0.01)  # every prompt has the same rate


def test_an_increase_of_exactly_the_limit_passes_whatever_the_counts():
    """3 -> 4 mismatches on 200 tokens is +0.5 pp exactly (0.005000000000000001 in floats): not
    more than the limit, as 0 -> 1 is not."""
    rows = _rows(10, 20)   # 200 tokens
    for st_n, sys_n in ((0, 1), (3, 4), (1, 2)):
        stock = _scored("stock", "stock", rows, [[0.01] + [0] * 19 if i < st_n else [0] * 20 for i in range(10)])
        sysm = _scored("s", "system", rows, [[0.01] + [0] * 19 if i < sys_n else [0] * 20 for i in range(10)])
        res = audit([sysm], stock, delta=100.0, bootstrap=200)
        assert res.systems[-1].verdict == "pass", (st_n, sys_n, res.systems[-1].reasons)


def test_rule_events_more_frequent_than_stock():
    rows = _rows(4, 50)
    stock = _scored("stock", "stock", rows, [[0.3] + [0] * 49] + [[0] * 50] * 3)  # one event at delta .125
    same = _scored("same", "system", rows, [[0] * 50] * 3 + [[0.3] + [0] * 49])
    more = _scored("more", "system", rows, [[0.3] + [0] * 49, [0.3] + [0] * 49] + [[0] * 50] * 2)
    res = audit([same, more], stock, delta=0.125, bootstrap=200)
    by = {s.name: s for s in res.systems}
    assert by["stock"].events == 1
    assert by["same"].verdict == "pass" and by["same"].events_allowed == 1
    assert by["more"].verdict == "reject" and any("events" in r for r in by["more"].reasons)
    # 2 mismatches in 200 vs 1: +0.5 pp, not more than 0.5 pp: only the event rule fires
    assert len(by["more"].reasons) == 1


def test_events_allowed_scales_with_tokens():
    stock = _scored("stock", "stock", _rows(2, 100), [[0.5] + [0] * 99, [0] * 100])
    # the system produced fewer tokens (stopped earlier): 1 event on 190 tokens vs stock's 1 on 200 -> allowed 1
    sys_ = _scored("s", "system", _rows(2, 95), [[0.5] + [0] * 94, [0] * 95])
    res = audit([sys_], stock, delta=0.125, bootstrap=200)
    assert res.systems[1].events_allowed == 1 and res.systems[1].verdict == "pass"


def test_unexplained_events_use_reference_prefix():
    p = [1]
    stock = _scored("stock", "stock", [(p, [5, 6, 7, 8])], [[0, 0, 0.9, 0]])
    ar = _scored("ar", "ar", [(p, [5, 6, 3, 8])], [[0, 0, 0, 0]])
    # system agrees with stock through position 2 (the event is stock's own choice) then has its own event
    sysm = _scored("sys", "system", [(p, [5, 6, 7, 9])], [[0, 0, 0.9, 0.7]])
    res = audit([sysm], stock, ar, bootstrap=200)
    by = {s.name: s for s in res.systems}
    # delta from phase 0: first divergence at 2, margin max(0.9, 0) -> 1.0; events need margin >= 2.0
    assert res.delta == 1.0
    assert by["sys"].events == 0
    res = audit([sysm], stock, ar, delta=0.25, bootstrap=200)
    by = {s.name: s for s in res.systems}
    assert by["sys"].events == 2 and by["sys"].unexplained_events == 1  # position 2 explained by stock
    assert by["stock"].events == 1 and by["stock"].unexplained_events == 1  # AR chose otherwise


def test_audit_requires_same_prompts():
    from specpilot.errors import InputError

    stock = _scored("stock", "stock", [([1], [3])], [[0]])
    other = Scored(Outputs("x", [OutputRow("zz", [1], [3])]), "system", [TokenScores(np.array([3]), np.zeros(1))])
    with pytest.raises(InputError, match="same prompts"):
        audit([other], stock, delta=0.125, bootstrap=200)
    diffp = Scored(Outputs("y", [OutputRow("p0", [2], [3])]), "system", [TokenScores(np.array([3]), np.zeros(1))])
    with pytest.raises(InputError, match="prompt_ids differ"):
        audit([diffp], stock, delta=0.125, bootstrap=200)


def test_bootstrap_resamples_prompts_not_tokens():
    # mismatches concentrated in one prompt of ten: a token-level interval would be far too narrow
    rows = _rows(10, 100)
    margins = [[0.01] * 30 + [0] * 70] + [[0] * 100] * 9
    s = _scored("stock", "stock", rows, margins)
    res = audit([], s, delta=0.125, bootstrap=2000, seed=1)
    lo, hi = res.systems[0].mismatch_ci
    assert res.systems[0].mismatch_rate == pytest.approx(0.03)
    token_half = 1.96 * math.sqrt(0.03 * 0.97 / 1000)  # ~1.06 pp
    assert lo == 0.0 and (hi - 0.03) > 2 * token_half


# ----------------------------------------------------------------------------------------------
# the scorer on a real (tiny, random) Hugging Face model
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpilot.auditors.selftest import greedy

    d = tmp_path_factory.mktemp("audit_tiny")
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(d / "model"))
    from specpilot.auditors.scorer import Scorer

    scorer = Scorer.load(str(d / "model"), device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    bias = torch.zeros(V)
    bias[torch.randperm(V, generator=g)[:10]] = 2.0
    gens = {"ar": greedy(scorer.model, prompts, 10, batch_size=2),
            "stock": greedy(scorer.model, prompts, 10, batch_size=8),
            "batch4": greedy(scorer.model, prompts, 10, batch_size=4),
            "biased": greedy(scorer.model, prompts, 10, batch_size=8, bias=bias)}
    files = {}
    for name, outs in gens.items():
        files[name] = d / f"{name}.jsonl"
        write_outputs(files[name], [OutputRow(f"q{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outs))])
    return {"dir": d, "model": str(d / "model"), "scorer": scorer, "prompts": prompts, "files": files}


def test_scorer_matches_unbatched_reference(tiny):
    import torch

    scorer, prompts = tiny["scorer"], tiny["prompts"]
    outs = read_outputs(tiny["files"]["biased"])
    seqs = [(r.prompt_ids, r.output_ids) for r in outs.rows]
    got = scorer.score(seqs, batch_tokens=40, head_chunk=7)  # several batches, several head chunks
    model = scorer.model
    for (p, o), sc in zip(seqs, got):
        with torch.no_grad():
            logits = model(torch.tensor([p + o])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(p) - 1: len(p) - 1 + len(o)]
        ref_am = lp.argmax(-1)
        ref_margin = lp.max(-1).values - lp.gather(1, torch.tensor(o)[:, None])[:, 0]
        np.testing.assert_allclose(sc.margin, ref_margin.numpy(), atol=2e-4)
        top2 = lp.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]).numpy() > 1e-3  # not a near tie: the argmax is unambiguous
        assert (sc.argmax == ref_am.numpy())[clear].all()
        assert (sc.argmax[sc.margin == 0] == np.asarray(o)[sc.margin == 0]).all()
    assert sum(int((s.margin > 0).sum()) for s in got) > 0  # the bias made real mismatches


def test_scorer_lm_head_is_fp32_on_half_hidden_states(tiny):
    import torch

    from specpilot.auditors.scorer import Scorer

    s16 = Scorer.load(tiny["model"], device="cpu", dtype="bfloat16")
    assert s16.info.dtype == "bfloat16" and s16.info.lm_head == "float32"
    h = torch.randn(3, 32, dtype=torch.bfloat16)
    out = s16.lm_head_fp32(h)
    assert out.dtype == torch.float32
    ref = h.float() @ s16.model.get_output_embeddings().weight.float().T
    torch.testing.assert_close(out, ref)


def test_scorer_rejects_a_sequence_past_its_positions(tiny):
    """A sequence longer than max_position_embeddings (256 here) is refused: scores past the positions
    the model was made for said 100% mismatches and passed."""
    from specpilot.errors import InputError

    with pytest.raises(InputError,
                       match=r"sequence 1: 250 prompt \+ 10 output tokens exceed the scorer's 256 positions"):
        tiny["scorer"].score([([5, 6], [7]), ([5] * 250, [7] * 10)])
    assert len(tiny["scorer"].score([([5] * 250, [7] * 6)])[0].argmax) == 6


def test_scorer_rejects_tokens_outside_vocab(tiny):
    from specpilot.errors import InputError

    with pytest.raises(InputError, match="outside the scorer's vocabulary"):
        tiny["scorer"].score([([1, 2], [V + 5])])


def test_audit_library_on_real_generation(tiny):
    scorer = tiny["scorer"]
    sc = {n: forcing.score_outputs(scorer, read_outputs(f, name=n), "stock" if n == "stock" else
                                   "ar" if n == "ar" else "system") for n, f in tiny["files"].items()}
    res = audit([sc["batch4"], sc["biased"]], sc["stock"], sc["ar"], bootstrap=300)
    by = {s.name: s for s in res.systems}
    assert by["batch4"].verdict == "pass"
    assert by["biased"].verdict == "reject" and by["biased"].mismatch_rate > 0.05
    assert by["stock"].mismatches == 0  # greedy stock tokens are the scorer's argmax (same model, fp32)


# ----------------------------------------------------------------------------------------------
# the CLI, on files
def test_cli_pass_and_reject(run_cli, tiny, tmp_path):
    f = tiny["files"]
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--ar", f["ar"], "--scorer",
                             tiny["model"], "--device", "cpu", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == "specpilot.audit/1" and data["verdict"] == "pass"
    assert data["delta"] >= 0.125 and data["delta"] * 8 == int(data["delta"] * 8)
    sysrow = [s for s in data["systems"] if s["role"] == "system"][0]
    assert {"mismatch_rate", "events", "unexplained_events", "mismatch_ci"} <= set(sysrow)

    report = tmp_path / "audit.json"
    code, out, err = run_cli("audit", "check", f["biased"], f["batch4"], "--against", f["stock"], "--scorer",
                             tiny["model"], "--device", "cpu", "--format", "json", "--out", report)
    assert code == 1, err
    data = json.loads(report.read_text())
    assert data["verdict"] == "reject"
    verdicts = {s["name"]: s["verdict"] for s in data["systems"]}
    assert verdicts == {"stock.jsonl": None, "biased.jsonl": "reject", "batch4.jsonl": "pass"}
    assert data["phase0"]["source"] == "default" and data["warnings"]

    code, out, err = run_cli("audit", f["biased"], "--against", f["stock"], "--scorer", tiny["model"],
                             "--device", "cpu")
    assert code == 1
    assert "REJECT biased.jsonl" in out and "verdict: REJECT" in out and "Mismatch margins" in out


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_bad_inputs(run_cli, tiny, tmp_path):
    f = tiny["files"]
    m = tiny["model"]
    bad_schema = _write(tmp_path / "bad.jsonl", [{"schema": "specpilot.lattice/1", "id": 1}])
    code, out, err = run_cli("audit", bad_schema, "--against", f["stock"], "--scorer", m)
    assert code == 2 and err.startswith("specpilot: error:") and "unknown schema" in err and len(err.splitlines()) == 1

    other = _write(tmp_path / "other.jsonl", [{"schema": "specpilot.outputs/1", "id": "zz", "prompt_ids": [1],
                                                "output_ids": [3]}])
    code, out, err = run_cli("audit", other, "--against", f["stock"], "--scorer", m)
    assert code == 2 and "same prompts" in err

    neg = _write(tmp_path / "neg.jsonl", [{"schema": "specpilot.outputs/1", "id": 0, "prompt_ids": [1],
                                            "output_ids": [-3]}])
    code, out, err = run_cli("audit", neg, "--against", f["stock"], "--scorer", m)
    assert code == 2 and "token ids in [0, 2147483647], found -3" in err

    big = _write(tmp_path / "big.jsonl", [{"schema": "specpilot.outputs/1", "id": r.id, "prompt_ids": r.prompt_ids,
                                            "output_ids": [V + 1]} for r in read_outputs(f["stock"]).rows])
    code, out, err = run_cli("audit", big, "--against", f["stock"], "--scorer", m, "--device", "cpu")
    assert code == 2 and "vocabulary" in err and f"{big}: prompt " in err, err   # the file and the prompt named

    # --prompts with files only: each file must answer them (else --prompts would mean nothing)
    ids = _write(tmp_path / "ids.jsonl", [{"schema": "specpilot.prompts/1", "id": "q0", "prompt_ids": [1, 2]}])
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--scorer", m, "--prompts", ids)
    assert code == 2 and "its prompts are not those of --prompts" in err, err
    # a stock that produced nothing gives no evidence: refused, not a pass
    nothing = _write(tmp_path / "nothing.jsonl", [{"schema": "specpilot.outputs/1", "id": r.id,
                                                   "prompt_ids": r.prompt_ids, "output_ids": []}
                                                  for r in read_outputs(f["stock"]).rows])
    code, out, err = run_cli("audit", f["batch4"], "--against", nothing, "--scorer", m, "--device", "cpu")
    assert code == 2 and "stock produced no tokens" in err, err
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--scorer", m, "--bootstrap", "0")
    assert code == 2 and "--bootstrap 0: must be >= 100" in err and "--batch-tokens" not in err, err
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--scorer", m, "--bootstrap", "10000000000")
    assert code == 2 and "--bootstrap 10000000000: at most 1000000" in err, err   # before scoring, not out of memory

    code, out, err = run_cli("audit", tmp_path / "missing.jsonl", "--against", f["stock"], "--scorer", m)
    assert code == 2 and "no such file" in err

    code, out, err = run_cli("audit", f["stock"], "--against", f["stock"], "--scorer", tmp_path)
    assert code == 2 and "config.json" in err

    code, out, err = run_cli("audit", "engine:model=tiny", "--against", f["stock"], "--scorer", m)
    assert code == 2 and "--prompts" in err
    # an engine: system's model is checked before any system runs
    code, out, err = run_cli("audit", "engine:model=x", "--against", f["stock"], "--scorer", m)
    assert code == 2 and "unknown model 'x'" in err and len(err.splitlines()) == 1

    # --out never overwrites an input, and a failed run leaves no output file
    before = f["stock"].read_text()
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--scorer", m, "--device", "cpu",
                             "--out", f["stock"])
    assert code == 2 and "refusing to overwrite" in err and f["stock"].read_text() == before
    target = tmp_path / "never.json"
    code, out, err = run_cli("audit", bad_schema, "--against", f["stock"], "--scorer", m, "--out", target)
    assert code == 2 and not target.exists()


def test_read_prompts_formats(tmp_path, tiny):
    from specpilot.errors import InputError

    p = _write(tmp_path / "p.jsonl", [{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2]},
                                      {"schema": "specpilot.prompts/1", "id": "b", "text": "hi"}])
    got = read_prompts(p, tokenize=lambda t: [7, 8, 9])
    assert [(x.id, x.prompt_ids) for x in got] == [("a", [1, 2]), ("b", [7, 8, 9])]
    with pytest.raises(InputError, match="tokenizer"):
        read_prompts(p)
    # an outputs file works as prompts
    assert len(read_prompts(tiny["files"]["stock"])) == 8
    dup = _write(tmp_path / "d.jsonl", [{"schema": "specpilot.prompts/1", "id": 1, "prompt_ids": [1]}] * 2)
    with pytest.raises(InputError, match="duplicate id"):
        read_prompts(dup)


def test_empty_or_short_outputs_cannot_sneak_through():
    stock = _scored("stock", "stock", _rows(3, 20), [[0] * 20] * 3)
    empty = _scored("empty", "system", _rows(3, 0), [[]] * 3)
    short = _scored("short", "system", _rows(3, 5), [[0] * 5] * 3)
    res = audit([empty, short], stock, delta=0.125, bootstrap=200)
    by = {s.name: s for s in res.systems}
    assert by["empty"].verdict == "reject" and "no tokens" in by["empty"].reasons[0]
    assert by["short"].verdict == "pass" and any("short" in w and "stops early" in w for w in res.warnings)
    # rows that record their limits: the warning says the systems were collected under different ones
    for sc, limit in ((stock, 20), (short, 5)):
        for r in sc.outputs.rows:
            r.max_new_tokens = limit
    res = audit([short], stock, delta=0.125, bootstrap=200)
    assert any("collected with --max-new-tokens 5, stock with 20" in w for w in res.warnings), res.warnings


def test_cli_other_formats(run_cli, tiny):
    import yaml

    f = tiny["files"]
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--ar", f["ar"], "--scorer", tiny["model"],
                             "--device", "cpu", "--format", "yaml")
    assert code == 0, err
    data = yaml.safe_load(out)
    assert data["schema"] == "specpilot.audit/1" and data["phase0"]["source"] == "phase0"
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--scorer", tiny["model"],
                             "--device", "cpu", "--format", "markdown")
    assert code == 0 and "## Systems" in out and "| batch4.jsonl" in out


@pytest.mark.parametrize("args, message", [
    (["--prompts", "0"], "'--n-prompts' / '--prompts': 0 is not in the range 1<=x<=64"),
    (["--n-prompts", "999"], "999 is not in the range 1<=x<=64"),
    (["--biases", "2,x"], "not a number"),
    (["--biases", "-1"], "positive"),
    (["--repeats", "50", "--prompts", "8"], "--repeats 50"),
    (["--repeats", "0"], "'--repeats': 0 is not in the range x>=1"),
])
def test_selftest_bad_options(run_cli, args, message):
    code, out, err = run_cli("audit", "selftest", *args)
    assert code == 2 and message in err and err.startswith("specpilot: error:")


@pytest.mark.gpu
def test_scorer_on_cuda_matches_cpu(tiny):
    """The scorer's CUDA path (batched, bf16 hidden states by default there, FP32 head): the same
    margins as the float32 CPU scorer up to bf16 rounding, and the same argmax away from near ties;
    the audit's verdicts on the tiny systems agree."""
    import torch

    from specpilot.auditors.scorer import Scorer

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    gpu = Scorer.load(tiny["model"], device="cuda")
    assert gpu.info.device.startswith("cuda") and gpu.info.lm_head == "float32"
    outs = read_outputs(tiny["files"]["biased"])
    seqs = [(r.prompt_ids, r.output_ids) for r in outs.rows]
    got = gpu.score(seqs, batch_tokens=40, head_chunk=7)
    ref = tiny["scorer"].score(seqs)
    same, total = 0, 0
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.margin, r.margin, atol=0.05 * max(1.0, float(np.abs(r.margin).max())))
        clear = r.margin > 0.1          # clear mismatches: bf16 hidden states may still flip a near tie
        same += int((g.argmax[clear] == r.argmax[clear]).sum())
        total += int(clear.sum())
    assert total > 0 and same >= 0.9 * total
    f32 = Scorer.load(tiny["model"], device="cuda", dtype="float32")
    for g, r in zip(f32.score(seqs), ref):
        np.testing.assert_allclose(g.margin, r.margin, atol=2e-3)


def test_collect_reads_text_prompts_with_the_engines_own_tokenizer(run_cli, tmp_path):
    p = _write(tmp_path / "t.jsonl", [{"schema": "specpilot.prompts/1", "id": "a", "text": "hello"}])
    code, out, err = run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", p, "--max-new-tokens", "3",
                             "--save", tmp_path / "s.jsonl")
    assert code == 0, err
    assert read_outputs(tmp_path / "s.jsonl").rows[0].prompt_ids == list(b"hello")


def test_collect_requires_prompts_and_its_help_says_so(run_cli, tmp_path):
    code, _, err = run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--save", tmp_path / "x.jsonl")
    assert code == 2 and err.startswith("specpilot: error:") and "'--prompts'" in err, err
    assert len(err.strip().splitlines()) == 1 and "loading model" not in err and not (tmp_path / "x.jsonl").exists()
    code, out, _ = run_cli("audit", "collect", "--help")
    prompts = out[out.index("--prompts"):out.index("--max-new-tokens")]
    assert code == 0 and "[required]" in prompts
    from specpilot.commands.audit import command

    check = command.commands["check"]   # optional there: outputs files need no prompts
    assert not next(p for p in check.params if p.name == "prompts_path").required


@pytest.mark.parametrize("args, words", [
    (["--delta", "-1"], "--delta"), (["--delta", "nan"], "--delta"), (["--max-increase", "nan"], "--max-increase"),
    (["--concurrency", "0"], "--concurrency")])
def test_audit_options_out_of_range_are_refused_before_anything_loads(run_cli, tiny, args, words):
    f = tiny["files"]
    code, out, err = run_cli("audit", f["batch4"], "--against", f["stock"], "--scorer", tiny["model"], *args)
    assert code == 2 and words in err and "loading scorer" not in err, err


def test_a_misspelt_subcommand_is_said_so(run_cli):
    code, _, err = run_cli("audit", "selftst")
    assert code == 2 and "No such command 'selftst'. Did you mean 'selftest'?" in err, err


def test_a_scorer_of_another_vocabulary_is_refused_before_it_scores(run_cli, tmp_path):
    """The scorer forces the systems' tokens: outputs a model of another vocabulary wrote and
    engines of another model are refused before it scores (such an audit passed on a 94% stock
    mismatch rate)."""
    p = _write(tmp_path / "p.jsonl", [{"schema": "specpilot.prompts/1", "id": "a", "text": "hello there"}])
    outs = {}
    for mode in ("ar", "tree"):
        outs[mode] = tmp_path / f"{mode}.jsonl"
        code, _, err = run_cli("audit", "collect", f"engine:model=tiny,mode={mode}", "--prompts", p,
                               "--max-new-tokens", "6", "--save", outs[mode])
        assert code == 0, err
    code, _, err = run_cli("audit", outs["tree"], "--against", outs["ar"], "--scorer", "smollm2")
    assert code == 2 and ("written by engine:model=tiny,mode=ar, whose vocabulary (256 tokens) is not that of "
                          "--scorer smollm2 (49152 tokens)") in err, err
    ids = _write(tmp_path / "ids.jsonl", [{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [104, 105]}])
    code, _, err = run_cli("audit", "engine:model=tiny,mode=tree", "--against", "engine:model=tiny,mode=ar",
                           "--scorer", "smollm2", "--prompts", ids)
    assert code == 2 and "engine:model=tiny,mode=ar: its vocabulary (256 tokens) is not that of --scorer" in err, err
    code, _, err = run_cli("audit", outs["tree"], "--against", outs["ar"], "--scorer", "tiny")
    assert code == 0, err


def test_a_stock_the_scorer_disagrees_with_is_refused_or_warned():
    """A scorer of another model (same vocabulary) disagreed with stock's greedy tokens at 98%: every
    system passed against it. Clear mismatches (events) at over half of stock's tokens: refused;
    over 5%: a warning. Near ties are numerics, at any rate (bf16 on random weights: 15%), and a
    few events on a few tokens say nothing."""
    rows = _rows(4, 50)
    for wrong, margin, verdict in ((30, 0.5, "refused"), (5, 0.5, "warned"), (45, 0.1, "quiet")):
        margins = [[margin] * wrong + [0] * (50 - wrong)] * 4   # the scorer's argmax is another token there
        stock = _scored("stock", "stock", rows, margins)
        sysm = _scored("s", "system", rows, margins)
        if verdict == "refused":
            with pytest.raises(forcing.InputError, match=r"at 60\.0% of its tokens \(120 of 200\): the scorer is not"):
                audit([sysm], stock, delta=0.125, bootstrap=50)
            continue
        res = audit([sysm], stock, delta=0.125, bootstrap=50)
        assert any("clear margin at 10.0%" in w for w in res.warnings) == (verdict == "warned"), res.warnings
    few = [[0.5, 0.5, 0.5, 0], [0.5, 0.5, 0.5, 0]]   # 6 events of 8 tokens: too few to tell
    stock = _scored("stock", "stock", _rows(2, 4), few)
    audit([_scored("s", "system", _rows(2, 4), few)], stock, delta=0.125, bootstrap=50)


def test_a_system_that_stops_a_token_before_stock_keeps_stocks_events():
    """Stock's 5 events on 192 tokens allow 5 on 191 (whole events, rounded up): an exact rate
    comparison rejected a lossless prefix of stock's own outputs."""
    margins = [[0.5] + [0] * 47] * 4 + [[0.5] + [0] * 47]   # 5 events over 5 prompts of 48 tokens: 240
    stock = _scored("stock", "stock", _rows(5, 48), margins)
    sys_ = _scored("s", "system", _rows(4, 48) + _rows(1, 47), margins[:4] + [[0.5] + [0] * 46])
    res = audit([sys_], stock, delta=0.125, bootstrap=50)
    assert res.systems[1].events == 5 and res.systems[1].events_allowed == 5 and res.systems[1].verdict == "pass"
