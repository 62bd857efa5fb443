"""``specpilot replay`` through the CLI: real files, JSON contract, curves, bad input."""

import json

import numpy as np
import pytest

from specpilot.auditors.replay import bootstrap_mean_ci, read_lattice, replay, synthetic_rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HAND = {"schema": "specpilot.lattice/1", "request": 0, "step": 0,
        "tokens": [[10, 11, 12], [20, 21, 22], [30, 31, 32]],
        "logprobs": np.log([[.6, .3, .1], [.55, .35, .1], [.7, .2, .1]]).tolist(),
        "transitions": None, "target": [11, 21, 30, 99]}


def test_hand_lattice_json(tmp_path, run_cli):
    rows = [dict(HAND, request=r, step=s) for r in range(2) for s in range(2)]
    lat = write(tmp_path / "l.jsonl", rows)
    code, out, err = run_cli("replay", lat, "--policy", "chain", "--policy", "best-first:11",
                             "--policy", "oracle:2", "--policy", "eagle2:2,3,10", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["schema"] == "specpilot.replay/1" and d["steps"] == 4 and d["requests"] == 2
    got = {p["policy"]: p["tau"] for p in d["policies"]}
    assert got == {"chain": 1.0, "best-first:11": 4.0, "oracle:2": 4.0, "eagle2:2,3,10": 3.0}
    bf = d["policies"][1]
    assert bf["nodes"] == 11 and bf["tau_ci"] == [4.0, 4.0]
    assert "curves" not in d


def test_curves_and_out_file(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=3, steps=5, m=6, k=4, seed=1))
    out = tmp_path / "r.json"
    code, _, err = run_cli("replay", lat, "--policy", "best-first:8", "--policy", "sequoia:8",
                           "--policy", "oracle:4", "--nodes", "16,4,8", "--out", out, "--format", "json")
    assert code == 0, err
    d = json.loads(out.read_text())
    assert set(d["curves"]) == {"best-first", "sequoia"}
    c = d["curves"]["best-first"]
    assert list(c) == ["4", "8", "16"] and c["4"] <= c["8"] <= c["16"]
    assert c["8"] == d["policies"][0]["tau"]
    assert all(p["tau_ci"][0] <= p["tau"] <= p["tau_ci"][1] for p in d["policies"])
    assert "sequoia_rank_acceptance" in d


def test_default_policies_table(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=3, m=4, k=4, transitions=True))
    code, out, _ = run_cli("replay", lat)
    assert code == 0
    assert "chain" in out and "best-first:32" in out and "oracle:4" in out and "parent-conditioned" in out


def test_gzip_input(tmp_path, run_cli):
    import gzip

    p = tmp_path / "l.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        for r in synthetic_rows(requests=2, steps=2, m=3, k=3):
            fh.write(json.dumps(r) + "\n")
    assert run_cli("replay", p, "--policy", "chain")[0] == 0


def bad(field, value):
    r = dict(HAND)
    if value is KeyError:
        del r[field]
    else:
        r[field] = value
    return r


@pytest.mark.parametrize("row,msg", [
    (bad("target", [11, 21, 30]), "needs at least m+1"),
    (bad("logprobs", [[0.5, -1, -2], [-1, -1, -1], [-1, -1, -1]]), "positive"),
    (bad("logprobs", [[-1, -1], [-1, -1], [-1, -1]]), "2 scores for 3 tokens"),
    (bad("tokens", [[1, 1, 2], [3, 4, 5], [6, 7, 8]]), "repeats"),
    (bad("tokens", [[1.5, 2, 3], [3, 4, 5], [6, 7, 8]]), "integer"),
    (bad("tokens", [[1, 2], [3, 4, 5], [6, 7, 8]]), "3 scores for 2 tokens"),
    (bad("tokens", [[1, 2, 3], [3, 4, 5]]), "\"logprobs\" has 3 positions"),
    (bad("transitions", [[[-1.0] * 3] * 3]), "m-1 = 2 entries"),
    (bad("transitions", [[[-1.0] * 3] * 3, [[-1.0] * 2] * 3]), "transitions\"[1] must be [3][3]"),
    (bad("target", KeyError), "missing 'target'"),
    (bad("schema", "specpilot.lattice/9"), "unknown schema"),
    (bad("step", -1), "non-negative"),
    (bad("remaining", 0), "\"remaining\" must be a positive integer"),
    (bad("remaining", "3"), "\"remaining\" must be a positive integer"),
    (bad("batch_step", -1), "\"batch_step\" must be a whole number >= 0"),
    (bad("batch_step", True), "\"batch_step\" must be a whole number >= 0"),
    (bad("logprobs", [[float("nan"), -1, -1], [-1, -1, -1], [-1, -1, -1]]), "NaN"),
    (bad("target", [11, -1, 30, 99]), "\"target\" holds a negative token id"),
    (bad("logprobs", [[-1, -1, -1], [-3.0, -0.1, -4], [-1, -1, -1]]),
     "\"logprobs\"[1] is not sorted by score (candidate 1 scores -0.1, above candidate 0's -3)"),
    (bad("logprobs", [[-1, -1, -1], [-1, -1, -1], [float("-inf"), -0.5, -1]]), "\"logprobs\"[2] is not sorted"),
])
def test_malformed_rows_name_file_and_line(tmp_path, run_cli, row, msg):
    lat = tmp_path / "l.jsonl"
    lat.write_text(json.dumps(HAND) + "\n\n" + json.dumps(row).replace("NaN", "NaN") + "\n")
    out = tmp_path / "o.json"
    code, stdout, err = run_cli("replay", lat, "--out", out)
    assert code == 2
    assert err.startswith("specpilot: error: ") and err.count("\n") == 1
    assert f"{lat}:3" in err and msg in err
    assert not out.exists() and stdout == ""


