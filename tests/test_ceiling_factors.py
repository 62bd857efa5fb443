"""`specpilot ceiling`: a factor below 1 is an inconsistency of the inputs, named in a warning,
never a slowdown multiplied into the ceiling."""

import json

import pytest

from specpilot.probes.costmodel import cost_model


def test_a_kernel_factor_below_one_is_not_a_slowdown():
    # profiled 2 ms against a 3.539 ms floor whose full-peak floor is 3.185 ms: the options do not
    # describe the profile, and the ceiling is not pulled below the current speedup
    c = cost_model(tau=3, step_ms=6, ar_ms=5, profile_ms=2, floor_ms=3.539, floor_peak_ms=3.185)
    assert c.factors["kernel"] == pytest.approx(2 / 3.539)            # the raw value is kept
    assert c.factors_used["kernel"] == 1.0
    assert c.ceiling == pytest.approx(2.5 * 3.0) and c.ceiling >= c.speedup
    assert c.largest == "outside" and c.if_removed["kernel"] == pytest.approx(c.speedup)
    (w,) = c.warnings
    assert w.startswith("model/config mismatch: the kernel factor 0.565 is taken as 1") and "3.185 ms" in w
    assert "do not describe the profiled step" in w
    assert not any("stricter" in n for n in c.notes)
    # between the full-peak floor and the floor: kernels beat the floor's fractions of the peak
    c = cost_model(tau=3, step_ms=6, ar_ms=5, profile_ms=3.3, floor_ms=3.539, floor_peak_ms=3.185)
    assert c.ceiling == pytest.approx(2.5 * 6 / 3.3) and "fractions" in c.warnings[0]
    assert "mismatch" not in c.warnings[0]


def test_an_outside_factor_below_one_is_not_a_slowdown():
    c = cost_model(tau=3, step_ms=6, ar_ms=5, tau_best=4, profile_ms=8)
    assert c.factors["outside"] == pytest.approx(0.75) and c.factors_used["outside"] == 1.0
    assert c.ceiling == pytest.approx(2.5 * 4 / 3) and c.ceiling > c.speedup
    assert c.largest == "tree"
    (w,) = c.warnings
    assert "outside factor 0.75 is taken as 1" in w and "covers more than one step" in w
    # the tree factor too: a best tau below the current one comes from another replay
    c = cost_model(tau=3, step_ms=6, ar_ms=5, tau_best=2.5)
    assert c.ceiling == pytest.approx(c.speedup) and "tree factor 0.833 is taken as 1" in c.warnings[0]
    # every factor at or below 1: none offers a gain
    from specpilot.probes.costmodel import largest_factor_line

    c = cost_model(tau=3, step_ms=6, ar_ms=5, profile_ms=8)
    assert largest_factor_line(c.largest, c.factors_used) == "No known factor offers a gain (each is 1 or below)."


def test_a_verify_step_faster_than_the_ar_step_is_warned_of(run_cli):
    """c below 1 (a step of several rows faster than one row's) cannot be one deployment's; a few
    percent below is noise and passes."""
    c = cost_model(tau=3, step_ms=1, ar_ms=5)
    (w,) = c.warnings
    assert c.c == pytest.approx(0.2) and w.startswith("c = 1 / 5 ms = 0.2: a verify step faster than an AR step")
    assert cost_model(tau=3, step_ms=4.9, ar_ms=5).warnings == []
    code, out, err = run_cli("ceiling", "--tau", "3", "--step-ms", "1", "--ar-ms", "5", "--format", "json")
    assert code == 0 and any(w.startswith("c = 1 / 5 ms = 0.2") for w in json.loads(out)["warnings"]), out


@pytest.mark.parametrize("args, words", [
    (("--bandwidth", "1e-320"), "the byte floors overflow"),
    (("--flops-fraction", "1e-320"), "the byte floors overflow"),
    (("--tau", "3", "--step-ms", "5", "--ar-ms", "5", "--profile-ms", "1e-320"),
     "the cost model's outside factor overflows"),
])
def test_inputs_near_zero_whose_figures_overflow_are_refused(run_cli, args, words):
    """They gave Infinity in the JSON (floors, factors, the ceiling) and "infx" in the table."""
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", *args, "--format", "json")
    assert code == 2 and out == "" and words in err and err.count("\n") == 1, err


