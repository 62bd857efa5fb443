"""`specpilot ceiling --profile` of one tensor-parallel rank's profile: the floor beside it is the
whole model's, which ceiling warns of (text and JSON) without changing a number."""

import json

import pytest

from test_profile_real_world import AR, llama_step, write_trace


def _profile(run_cli, tmp_path, name, *args, header=None):
    step = llama_step(2) + ([(AR, 40)] if header else [])
    trace = write_trace(tmp_path / f"{name}.json.gz", [step] * 3, comm_nelems=4_000_000 if header else 0,
                        header=header)
    out = tmp_path / f"{name}.profile.json"
    code, _, err = run_cli("profile", trace, *args, "--format", "json", "--out", out)
    assert code == 0, err
    return out


RANK = {"distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2}}
MEASURED = ("--tau", "3", "--ar-ms", "0.4")   # the synthetic step takes 0.446 ms


def test_one_ranks_profile_is_warned_of_and_its_numbers_kept(run_cli, tmp_path):
    prof = _profile(run_cli, tmp_path, "rank1", "--model", "llama-3.1-8b", "--gpu", "h100", header=RANK)
    doc = json.loads(prof.read_text())
    assert doc["distributed"]["floors"] == "whole model"
    code, out, err = run_cli("ceiling", "--profile", prof, *MEASURED, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    want = (f"--profile {prof} is one rank's trace of a multi-GPU job (rank 1 of 2, collectives over 2 ranks, 0.04 ms "
            "of collectives per step), and the floor beside it (the profile's own) is the whole model's on one GPU")
    assert d["warnings"][0].startswith(want) and "kernel factor reads up to 2x low" in d["warnings"][0]
    code, text, err = run_cli("ceiling", "--profile", prof, *MEASURED)
    assert code == 0 and f"warning: {want}" in text, err
    # the numbers are those of the same profile without the rank's evidence
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({**doc, "distributed": None}))
    code, out, err = run_cli("ceiling", "--profile", plain, *MEASURED, "--format", "json")
    p = json.loads(out)
    # the synthetic step is far under the floor: without the rank's evidence, a model/config mismatch
    assert code == 0 and [w[:40] for w in p["warnings"]] == ["model/config mismatch: the kernel factor"], err
    assert "one rank" in d["warnings"][1] and "taken as 1" in d["warnings"][1]
    assert d["cost_model"]["factors"] == p["cost_model"]["factors"] and d["cost_model"]["ceiling"] == p["cost_model"]["ceiling"]


def test_one_ranks_profile_beside_models_floor(run_cli, tmp_path):
    """A rank's profile without floors: --model's byte floor is the whole model's too; without any
    floor there is no kernel factor and nothing to warn of."""
    prof = _profile(run_cli, tmp_path, "rank1", header=RANK)
    code, out, err = run_cli("ceiling", "--profile", prof, "--model", "llama-3.1-8b", "--gpu", "h100", *MEASURED,
                             "--format", "json")
    assert code == 0, err
    w = json.loads(out)["warnings"]
    assert len(w) == 2 and "the floor beside it (byte floor of llama-3.1-8b at 1 rows) is the whole model's" in w[0]
    assert w[1].startswith("the kernel factor") and "one rank's trace" in w[1]
    code, out, err = run_cli("ceiling", "--profile", prof, *MEASURED, "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["cost_model"]["factors"]["kernel"] is None and not d["warnings"], err
    # a one-GPU profile with floors: no warning
    one = _profile(run_cli, tmp_path, "one", "--model", "llama-3.1-8b", "--gpu", "h100")
    code, out, err = run_cli("ceiling", "--profile", one, *MEASURED, "--format", "json")
    assert code == 0 and not any("one rank" in x for x in json.loads(out)["warnings"]), err


@pytest.mark.parametrize("bad", [[2], {"rank": "1", "world_size": 2}, {"world_size": True},
                                 {"world_size": 2, "collectives_ms": float("nan")}])
def test_a_malformed_distributed_is_refused(run_cli, tmp_path, bad):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"schema": "specpilot.profile/1", "kernel_busy_ms": 5.0, "step_wall_ms": 6.0,
                                "total_floor_ms": 4.0, "distributed": bad}))
    out = tmp_path / "c.json"
    code, _, err = run_cli("ceiling", "--profile", prof, *MEASURED, "--out", out)
    assert code == 2 and err.startswith("specpilot: error:") and "'distributed'" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists() and not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("alone", [{"world_size": 1, "rank": 0}, {"rank": 0}, {"world_size": 1, "group_size": 1}])
def test_evidence_of_one_process_is_not_warned_of(run_cli, tmp_path, alone):
    """A `distributed` that shows no second rank (written by hand or by another tool: profile itself
    writes null there) is not one rank's: no warning, as profile gives none."""
    prof = _profile(run_cli, tmp_path, "one", "--model", "llama-3.1-8b", "--gpu", "h100")
    doc = json.loads(prof.read_text())
    prof.write_text(json.dumps({**doc, "distributed": alone}))
    code, out, err = run_cli("ceiling", "--profile", prof, *MEASURED, "--format", "json")
    assert code == 0 and not any("one rank" in w for w in json.loads(out)["warnings"]), err


def test_the_group_named_is_the_first_count_above_one():
    from specpilot.probes.profile import rank_evidence

    assert rank_evidence({"rank": 1, "world_size": 2, "group_size": 1})[1] == "2x"
    assert rank_evidence({"collectives_ms": 0.5})[1] == "the tensor-parallel size"