TLV_ROW = {"schema": "specpilot.lattice/1", "request": 0, "step": 0, "tokens": [], "logprobs": [],
           "transitions": None, "target": [55, 38],
           "tlv": {"nodes": 8, "q_argmax": [55], "commit": [55],
                   "draft2": {"tokens": [], "logprobs": [], "transitions": None}}}


@pytest.mark.parametrize("policy, tlv, msg", [
    ("tlv:32", {"nodes": 0}, "\"tlv\".nodes must be a whole number in 1..4096 (the engine's --nodes range), got 0"),
    ("tlv:32", {"nodes": 4097}, "got 4097"),
    ("chain", {"commit": [-1]}, "\"tlv\".commit holds a negative token id"),
    ("chain", {"q_argmax": [-3]}, "\"tlv\".q_argmax holds a negative token id"),
])
def test_tlv_fields_are_range_checked_when_read(tmp_path, run_cli, policy, tlv, msg):
    """tlv.nodes 0 made tlv:32 suggest 'replay tlv:0'; a commit of token -1 replayed under chain."""
    lat = write(tmp_path / "l.jsonl", [TLV_ROW, dict(TLV_ROW, step=1, tlv=dict(TLV_ROW["tlv"], **tlv))])
    assert run_cli("replay", write(tmp_path / "ok.jsonl", [TLV_ROW]), "--policy", "tlv:8")[0] == 0
    code, out, err = run_cli("replay", lat, "--policy", policy)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"specpilot: error: {lat}:2: ") and msg in err, err


def test_bad_json_line_and_missing_file(tmp_path, run_cli):
    lat = tmp_path / "l.jsonl"
    lat.write_text(json.dumps(HAND) + "\n{not json\n")
    code, _, err = run_cli("replay", lat)
    assert code == 2 and f"{lat}:2" in err
    code, _, err = run_cli("replay", tmp_path / "nope.jsonl")
    assert code == 2 and "no such file" in err
    code, _, err = run_cli("replay", "/dev/null")   # it exists: a device, not a lattice file
    assert code == 2 and err == "specpilot: error: /dev/null: not a regular file\n"
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert run_cli("replay", empty)[0] == 2


@pytest.mark.parametrize("args,msg", [
    (["--policy", "beam:4"], "unknown policy"),
    (["--nodes", "8,x"], "--nodes"),
    (["--policy", "eagle2:4,4"], "TOPK,DEPTH,N"),
    (["--policy", ""], "--policy: empty"),
    (["--policy", " "], "--policy: empty"),
    (["--nodes", ""], "--nodes: give at least one value"),
    (["--nodes", "8,\u0663"], "--nodes: '\u0663' is not a whole number"),   # an Arabic-Indic 3
    (["--nodes", "8,16,...,60"], "--nodes"),
])
def test_bad_options(tmp_path, run_cli, args, msg):
    lat = write(tmp_path / "l.jsonl", [HAND])
    code, _, err = run_cli("replay", lat, *args)
    assert code == 2 and msg in err, err


def test_nodes_take_a_series_as_rows_do(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", [HAND])
    code, out, err = run_cli("replay", lat, "--policy", "best-first:4", "--nodes", "1,2,3,...,5", "--format", "json")
    assert code == 0, err
    assert sorted(int(n) for n in json.loads(out)["curves"]["best-first"]) == [1, 2, 3, 4, 5]
    # the series --help shows runs as written; the one that could step by 8 or double is refused
    from specpilot.commands.replay import command

    example = next(o for o in command.params if o.name == "nodes").help.split("--rows takes: ")[1].split(";")[0]
    code, out, err = run_cli("replay", lat, "--nodes", example, "--format", "json")
    assert code == 0 and sorted(int(n) for n in json.loads(out)["curves"]["best-first"]) == list(range(8, 65, 8)), err
    code, _, err = run_cli("replay", lat, "--nodes", "8,16,...,64")
    assert code == 2 and "give a third value" in err, err


def test_duplicate_step_and_overwrite_input(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", [HAND, HAND])
    code, _, err = run_cli("replay", lat)
    assert code == 2 and f"{lat}:2: request 0 step 0 appears twice (first at line 1)" in err, err
    lat = write(tmp_path / "l.jsonl", [HAND])
    code, _, err = run_cli("replay", lat, "--out", lat)
    assert code == 2 and "refusing to overwrite" in err
    assert json.loads(lat.read_text().splitlines()[0])["schema"] == "specpilot.lattice/1"


def test_bootstrap_resamples_requests():
    # two requests with very different tau: the CI must be wide; one request: degenerate
    vals = np.array([1.0] * 50 + [5.0] * 50)
    groups = np.array([0] * 50 + [1] * 50)
    lo, hi = bootstrap_mean_ci(vals, groups, 2000, 0)
    assert lo <= 1.5 and hi >= 4.5
    assert bootstrap_mean_ci(vals[:50], groups[:50]) == (1.0, 1.0)


def test_library_replay_matches_cli_numbers(tmp_path):
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=4, m=5, k=4, seed=3))
    res = replay(read_lattice(lat), ["chain", "oracle:4"], nodes=[2, 4])
    assert res.policies[0].tau <= res.policies[1].tau
    assert res.curves == {"chain": {"2": replay(read_lattice(lat), ["chain:2"]).policies[0].tau,
                                    "4": replay(read_lattice(lat), ["chain:4"]).policies[0].tau}}