def test_cli_ceiling_never_below_the_current_speedup(run_cli):
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--tau", "3", "--step-ms", "6",
                             "--ar-ms", "5", "--profile-ms", "2", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    cm = doc["cost_model"]
    assert cm["factors"]["kernel"] == pytest.approx(2 / 3.539, rel=1e-3) and cm["factors_used"]["kernel"] == 1.0
    assert cm["ceiling"] == pytest.approx(7.5) and cm["ceiling"] >= cm["speedup"]
    assert cm["inputs"]["floor_peak_ms"] == pytest.approx(3.185, rel=1e-3)
    assert any(w.startswith("model/config mismatch: the kernel factor 0.565") and "3.185 ms" in w
               for w in doc["warnings"]), doc["warnings"]
    code, out, err = run_cli("ceiling", "--tau", "3", "--step-ms", "6", "--ar-ms", "5", "--profile-ms", "8",
                             "--tau-best", "4")
    assert code == 0, err
    assert "ceiling                    3.333" in out and "warning: the outside factor 0.75 is taken as 1" in out, out


def test_one_ranks_profile_keeps_the_ceiling_above_the_speedup(run_cli, tmp_path):
    from test_ceiling_profile_rank import MEASURED, RANK, _profile

    prof = _profile(run_cli, tmp_path, "rank1", "--model", "llama-3.1-8b", "--gpu", "h100", header=RANK)
    code, out, err = run_cli("ceiling", "--profile", prof, *MEASURED, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    cm = doc["cost_model"]
    assert cm["factors"]["kernel"] < 1 and cm["ceiling"] >= cm["speedup"]
    assert "one rank's trace" in doc["warnings"][0]
    (w,) = [x for x in doc["warnings"] if "kernel factor" in x and "taken as 1" in x]
    assert "one rank" in w




def test_a_factor_taken_as_one_is_never_the_largest(run_cli):
    """The only known factor measured below 1 (outside 0.75): the JSON names no largest factor, as
    the text says none offers a gain."""
    c = cost_model(tau=3, step_ms=6, ar_ms=5, profile_ms=8)
    assert c.largest is None
    args = ("ceiling", "--tau", "3", "--step-ms", "6", "--ar-ms", "5", "--profile-ms", "8")
    code, out, err = run_cli(*args, "--format", "json")
    assert code == 0, err
    cm = json.loads(out)["cost_model"]
    assert cm["factors"]["outside"] == pytest.approx(0.75) and cm["largest_factor"] is None
    code, out, err = run_cli(*args)
    assert code == 0 and "No known factor offers a gain (each is 1 or below)." in out, out + err
    # a factor exactly 1 offers no gain either; one above 1 beside it is the largest
    assert cost_model(tau=3, step_ms=6, ar_ms=5, profile_ms=6).largest is None
    assert cost_model(tau=3, step_ms=6, ar_ms=5, tau_best=3.3, profile_ms=8).largest == "tree"


def test_the_kernel_factors_gain_keeps_the_time_outside_the_kernels():
    """Kernels at their floors shorten the step by the kernels' excess only: a host-bound step (half
    of it outside the profile) gains little, not speedup x kernel factor (which shrank the outside
    time too: 1.48x for what is 0.995x)."""
    c = cost_model(tau=3, step_ms=20, ar_ms=5, profile_ms=10, floor_ms=5.0712)
    assert c.factors["kernel"] == pytest.approx(10 / 5.0712)
    assert c.if_removed["kernel"] == pytest.approx(3 * 5 / (20 - 10 + 5.0712))
    assert c.if_removed["outside"] == pytest.approx(3 * 5 / 10)   # the kernels as they are, nothing outside
    assert c.ceiling == pytest.approx(3 * 5 / 5.0712)             # all of them: tau at the floor
    # a profile longer than the step (outside below 1) leaves no outside time to keep
    c = cost_model(tau=3, step_ms=6, ar_ms=5, profile_ms=8, floor_ms=4)
    assert c.if_removed["kernel"] == pytest.approx(c.speedup * 2)
