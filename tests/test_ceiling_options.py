"""`specpilot ceiling`: options that nothing reads are refused; the help says what each file supplies."""

import json
from pathlib import Path

import pytest

from conftest import refused

REPO = Path(__file__).resolve().parents[1]

# options that nothing reads

@pytest.mark.parametrize("args,named", [
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--draft-rows", "4", "--draft-passes", "3"],
     "--draft-rows, --draft-passes"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--policy", "tlv:16"], "--policy"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--fp8-flops", "2000"], "--fp8-flops"),
    (["--tau", "3", "--step-ms", "6", "--ar-ms", "5", "--gpu", "h100"], "--gpu"),
    (["--tau", "3", "--step-ms", "6", "--ar-ms", "5", "--context", "512", "--drafter", "tiny"], "--context, --drafter"),
    (["--tau", "3", "--step-ms", "6", "--ar-ms", "5", "--batch", "4"], "--batch"),
])
def test_options_nothing_reads_are_refused(run_cli, args, named):
    code, out, err = run_cli("ceiling", *args)
    refused(code, err, named)
    assert out == ""


def test_the_drafter_shape_without_a_drafter_is_refused_alike_by_ceiling_and_profile(run_cli):
    trace = REPO / "tests" / "fixtures" / "nsys_h200_decode_eager.sqlite"
    want = ("specpilot: error: --draft-passes: it shapes the drafter's floor, which needs --drafter MODEL; give it, "
            "or leave it out")
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", "--draft-passes", "3")
    assert refused(code, err) == want
    code, _, err = run_cli("profile", trace, "--model", "llama-3.1-8b", "--draft-passes", "3")
    assert refused(code, err) == want
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", "--draft-rows", "4",
                           "--draft-passes", "3")
    assert refused(code, err).endswith("they shape the drafter's floor, which needs --drafter MODEL; give it, or leave "
                                       "them out")


def test_options_check_does_not_read_are_refused(run_cli, tmp_path):
    code, _, err = run_cli("ceiling", "--check", tmp_path / "run.json", "--gpu", "h100", "--context", "512")
    refused(code, err, "--gpu, --context", "--check")


def test_policy_is_read_with_a_replay_or_a_tlv_probe(run_cli, tmp_path):
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [
        {"policy": "chain", "tau": 1.5}, {"policy": "best-first:16", "tau": 1.7}]}))
    code, _, err = run_cli("ceiling", "--replay", replay, "--policy", "best-first:16", "--step-ms", "4", "--ar-ms", "3")
    assert code == 0, err
    # tlv:N with a rows probe: the probe times the TLV cycle at N nodes (N + 1 rows)
    rows = REPO / "examples" / "rounds" / "llama8b-h200" / "measure" / "rows.json"
    code, out, err = run_cli("ceiling", "--rows-probe", rows, "--policy", "tlv:16", "--tau", "3", "--format", "json")
    assert code == 0, err
    cycle = json.loads(out)["tlv_cycle"]
    assert cycle["nodes"] == 16 and cycle["probe_ms"]["rows"] == 17 and cycle["source"].startswith(f"rows probe {rows}")
    # a rows probe reads no other policy
    code, _, err = run_cli("ceiling", "--rows-probe", rows, "--policy", "chain", "--tau", "3")
    refused(code, err, "--policy chain", "tlv:N")


# help

def test_help_says_what_the_profile_supplies(run_cli):
    code, out, _ = run_cli("ceiling", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "GPU time per step" in text and "its GPU" in text and "--run" in text.split("--profile FILE")[1][:600]


def test_a_profile_s_draft_shape_stands_in_when_the_drafter_is_given_again(run_cli, tmp_path):
    """--drafter given beside a --profile of that drafter: the draft passes and rows left out are the
    profile's (they were compared as the options' defaults, 1, and refused); given, they still must
    agree with it. A drafter given as a path is named by its stem in the profile, so --drafter must
    be given again there."""
    fx = REPO / "tests" / "fixtures"
    trace, target = fx / "nsys_h200_decode_eager.sqlite", fx / "decode_target_config.json"
    for drafter, shape in (("smollm2-135m", ["--draft-passes", "3"]), (fx / "decode_drafter_config.json",
                                                                        ["--draft-rows", "2"])):
        prof = tmp_path / "p.json"
        code, _, err = run_cli("profile", trace, "--model", target, "--drafter", drafter, *shape, "--context", "512",
                               "--format", "json", "--out", prof)
        assert code == 0, err
        want = json.loads(prof.read_text())
        code, out, err = run_cli("ceiling", "--profile", prof, "--model", target, "--drafter", drafter, "--tau", "2",
                                 "--ar-ms", "5", "--format", "json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["total_floor_ms"] == pytest.approx(want["total_floor_ms"])
        assert doc["classes"]["drafter"]["bytes"] == pytest.approx(want["classes"]["drafter"]["bytes"])
        code, _, err = run_cli("ceiling", "--profile", prof, "--model", target, "--drafter", drafter, shape[0], "5",
                               "--tau", "2", "--ar-ms", "5")
        refused(code, err, f"{shape[0]} 5 disagree")


def test_the_fp8_peak_is_read_for_an_fp8_lm_head(run_cli):
    """--fp8-flops sets an fp8 LM head's floor under bf16 weights (the projections keep the bf16 peak)."""
    base = ["ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", "--lm-head-dtype", "fp8", "--rows", "4096",
            "--format", "json"]
    code, out, _ = run_cli(*base)
    code2, out2, _ = run_cli(*base, "--fp8-flops", "1000")
    assert code == code2 == 0
    a, b = json.loads(out), json.loads(out2)

    head, head2 = a["classes"]["lm_head"], b["classes"]["lm_head"]
    assert head["bound"] == head2["bound"] == "flops"
    assert head2["floor_ms"] == pytest.approx(head["floor_ms"] * 1979 / 1000, rel=1e-6)
    assert b["classes"]["linear"] == a["classes"]["linear"]