def test_a_bad_calibration_file_names_the_option(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", [HAND])
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:4", "--calibrate", tmp_path / "nope.jsonl")
    assert code == 2 and out == "" and err == f"specpilot: error: --calibrate {tmp_path / 'nope.jsonl'}: no such file\n"
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:4", "--calibrate", "/dev/null")
    assert code == 2 and out == "" and err == "specpilot: error: --calibrate /dev/null: not a regular file\n"


def test_sequoia_calibration_file(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=4, m=4, k=4, seed=5))
    cal = write(tmp_path / "c.jsonl", synthetic_rows(requests=3, steps=4, m=4, k=4, seed=6, rank_p=0.9))
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:6", "--calibrate", cal, "--format", "json")
    assert code == 0, err
    own = json.loads(run_cli("replay", lat, "--policy", "sequoia:6", "--format", "json")[1])
    assert json.loads(out)["sequoia_rank_acceptance"] != own["sequoia_rank_acceptance"]
    assert json.loads(out)["sequoia_rank_acceptance"][0] > 0.7     # calibrated where rank 0 dominates


def test_a_calibration_of_no_draft_positions_is_refused(tmp_path, run_cli):
    """An AR run's lattice measures no acceptance by rank (0/0): sequoia printed tau 1 from an empty
    shape. The replayed lattice's own calibration of no drafts replays as it is (tau 1, truly)."""
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=4, m=4, k=4, seed=5))
    ar = write(tmp_path / "ar.jsonl", [{"schema": "specpilot.lattice/1", "request": "a", "step": 0, "tokens": [],
                                        "logprobs": [], "transitions": None, "target": [5]}])
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:4", "--calibrate", ar, "--bootstrap", "100")
    assert code == 2 and out == "" and err == (f"specpilot: error: sequoia: {ar} has no draft positions to measure "
                                               "acceptance by rank from; calibrate on a lattice of a speculative run\n")
    code, out, err = run_cli("replay", ar, "--policy", "sequoia:4", "--bootstrap", "100", "--format", "json")
    assert code == 0 and json.loads(out)["policies"][0]["tau"] == 1.0, err


@pytest.mark.parametrize("policies", [[], ["--policy", "chain,best-first:8"]])
def test_calibrate_without_sequoia_is_refused(tmp_path, run_cli, policies):
    """Only sequoia reads --calibrate; the defaults have no sequoia, so it was silently ignored."""
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=2, m=3, k=3))
    out = tmp_path / "o.json"
    code, stdout, err = run_cli("replay", lat, *policies, "--calibrate", lat, "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert err == ("specpilot: error: --calibrate is read by sequoia:N only; add --policy sequoia:N or leave it "
                   "out\n")


def test_ragged_and_empty_steps_from_the_engine(tmp_path, run_cli):
    """Rows shorter than K, parent-conditioned ragged transitions, and a step with no draft."""
    rows = [
        {"schema": "specpilot.lattice/1", "request": 0, "step": 0, "tokens": [[66], [196, 12], [170]],
         "logprobs": [[0.0], [-0.29, -1.39], [0.0]], "transitions": [[[-0.22, -1.6]], [[-0.05], [-1.2]]],
         "target": [66, 12, 170, 16]},
        {"schema": "specpilot.lattice/1", "request": 0, "step": 1, "tokens": [], "logprobs": [],
         "transitions": None, "target": [5]},
        {"schema": "specpilot.lattice/1", "request": 1, "step": 0, "tokens": [[7, 8, 9]],
         "logprobs": [[-0.1, -2.0, -3.0]], "transitions": None, "target": [9, 1]},
    ]
    lat = write(tmp_path / "l.jsonl", rows)
    code, out, err = run_cli("replay", lat, "--policy", "chain", "--policy", "best-first:4", "--policy", "oracle:3",
                             "--policy", "eagle2:2,3,4", "--policy", "sequoia:4", "--format", "json")
    assert code == 0, err
    tau = {p["policy"]: p["tau"] for p in json.loads(out)["policies"]}
    # step 0: chain 66-196 stops after 66 (tau 2); 4 best-first nodes are 66, 66-196, 66-196-170, 66-12
    # (66-12-170 scores -2.8): tau 3; the oracle follows 66-12-170: tau 4.
    # step 1: no draft (tau 1); request 1: chain misses 9 (tau 1), trees of >= 3 candidates take it (tau 2)
    assert tau["chain"] == pytest.approx((2 + 1 + 1) / 3)
    assert tau["best-first:4"] == pytest.approx((3 + 1 + 2) / 3)
    assert tau["oracle:3"] == pytest.approx((4 + 1 + 2) / 3)
    assert tau["eagle2:2,3,4"] == pytest.approx((3 + 1 + 1) / 3)     # top-2 never drafts 9


@pytest.mark.parametrize("field,value,msg", [
    ("transitions", [[[-0.2, -1.6, -1.0]], [[-0.05], [-1.2]]], "transitions\"[0] must be [1][2]"),
    ("logprobs", [[0.0], [-0.29], [0.0]], "1 scores for 2 tokens"),
    ("tokens", [[66], [], [170]], "is empty"),
])
def test_ragged_rows_checked(tmp_path, run_cli, field, value, msg):
    row = {"schema": "specpilot.lattice/1", "request": 0, "step": 0, "tokens": [[66], [196, 12], [170]],
           "logprobs": [[0.0], [-0.29, -1.39], [0.0]], "transitions": [[[-0.22, -1.6]], [[-0.05], [-1.2]]],
           "target": [66, 12, 170, 16]}
    row[field] = value
    lat = write(tmp_path / "l.jsonl", [row])
    code, _, err = run_cli("replay", lat)
    assert code == 2 and msg in err and f"{lat}:1" in err, err


def test_oracle_wider_than_the_lattice_takes_every_candidate(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", [HAND])
    d = json.loads(run_cli("replay", lat, "--policy", "oracle:3", "--policy", "oracle:16", "--format", "json")[1])
    assert d["policies"][0]["tau"] == d["policies"][1]["tau"] == 4.0
    code, out, err = run_cli("replay", lat, "--policy", "oracle:16")
    assert code == 0 and "oracle:16 is cut to the lattice's" in out, out


def test_a_policy_given_twice_replays_once(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", [HAND])
    code, out, err = run_cli("replay", lat, "--policy", "best-first:8", "--policy", "chain,best-first:8",
                             "--format", "json")
    assert code == 0, err
    assert [p["policy"] for p in json.loads(out)["policies"]] == ["best-first:8", "chain"]


def test_a_lattice_without_drafts_prints_no_empty_sequoia_line(tmp_path, run_cli):
    row = {"schema": "specpilot.lattice/1", "request": 0, "step": 0, "tokens": [], "logprobs": [], "transitions": None,
           "target": [5]}
    lat = write(tmp_path / "l.jsonl", [row])
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:4")
    assert code == 0, err
    assert "sequoia acceptance by rank (measured): \n" not in out + "\n" and not any(
        ln.rstrip().endswith("(measured):") for ln in out.splitlines()), out


def test_engine_recorded_lattice_replays_to_the_engines_acceptance(tmp_path, run_cli):
    """A lattice the embedded engine recorded (tiny model, n-gram drafter, tree of 16): replaying
    best-first:16 gives exactly the tokens the engine accepted at every step."""
    from specpilot.engine.api import load_engine

    eng = load_engine("engine:model=tiny,mode=tree,nodes=16,depth=6,topk=4")
    steps, accepts, delivered = [], [], 0
    for i, prompt in enumerate([b"abcabcabcabcabc abcabc", b"the cat the cat the cat"]):
        r = eng.generate(list(prompt), 24, record_lattice=True, request=i)
        steps += r.lattice_steps
        accepts += r.accept_lengths
        delivered += len(r.output_ids) - 1
    lat = write(tmp_path / "engine.lattice.jsonl", steps)
    code, out, err = run_cli("replay", lat, "--policy", "best-first:16", "--policy", "chain", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["requests"] == 2 and d["steps"] == len(accepts)
    # every step's accepted tokens, capped at what its request could still deliver: the run's tau
    capped = [min(a + 1, row["remaining"]) for a, row in zip(accepts, steps)]
    assert d["policies"][0]["tau"] == pytest.approx(sum(capped) / len(accepts))
    assert sum(capped) == delivered
    assert d["policies"][1]["tau"] <= d["policies"][0]["tau"]


def test_best_first_curve_matches_direct_trees(tmp_path):
    """The curve reuses one tree per step at the largest budget; it must equal building each budget."""
    from specpilot.auditors.policies import parse_policy

    lat = read_lattice(write(tmp_path / "l.jsonl", synthetic_rows(requests=3, steps=6, m=6, k=5, seed=9,
                                                                   transitions=True)))
    res = replay(lat, ["best-first:7"], nodes=[1, 3, 7, 20, 63])
    for n, tau in res.curves["best-first"].items():
        direct = np.mean([parse_policy(f"best-first:{n}").tau(s) for s in lat.steps])
        assert tau == pytest.approx(direct), n
    assert res.policies[0].tau == pytest.approx(np.mean([parse_policy("best-first:7").tau(s) for s in lat.steps]))


def test_chain_curve_stops_at_the_draft_length(tmp_path):
    lat = read_lattice(write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=3, m=4, k=3, seed=2)))
    res = replay(lat, ["chain", "best-first:4"], nodes=[2, 4, 8, 16])
    assert list(res.curves["chain"]) == ["2", "4"]
    assert list(res.curves["best-first"]) == ["2", "4", "8", "16"]


def test_table_with_a_short_chain_curve(tmp_path, run_cli):
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=3, m=4, k=3, seed=2))
    code, out, err = run_cli("replay", lat, "--policy", "chain", "--policy", "best-first:4", "--nodes", "2,8")
    assert code == 0, err
    chain_row = [ln for ln in out.splitlines() if ln.startswith("chain ")][-1]
    assert chain_row.split()[-1] == "-"


def test_shared_budget_policy(tmp_path, run_cli):
    """Two requests verified in the same step: a confident one (A) and an unsure one (B).
    best-first:2 gives each 2 nodes: A accepts 2 of its 3 (tau 3), B takes its top candidate (tau 2).
    shared:2 puts the batch's 4 nodes where path scores are highest: A's whole chain (.99, .98, .97)
    and B's top candidate (.5): A tau 4, B tau 2."""
    def row(req, probs, target):
        return {"schema": "specpilot.lattice/1", "request": req, "step": 0,
                "tokens": [[10 * req + 1, 10 * req + 2]] * 1 + [[10 * req + 3, 10 * req + 4]] + [[10 * req + 5, 10 * req + 6]],
                "logprobs": np.log(probs).tolist(), "transitions": None, "target": target}
    a = row(1, [[.99, .01], [.99, .01], [.99, .01]], [11, 13, 15, 0])
    b = row(2, [[.5, .5], [.5, .5], [.5, .5]], [21, 99, 99, 99])
    lat = write(tmp_path / "l.jsonl", [a, b])
    code, out, err = run_cli("replay", lat, "--policy", "best-first:2", "--policy", "shared:2", "--nodes", "1,2",
                             "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    tau = {p["policy"]: p["tau"] for p in d["policies"]}
    assert tau == {"best-first:2": 2.5, "shared:2": 3.0}
    assert d["curves"]["shared"]["2"] == 3.0 and d["curves"]["best-first"]["1"] == 2.0


def test_batch_policies_pad_each_batch_to_its_own_width(tmp_path, run_cli):
    """One step with a very wide position must not pad every batch to its width: the other steps
    replay as they would without it, and a batch too wide to pack is refused (exit 2), not a run
    that eats the machine's memory."""
    def row(req, step, k, trans):
        toks = [[100 + i for i in range(k)], [200 + i for i in range(k)]]
        lp = np.log(np.full((2, k), 1.0 / k)).tolist()
        return {"schema": "specpilot.lattice/1", "request": req, "step": step, "tokens": toks, "logprobs": lp,
                "transitions": [np.log(np.full((k, k), 1.0 / k)).tolist()] if trans else None,
                "target": [100, 200, 7]}
    narrow = [row(r, s, 3, True) for r in range(2) for s in range(3)]
    lat = write(tmp_path / "n.jsonl", narrow)
    want = json.loads(run_cli("replay", lat, "--policy", "shared:4", "--format", "json")[1])["policies"][0]["tau"]
    alone = write(tmp_path / "a.jsonl", [row(0, 3, 5000, False)])
    wide_tau = json.loads(run_cli("replay", alone, "--policy", "shared:4", "--format", "json")[1])["policies"][0]["tau"]
    lat = write(tmp_path / "w.jsonl", narrow + [row(0, 3, 5000, False)])
    code, out, err = run_cli("replay", lat, "--policy", "shared:4", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["steps"] == 7 and d["policies"][0]["tau"] == pytest.approx((want * 6 + wide_tau) / 7)
    # a batch that has transitions and one 6000-wide position would pack [2, 1, 6000, 6000]
    lat = write(tmp_path / "x.jsonl", narrow + [row(0, 3, 6000, False), row(1, 3, 3, True)])
    code, _, err = run_cli("replay", lat, "--policy", "shared:4")
    assert code == 2 and "transition scores, padded" in err, err


def test_batch_policies_on_a_lattice_with_no_draft(tmp_path, run_cli):
    """A drafter that proposed nothing (m = 0, K = 0: random weights give the n-gram drafter no match)
    verifies the bonus token only: tau 1 for every policy, batched ones included."""
    rows = [{"schema": "specpilot.lattice/1", "request": r, "step": s, "tokens": [], "logprobs": [],
             "transitions": None, "target": [7]} for r in range(2) for s in range(3)]
    lat = write(tmp_path / "l.jsonl", rows)
    code, out, err = run_cli("replay", lat, "--policy", "shared:8", "--policy", "adaptive:8", "--policy",
                             "best-first:8", "--format", "json")
    assert code == 0, err
    assert {p["policy"]: p["tau"] for p in json.loads(out)["policies"]} == \
        {"shared:8": 1.0, "adaptive:8": 1.0, "best-first:8": 1.0}


@pytest.mark.parametrize("block, policy", [("fixed", "shared:16"), ("adaptive", "adaptive:16")])
def test_batched_runs_replay_to_their_own_tau(tmp_path, run_cli, block, policy):
    """A batched tree run (shared budget) with fixed drafter blocks is shared:N, with the per-request
    block rule adaptive:N: each replays to the run's own tau, step for step, with 6 prompts in 4
    slots (requests join as others leave: the rows' batch_step groups them)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"t{i}",
                                           "prompt_ids": [(7 * i + j) % 256 for j in range(5 + i)] * 3}) + "\n"
                               for i in range(6)))
    lat, run = tmp_path / "l.jsonl", tmp_path / "run.json"
    code, _, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--nodes", "16", "--batch", "4", "--block",
                           block, "--prompts", prompts, "--max-new-tokens", "40", "--lattice-out", lat,
                           "--format", "json", "--out", run)
    assert code == 0, err
    tau = json.loads(run.read_text())["tau"]
    other = "adaptive:16" if policy == "shared:16" else "shared:16"
    code, out, err = run_cli("replay", lat, "--policy", policy, "--policy", other, "--format", "json")
    assert code == 0, err
    got = {p["policy"]: p["tau"] for p in json.loads(out)["policies"]}
    assert got[policy] == pytest.approx(tau, abs=1e-12) and got[other] != pytest.approx(tau)   # the rule shows


def test_a_batch_policy_refuses_a_request_twice_in_one_step(tmp_path, run_cli):
    rows = synthetic_rows(requests=2, steps=3, m=4, k=3, seed=2)
    for r in rows:
        r["batch_step"] = r["step"]
    same = [r for r in rows if r["request"] == rows[0]["request"]]
    same[1]["batch_step"] = same[0]["batch_step"]
    lat = write(tmp_path / "l.jsonl", rows)
    code, _, err = run_cli("replay", lat, "--policy", "shared:4")
    assert code == 2 and "a request has two rows at batch_step 0; a batch policy needs one" in err, err
    assert run_cli("replay", lat, "--policy", "best-first:4")[0] == 0   # one request at a time: no batch needed


def test_marginal_scores_ignore_transitions_beside_best_first(tmp_path, run_cli):
    """marginal:N is the best-first tree over each position's own log-probabilities (DDTree):
    the same as best-first:N on a lattice without transitions, its own tree on one with them."""
    from specpilot.auditors.policies import parse_policy
    from specpilot.kernels.tree import build_best_first

    plain = read_lattice(write(tmp_path / "p.jsonl", synthetic_rows(requests=2, steps=5, m=5, k=4, seed=2)))
    cond = read_lattice(write(tmp_path / "c.jsonl", synthetic_rows(requests=2, steps=5, m=5, k=4, seed=2,
                                                                   transitions=True)))
    mg, bf = parse_policy("marginal:12"), parse_policy("best-first:12")
    for s in plain.steps:
        assert mg.tree(s) == bf.tree(s)
    assert any(mg.tree(s) != bf.tree(s) for s in cond.steps)
    for s in cond.steps:
        assert mg.tree(s) == build_best_first(s.tokens, s.logprobs, None, 12)
    code, out, err = run_cli("replay", cond.path, "--policy", "best-first:12", "--policy", "marginal:12",
                             "--nodes", "4,12", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert [p["policy"] for p in d["policies"]] == ["best-first:12", "marginal:12"]
    assert all(p["tau_ci"][0] <= p["tau"] <= p["tau_ci"][1] for p in d["policies"])
    assert set(d["curves"]) == {"best-first", "marginal"} and d["curves"]["marginal"]["12"] == d["policies"][1]["tau"]
    # the same two in one --policy, as the issue writes them; eagle2's commas stay its own
    code, out2, err = run_cli("replay", cond.path, "--policy", "best-first:12,marginal:12", "--nodes", "4,12",
                              "--format", "json")
    assert code == 0, err
    assert json.loads(out2)["policies"] == d["policies"]
    code, out3, err = run_cli("replay", cond.path, "--policy", "eagle2:2,3,8,marginal:12", "--format", "json")
    assert code == 0, err
    assert [p["policy"] for p in json.loads(out3)["policies"]][1] == "marginal:12"
    assert run_cli("replay", cond.path, "--policy", "best-first:12,warp:3")[0] == 2


def test_a_lattice_without_drafts_replays_with_the_default_policies(tmp_path, run_cli):
    """An AR run's lattice (no draft at any step) replays to tau 1; no oracle of 0 candidates."""
    rows = [{"schema": "specpilot.lattice/1", "request": 0, "step": s, "tokens": [], "logprobs": [],
             "transitions": None, "target": [7]} for s in range(3)]
    code, out, err = run_cli("replay", write(tmp_path / "ar.jsonl", rows), "--format", "json")
    assert code == 0, err
    assert {p["policy"]: p["tau"] for p in json.loads(out)["policies"]} == {"chain": 1.0, "best-first:32": 1.0}


def test_a_tlv_recording_replays_its_own_tau_with_the_default_policies(tmp_path, run_cli):
    """Without --policy a lattice of run --mode tlv gets tlv:N (N as recorded): the others score the
    draft-1 lattices only and were all the table showed, far below the run's tau."""
    lat, run = tmp_path / "t.lat.jsonl", tmp_path / "run.json"
    code, _, err = run_cli("run", "--model", "tiny", "--threads", "1", "--mode", "tlv", "--nodes", "8", "--prompt",
                           "abcabcabcabc", "--max-new-tokens", "16", "--lattice-out", lat, "--format", "json",
                           "--out", run)
    assert code == 0, err
    code, out, err = run_cli("replay", lat, "--format", "json")
    assert code == 0 and err == "", err
    taus = {p["policy"]: p["tau"] for p in json.loads(out)["policies"]}
    assert list(taus)[:3] == ["chain", "best-first:32", "tlv:8"]
    assert taus["tlv:8"] == pytest.approx(json.loads(run.read_text())["tau"]) and taus["tlv:8"] > taus["chain"]
    code, out, err = run_cli("replay", lat, "--policy", "tlv:8", "--nodes", "4,8")   # tlv:N has no tau(N) curve
    assert code == 0 and "tau(N) curves" not in out, err
    assert "--nodes: no tau(N) curve: tlv replays at its own budget only" in out
    rows = [json.loads(line) for line in lat.read_text().splitlines()]
    del rows[1]["tlv"]   # not every row a cycle: tlv:N would refuse it, so it is left out, and the user told
    code, out, err = run_cli("replay", write(tmp_path / "mixed.jsonl", rows), "--format", "json")
    assert code == 0 and not any(p["policy"].startswith("tlv") for p in json.loads(out)["policies"])
    assert err == (f"specpilot: warning: {len(rows) - 1} of {len(rows)} rows are TLV cycles (recorded at --nodes 8); "
                   "tlv:N needs every row to be one at that N, so the default policies leave it out\n")


def test_a_chain_longer_than_the_lattice_says_so(tmp_path, run_cli):
    """m=3: a chain has no budget among --nodes 4,8 (no empty 'tau(N) curves' table), and chain:100
    verifies 3 nodes, which the table says rather than only naming chain:100."""
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=3, m=3, k=4))
    code, out, err = run_cli("replay", lat, "--policy", "chain", "--nodes", "4,8")
    assert code == 0, err
    assert "tau(N) curves" not in out
    assert "chain: no tau(N) curve: every --nodes budget is above the lattice's 3 draft positions" in out
    code, out, _ = run_cli("replay", lat, "--policy", "chain", "--nodes", "4,8", "--format", "json")
    assert code == 0 and json.loads(out)["curves"] == {}
    code, out, _ = run_cli("replay", lat, "--policy", "chain:100", "--policy", "chain:2")
    assert code == 0 and "chain:100 is cut to the lattice's 3 draft positions (nodes 3)" in out
    assert "chain:2 is cut" not in out
    code, out, _ = run_cli("replay", lat, "--policy", "chain:100", "--format", "json")
    assert json.loads(out)["policies"][0]["nodes"] == 3


def test_a_small_lattice_reports_the_nodes_its_trees_hold(tmp_path, run_cli):
    """m=2 x K=3 holds 3 + 9 = 12 nodes: best-first:32 and the batch policies build 12, not 32; an
    eagle2 depth of 8 is cut to the 2 positions (2 + 2 x 2 = 6 nodes), which a note says; the chain
    builds its m; oracle builds no tree."""
    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=3, m=2, k=3))
    pols = "chain,best-first:32,marginal:32,shared:32,adaptive:32,eagle2:2,8,32,sequoia:32,oracle:3"
    code, out, err = run_cli("replay", lat, "--policy", pols, "--format", "json")
    assert code == 0, err
    got = {p["policy"]: (p["nodes"], p["nodes_built"]) for p in json.loads(out)["policies"]}
    assert got == {"chain": (2, 2.0), "best-first:32": (32, 12.0), "marginal:32": (32, 12.0),
                   "shared:32": (32, 12.0), "adaptive:32": (32, 12.0), "eagle2:2,8,32": (32, 6.0),
                   "sequoia:32": (32, 12.0), "oracle:3": (None, None)}
    code, out, err = run_cli("replay", lat, "--policy", "best-first:32,eagle2:2,8,32,eagle2:2,2,4")
    assert code == 0, err
    assert "built (mean)" in out.splitlines()[1]
    row = next(x for x in out.splitlines() if x.startswith("best-first:32")).split()
    assert row[1:3] == ["32", "12.0"]
    assert "eagle2:2,8,32 is cut to the lattice's 2 draft positions (depth 2)" in out
    assert "eagle2:2,2,4 is cut" not in out


def test_a_ragged_step_builds_what_its_candidates_allow(tmp_path):
    """Step 0 has 1 + 2 candidates (3 nodes at most), step 1 has no draft: best-first:8 builds 1.5
    nodes a step on average."""
    rows = [dict(HAND, tokens=[[10], [20, 21]], logprobs=[[-0.1], [-0.2, -0.3]], target=[10, 20, 5]),
            dict(HAND, step=1, tokens=[], logprobs=[], target=[7])]
    res = replay(read_lattice(write(tmp_path / "l.jsonl", rows)), ["best-first:8", "chain"])
    assert [(p.nodes, p.built) for p in res.policies] == [(8, 1.5), (2, 1.0)]


def test_the_progress_total_is_the_work_done(tmp_path, run_cli, monkeypatch):
    """The bar's total counts only the curve budgets replayed: a chain has none above m (here 3 of
    --nodes 2,8,16), and a family's curve is computed once however many of its policies are given."""
    import specpilot.output

    lat = write(tmp_path / "l.jsonl", synthetic_rows(requests=2, steps=3, m=3, k=4))
    bars = []

    class Bar:
        def __init__(self, total, **_):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    monkeypatch.setattr(specpilot.output, "progress", lambda *a, **kw: Bar(**kw))
    code, _, err = run_cli("replay", lat, "--policy", "chain,chain:2,best-first:4,best-first:8,oracle:4",
                           "--nodes", "2,8,16")
    assert code == 0, err
    # 6 steps x (5 policies + chain at N=2 + best-first at N=2, 8, 16)
    assert [(b.total, b.n) for b in bars] == [(6 * 9, 6 * 9)]


def test_lattices_of_different_runs_in_one_file(tmp_path, run_cli):
    """Rows of 2+ positions with and without transitions, rows with and without batch_step: one
    warning line each and a header that says which scores; a batch policy refuses the batch_step mix."""
    trans = [[[-0.1, -2.5, -3.0]] * 3] * 2
    rows = [dict(HAND, step=0, transitions=trans), dict(HAND, step=1),
            dict(HAND, step=2, tokens=[[10]], logprobs=[[0.0]], transitions=None)]   # one position: no parent
    code, out, err = run_cli("replay", write(tmp_path / "t.jsonl", rows), "--policy", "chain")
    assert code == 0 and err.count("warning:") == 1, err
    assert "1 of 2 rows of 2+ draft positions carry \"transitions\", 1 do not" in err, err
    assert "parent-conditioned scores in 1 of 2 rows of 2+ positions, marginal in the others)" in out, out
    code, out, err = run_cli("replay", write(tmp_path / "ok.jsonl", [rows[0], rows[2]]), "--policy", "chain")
    assert code == 0 and "warning" not in err and ", parent-conditioned scores)" in out, (out, err)
    lat = write(tmp_path / "b.jsonl", [dict(HAND, batch_step=0), dict(HAND, step=1)])
    code, out, err = run_cli("replay", lat, "--policy", "chain")
    assert code == 0 and "1 of 2 rows carry \"batch_step\"" in err and err.count("\n") == 1, err
    code, out, err = run_cli("replay", lat, "--policy", "shared:4", "--out", tmp_path / "o.json")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "1 of 2 rows carry \"batch_step\" and the others do not" in err and not (tmp_path / "o.json").exists()


def test_a_file_of_the_other_json_shape_is_said_to_be_one(tmp_path, run_cli):
    """A pretty-printed JSON document where lattice rows are wanted, and a lattice (JSON Lines) given
    to ceiling where a replay's one JSON document is wanted: each named for what it is."""
    lat = write(tmp_path / "l.jsonl", [HAND, dict(HAND, step=1)])
    doc = tmp_path / "run.json"
    doc.write_text(json.dumps({"schema": "specpilot.run/1", "tau": 1.5}, indent=2))
    code, _, err = run_cli("replay", doc)
    assert code == 2 and "run.json: one JSON document (specpilot.run/1), where JSON Lines of lattice rows are wanted" \
        in err and err.count("\n") == 1, err
    code, _, err = run_cli("ceiling", "--replay", lat, "--tau", "2")
    assert code == 2 and "l.jsonl: JSON Lines of specpilot.lattice/1 rows, where one JSON document (replay) is " \
        "wanted; `specpilot replay` reads it" in err and err.count("\n") == 1, err


def test_minus_infinity_scores_are_never_verified_by_any_policy(tmp_path, run_cli):
    """chain and oracle verified the -inf candidates the tree policies never expand (tau 3 against
    best-first's 1.5 on the same lattice)."""
    rows = [{"schema": "specpilot.lattice/1", "request": "a", "step": 0, "tokens": [[5], [6]],
             "logprobs": [[float("-inf")], [0.0]], "transitions": None, "target": [5, 6, 7]},
            {"schema": "specpilot.lattice/1", "request": "b", "step": 0, "tokens": [[5, 9], [6]],
             "logprobs": [[-1.0, float("-inf")], [float("-inf")]], "transitions": None, "target": [5, 6, 7]}]
    lat = tmp_path / "inf.jsonl"
    lat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("replay", lat, "--policy", "chain,best-first:4,oracle:2", "--bootstrap", "100",
                             "--format", "json")
    assert code == 0, err
    assert {p["policy"]: p["tau"] for p in json.loads(out)["policies"]} == {"chain": 1.5, "best-first:4": 1.5,
                                                                             "oracle:2": 1.5}


def _row(request, tokens, logprobs, target):
    return {"schema": "specpilot.lattice/1", "request": request, "step": 0, "tokens": tokens, "logprobs": logprobs,
            "transitions": None, "target": target}


def test_sequoia_instantiates_one_shape_in_every_step(tmp_path, run_cli):
    """Ranks accepted 3 of 4 times at rank 0, once at rank 1: the one 2-node shape is rank 0, then rank 0
    under it. The 1-position step holds only its depth-0 node (the shape's second node is past its
    draft) and accepts nothing (target 6 is rank 1); a shape made for its own depth took ranks 0 and 1
    there and accepted 6 (tau 2.5, 2 nodes a step)."""
    lat = write(tmp_path / "l.jsonl", [
        _row("a", [[5, 6]], [[-0.1, -0.2]], [6, 9]),
        _row("b", [[5, 6], [7, 8], [9, 10]], [[-0.1, -0.2]] * 3, [5, 7, 9, 1])])
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:2", "--nodes", "1,2", "--bootstrap", "100",
                             "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["sequoia_rank_acceptance"] == [0.75, 0.25]
    p = d["policies"][0]
    assert (p["tau"], p["nodes_built"], p["tau_hist"]) == (2.0, 1.5, [1, 0, 1, 0])
    assert d["curves"]["sequoia"] == {"1": 1.5, "2": 2.0}
    assert d["curve_rows"]["sequoia"]["2"] == {"2": 1, "3": 1}
    # the same lattice as its own --calibrate file: the same shape
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:2", "--calibrate", lat, "--bootstrap", "100",
                             "--format", "json")
    assert code == 0 and json.loads(out)["policies"][0]["tau"] == 2.0, err


def test_sequoia_acceptance_by_rank_counts_no_minus_infinity_candidate(tmp_path, run_cli):
    """Row a's target token 7 is a candidate scored -inf: no tree expands it, so it is not accepted
    (it was counted at rank 0: 1.000 instead of 0.750)."""
    lat = write(tmp_path / "l.jsonl", [
        _row("a", [[5, 6], [7, 8]], [[-0.1, -3.0], [float("-inf"), float("-inf")]], [5, 7, 9]),
        _row("b", [[5, 6], [7, 8]], [[-0.1, -3.0], [-0.5, -1.0]], [5, 7, 9])])
    code, out, err = run_cli("replay", lat, "--policy", "sequoia:2,oracle:2", "--bootstrap", "100")
    assert code == 0, err
    assert "sequoia acceptance by rank (measured): 0.750, 0.000" in out


def test_eagle2_keeps_a_beam_of_topk_on_a_narrow_step(run_cli, tmp_path):
    """A step of two candidates per position with TOPK 4: every one of the four depth-1 nodes stays in
    the beam (2 + 4 + 8 = 14 nodes) and the target's path 2 -> 4 -> 6 is reached (tau 4). The beam
    was cut to the step's width, 2: 10 nodes, tau 3."""
    lat = tmp_path / "e2.jsonl"
    lat.write_text(json.dumps({"schema": "specpilot.lattice/1", "request": "r0", "step": 0,
                               "tokens": [[1, 2], [3, 4], [5, 6]], "logprobs": [[-0.1, -0.2]] * 3,
                               "transitions": None, "target": [2, 4, 6, 9]}) + "\n")
    code, out, err = run_cli("replay", lat, "--policy", "eagle2:4,3,32", "--format", "json")
    assert code == 0, err
    (p,) = json.loads(out)["policies"]
    assert p["nodes_built"] == 14 and p["tau"] == 4
