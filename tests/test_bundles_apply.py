"""apply / revert / status against the real SGLang 0.5.23 wheel (installed --no-deps)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.bundles import activation as act
from sglang_support import SKIP_REASON, fake_version_root, make_env, purelib, sglang_dir, tree_digest
from conftest import refused
from sglang_support import env_fixture  # noqa: F401  (the env fixture: a target environment per module)

SGL = sglang_dir()
pytestmark = pytest.mark.skipif(SGL is None, reason=SKIP_REASON)


def test_round_trip_leaves_environment_byte_identical(run_cli, env):
    root = env.parent.parent
    before = tree_digest(root)
    code, out, err = run_cli("apply", "tree,lattice-trace", "--python", env, "--set", "node_budget=24")
    assert code == 0, err
    path = purelib(env) / act.ACTIVATION_NAME
    data = json.loads(path.read_text())
    assert data["schema"] == "specpilot.activation/1"
    assert data["closure"] == ["tree", "lattice-trace"]
    assert data["settings"]["node_budget"] == 24
    # lattice-trace records DFlash2 lattices, so the launch is for a DFlash2 drafter: no node-budget flag
    # (on DFLASH --speculative-num-draft-tokens would resize the draft block)
    assert "--speculative-num-draft-tokens" not in out and "SGLANG_PLUGINS=specpilot" in out
    assert "flags for dflash2" in out
    assert {h["target"] for h in data["hooks"]} >= {
        "sglang.srt.speculative.eagle_utils.organize_draft_results",
        "sglang.srt.models.dflash.CandidateSelector.build_lattice"}
    assert tree_digest(root) != before

    code, out, err = run_cli("status", "--python", env, "--format", "json")
    assert code == 0, err
    st = json.loads(out)
    assert st["active"] and st["matches"] and st["problems"] == []
    assert st["activation"]["closure"] == ["tree", "lattice-trace"]

    code, out, err = run_cli("revert", "--python", env)
    assert code == 0 and "tree, lattice-trace no longer active" in out
    assert tree_digest(root) == before
    code, out, _ = run_cli("status", "--python", env)
    assert code == 0 and "no bundles active" in out
    code, out, _ = run_cli("revert", "--python", env)
    assert code == 0 and "nothing was active" in out


def test_batching_and_w12_round_trip(run_cli, env):
    root = env.parent.parent
    before = tree_digest(root)
    code, out, err = run_cli("apply", "batching,w12", "--python", env, "--experimental",
                             "--set", "shared_budget=256", "--set", "block_sizes=[12,8]")
    assert code == 0, err
    assert out.count(" ok ") >= 9 and "SGLANG_RAGGED_VERIFY_MODE=compact" in out and "--quantization w12" in out
    data = json.loads((purelib(env) / act.ACTIVATION_NAME).read_text())
    assert data["closure"] == ["batching", "w12"] and data["drafter"] == "dspark"
    assert data["settings"]["shared_budget"] == 256 and data["settings"]["block_sizes"] == [12, 8]
    targets = {h["target"].rsplit(".", 2)[-2] + "." + h["target"].rsplit(".", 1)[-1] for h in data["hooks"]}
    assert {"DSparkVerifyPlanner._schedule_verify_lens", "Scheduler._should_defer_prefill",
            "DFlashWorkerV2.forward_batch_generation"} <= targets
    assert set(data["fingerprints"]) >= {"specpilot.bundles.batching", "specpilot.bundles.w12_quantization"}
    code, out, err = run_cli("status", "--python", env, "--format", "json")
    st = json.loads(out)
    assert code == 0 and st["matches"] and st["problems"] == [] and all(c["ok"] for c in st["checks"])
    assert run_cli("revert", "--python", env)[0] == 0
    assert tree_digest(root) == before


def test_tlv_round_trip(run_cli, env):
    code, out, err = run_cli("apply", "tlv", "--python", env, "--experimental", "--format", "json")
    assert code == 0, err
    data = json.loads(out)["activation"]
    assert data["closure"] == ["w12", "tlv"] and data["drafter"] == "dflash"
    assert "SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1" in data["launch"] and "--quantization w12" in data["launch"]
    assert run_cli("revert", "--python", env)[0] == 0


@pytest.mark.parametrize("bundles, drafter, msg", [
    ("batching,tlv", None, "batching needs a DSpark drafter (confidence head), tlv needs a plain DFlash drafter"),
    ("tree,tlv", None, "no drafter serves both"),
    ("tree,batching", None, "tree needs an EAGLE drafter or an EAGLE-3 drafter or a DFlash2 drafter"),
    ("tlv", "dflash2", "tlv needs a plain DFlash drafter (no CandidateSelector), not a DFlash2 drafter"),
    ("batching", "eagle", "batching needs a DSpark drafter"),
])
def test_combinations_that_cannot_run_together_are_refused(run_cli, tmp_path, bundles, drafter, msg):
    # refused before any environment is probed: no SGLang needed, nothing written
    args = ["apply", bundles, "--python", tmp_path / "nowhere" / "python", "--experimental"]
    code, out, err = run_cli(*args, *(["--drafter", drafter] if drafter else []))
    assert code == 2 and msg in err, err
    assert (f"cannot be applied with --drafter {drafter}:" if drafter else "cannot be applied together:") in err, err


def test_launch_flags_follow_the_drafter(run_cli, env):
    code, out, err = run_cli("apply", "tree", "--python", env, "--dry-run", "--drafter", "eagle",
                             "--set", "node_budget=24", "--format", "json")
    assert code == 0, err
    assert "--speculative-num-draft-tokens 24" in json.loads(out)["activation"]["launch"]
    code, out, err = run_cli("apply", "tree", "--python", env, "--dry-run", "--drafter", "dflash2", "--format", "json")
    res = json.loads(out)
    assert code == 0 and "--speculative-num-draft-tokens" not in res["activation"]["launch"]
    assert any("block size stays the checkpoint's" in n for n in res["notes"])
    code, out, err = run_cli("apply", "tree", "--python", env, "--dry-run", "--format", "json")
    res = json.loads(out)
    assert code == 0 and "--speculative-num-draft-tokens" not in res["activation"]["launch"]
    assert any("give --drafter" in n for n in res["notes"])


def test_settings_and_bundles_that_would_sit_idle_are_warned_about(run_cli, env):
    """tree with lattice-trace runs on DFlash2 only, where the trace keeps the tree verify off and
    node_budget (an EAGLE flag) does nothing: applied (exit 0), with a one-line warning for each."""
    code, out, err = run_cli("apply", "tree,lattice-trace", "--python", env, "--model", "/models/Qwen3-8B",
                             "--set", "node_budget=24", "--dry-run", "--format", "json")
    assert code == 0, err
    warned = err.strip().splitlines()
    assert len(warned) == 2 and all(w.startswith("specpilot: warning: ") for w in warned), err
    assert "tree with lattice-trace on a DFlash2 drafter" in warned[0] and "tree verify stays off" in warned[0]
    assert "--set node_budget=24 has no effect on a DFlash2 drafter" in warned[1]
    res = json.loads(out)
    assert res["warnings"] == [w.removeprefix("specpilot: warning: ") for w in warned]
    assert res["activation"]["drafter"] == "dflash2"
    assert res["notes"][0] == ("no --drafter given: the launch is for dflash2, the only drafter tree, lattice-trace "
                               "all accept")
    # each setting on the drafter it acts on is quiet; on another drafter it is warned about
    for drafter, setting, quiet in (("eagle", "node_budget=24", True), ("dflash2", "dflash_tree_max_batch=8", True),
                                    ("dflash2", "node_budget=24", False), ("eagle3", "dflash_tree_max_batch=8", False)):
        code, out, err = run_cli("apply", "tree", "--python", env, "--drafter", drafter, "--set", setting, "--dry-run")
        assert code == 0 and (err == "") == quiet, (drafter, setting, err)
        assert "no --drafter given" not in out
    # drafter unknown (tree alone fits three): nothing to say about a setting yet
    code, _, err = run_cli("apply", "tree", "--python", env, "--set", "node_budget=24", "--dry-run")
    assert code == 0 and err == ""


def test_apply_help_shows_the_drafter_default_and_an_example_that_acts(run_cli):
    code, out, _ = run_cli("apply", "--help")
    assert code == 0 and "Default: the only drafter every bundle named accepts" in " ".join(out.split())
    assert "tree,lattice-trace)" not in out and "e.g. batching,w12" in out


def test_a_memory_entry_naming_an_unknown_bundle_or_drafter_is_refused(tmp_path):
    import shutil

    import yaml

    from specpilot.bundles import memory as mem
    from specpilot.errors import InputError

    d = tmp_path / "mem"
    shutil.copytree(mem.MEMORY_DIR, d)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    raw["off_with"][0]["bundle"] = "lattice-traces"
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(InputError, match="off_with names 'lattice-traces', not a memory entry"):
        mem.load_memory(d)
    raw["off_with"][0]["bundle"] = "lattice-trace"
    raw["variants"]["node_budget"]["drafters"] = ["medusa"]
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(InputError, match="drafters 'medusa' is not one of"):
        mem.load_memory(d)


def test_a_library_entry_cannot_be_applied(tmp_path):
    import shutil

    import yaml

    from specpilot.bundles import memory as mem
    from specpilot.errors import InputError

    d = tmp_path / "mem"
    shutil.copytree(mem.MEMORY_DIR, d)
    raw = yaml.safe_load((d / "batching.yaml").read_text())
    raw.update(status="library")
    (d / "batching.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(InputError, match="not wired into SGLang"):
        act.apply("batching", memory_dir=d)


def test_apply_replaces_previous_activation(run_cli, env):
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    code, out, _ = run_cli("apply", "lattice-trace", "--python", env, "--format", "json")
    assert code == 0
    res = json.loads(out)
    assert res["previous"] == ["tree"] and res["activation"]["closure"] == ["lattice-trace"]
    assert run_cli("revert", "--python", env)[0] == 0


def test_dry_run_writes_nothing(run_cli, env):
    root = env.parent.parent
    before = tree_digest(root)
    code, out, _ = run_cli("apply", "tree", "--python", env, "--dry-run")
    assert code == 0 and "would write" in out
    assert tree_digest(root) == before


def test_unsupported_version_refused_then_forced(run_cli, tmp_path):
    root = fake_version_root(tmp_path / "sgl", SGL, "0.5.22")
    py = make_env(tmp_path / "env", root)
    code, out, err = run_cli("apply", "tree", "--python", py)
    assert code == 3 and out == ""
    assert err.startswith("specpilot: error: SGLang 0.5.22") and "--force" in err and len(err.strip().splitlines()) == 1
    assert not (purelib(py) / act.ACTIVATION_NAME).exists()
    code, out, err = run_cli("apply", "tree", "--python", py, "--force", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["activation"]["sglang"]["forced"] is True


def test_missing_sglang_and_missing_specpilot(run_cli, tmp_path):
    no_sgl = make_env(tmp_path / "a", None)
    code, _, err = run_cli("apply", "tree", "--python", no_sgl)
    assert code == 3 and "SGLang is not installed" in err
    no_sp = make_env(tmp_path / "b", SGL, with_specpilot=False)
    code, _, err = run_cli("apply", "tree", "--python", no_sp)
    assert code == 3 and "SpecPilot is not installed" in err
    assert not (purelib(no_sp) / act.ACTIVATION_NAME).exists()


@pytest.mark.parametrize("bundles", ["tree,tree", "tree, lattice-trace,tree "])
def test_a_bundle_named_twice_is_refused_before_the_environment_is_probed(run_cli, tmp_path, bundles):
    code, out, err = run_cli("apply", bundles, "--python", tmp_path / "nowhere" / "python", "--dry-run")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"specpilot: error: bundle tree given twice ({bundles}); give it once"), err


@pytest.mark.parametrize("bundles", ["tree,,lattice-trace", "tree,"])
def test_an_empty_bundle_name_is_refused(run_cli, tmp_path, bundles):
    code, out, err = run_cli("apply", bundles, "--python", tmp_path / "nowhere" / "python", "--dry-run")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"an empty bundle name between commas in {bundles!r}" in err, err


@pytest.mark.parametrize("args, msg", [
    (["apply", "nope"], "unknown mechanism 'nope'"),
    (["apply", ","], "name at least one bundle"),
    (["apply", "tlv"], "w12, tlv are experimental"),
    (["apply", "batching", "--set", "shared_budget=-1"], "must be a number in [0, 4096]"),
    (["apply", "batching", "--set", "block_sizes=16"], "must be a non-empty list like [16, 12, 8]"),
    (["apply", "w12"], "experimental"),
    (["apply", "tree", "--set", "node_budget=1"], "must be a number in [2, 256]"),
    (["apply", "tree", "--set", "node_budget=abc"], "must be a number"),
    (["apply", "tree", "--set", "bogus=3"], "not a variant"),
    (["apply", "tree", "--python", "/nonexistent/python"], "no such file"),
    (["apply", "tree", "--python", "/etc/passwd"], "not an executable Python interpreter"),
    (["status", "--python", "/bin/false"], "the probe failed"),
    (["apply", "tree", "--dry-run", "--python", "/bin/ls"], "the probe failed"),   # echoes the probe script back
    (["apply", "lattice-trace", "--dry-run", "--set", "lattice_dir="], "--set lattice_dir=: must not be empty"),
    (["apply", "batching", "--dry-run", "--set", "block_sizes=[-1,2,3]"],
     "block_sizes=[-1,2,3]: each item must be a number in [1, 256]"),
    (["apply", "batching", "--dry-run", "--set", "block_sizes=[0]"], "block_sizes=[0]: each item must be a number in"),
    (["apply", "batching", "--dry-run", "--set", "block_sizes=[3,5,7]"], "must list its items largest first"),
    (["apply", "batching", "--dry-run", "--set", "block_sizes=[12,12]"], "must list its items largest first"),
    (["apply", "batching", "--dry-run", "--set", "block_sizes=[7,5"],
     "--set block_sizes=[7,5: must be a non-empty list like [16, 12, 8] (batching)"),
    (["apply", "tree", "--python", ""], "--python: empty path"),
    (["status", "--python", ""], "--python: empty path"),
    (["revert", "--python", ""], "--python: empty path"),
])
def test_bad_input_exit_2(run_cli, env, args, msg):
    if "--python" not in args:
        args = args + ["--python", str(env)]
    if "--python" in args and not Path(args[args.index("--python") + 1]).exists() and "nonexistent" not in str(args):
        pytest.skip("system file not present here")
    code, out, err = run_cli(*args)
    assert code == 2, err
    assert err.startswith("specpilot: error:") and msg in err and len(err.strip().splitlines()) == 1
    assert len(err) < 400, err   # one readable line, not a program's whole complaint


def _env_with_own_speculative(tmp_path) -> tuple[Path, Path]:
    """(python, speculative folder): an environment whose SGLang is the real one except for a copy
    of ``sglang/srt/speculative`` that a test may edit."""
    import shutil

    root = tmp_path / "sgl"
    shutil.copytree(SGL / "sglang" / "srt" / "speculative", root / "sglang" / "srt" / "speculative")
    # a root with the real package as a symlink, except eagle_utils.py which we edit after apply
    root2 = tmp_path / "sgl2"
    (root2 / "sglang").mkdir(parents=True)
    for item in (SGL / "sglang").iterdir():
        if item.name != "srt":
            (root2 / "sglang" / item.name).symlink_to(item)
    (root2 / "sglang" / "srt").mkdir()
    for item in (SGL / "sglang" / "srt").iterdir():
        if item.name != "speculative":
            (root2 / "sglang" / "srt" / item.name).symlink_to(item)
    (root2 / "sglang" / "srt" / "speculative").symlink_to(root / "sglang" / "srt" / "speculative")
    shutil.copytree(next(SGL.glob("sglang-*.dist-info")), root2 / "sglang-0.5.23.dist-info")
    return make_env(tmp_path / "env", root2), root / "sglang" / "srt" / "speculative"


def test_status_detects_drift(run_cli, tmp_path):
    """Status fails (exit 1) when the installed SGLang changed under an activation."""
    py, spec = _env_with_own_speculative(tmp_path)
    assert run_cli("apply", "tree", "--python", py)[0] == 0
    f = spec / "eagle_utils.py"
    f.write_text(f.read_text().replace("    num_draft_token: int,\n):\n    # b, n, topk",
                                       "    num_draft_token: int,\n    extra,\n):\n    # b, n, topk"))
    code, out, err = run_cli("status", "--python", py, "--format", "json")
    assert code == 1
    problems = json.loads(out)["problems"]
    assert any("organize_draft_results" in p and "not compatible" in p for p in problems)
    # and apply now refuses: the target no longer matches, so status suggests revert, not apply
    code, _, err = run_cli("apply", "tree", "--python", py)
    assert code == 3 and "do not match" in err
    code, out, _ = run_cli("status", "--python", py)
    assert code == 1 and "1 hook target(s) no longer match this SGLang" in out, out
    assert "specpilot apply" not in out and out.rstrip().endswith(f"specpilot revert --python {py}"), out


@pytest.mark.parametrize("name, tail", [("eagle_utils.py", b"def broken(:\n"), ("dflash_info.py", b"\xff\xfe\x00")])
def test_a_target_file_that_does_not_parse_is_a_problem_not_a_crash(run_cli, tmp_path, name, tail):
    py, spec = _env_with_own_speculative(tmp_path)
    assert run_cli("apply", "tree", "--python", py)[0] == 0
    (spec / name).write_bytes((spec / name).read_bytes() + tail)
    code, out, err = run_cli("status", "--python", py, "--format", "json")
    assert code == 1, err
    assert any(f"{name} does not parse" in p for p in json.loads(out)["problems"]), out
    code, _, err = run_cli("apply", "tree", "--python", py, "--dry-run")
    assert code == 3 and f"{name} does not parse" in err and len(err.strip().splitlines()) == 1
    if name == "eagle_utils.py":   # a hook target and a symbol in that file: both named, the problem once
        assert ("1 hook target(s) and 1 symbol(s) do not match: sglang.srt.speculative.eagle_utils."
                "organize_draft_results, sglang.srt.speculative.eagle_utils.build_tree_kernel_efficient: "
                "target ") in err and "eagle_utils.py does not parse" in err, err
        assert err.count("does not parse") == 1 and "an activation already there stays as it was" in err, err
    code, out, err = run_cli("memory", "verify", "tree", "--python", py)
    assert code == 1 and f"{name} does not parse" in out, err


@pytest.mark.parametrize("answer", ["{}", "[1,2]", '"x"', '{"executable": "a", "python": "3.11.7", "prefix": "/p", '
                                    '"purelib": "/p", "sglang": "weird", "specpilot": null}'])
@pytest.mark.parametrize("verb", [["status"], ["apply", "tree"], ["revert"]])
def test_an_interpreter_that_answers_something_else_is_bad_input(run_cli, tmp_path, monkeypatch, answer, verb):
    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/sh\necho '{answer}'\n")
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)  # "./py": a relative path is run as given, not looked up on $PATH
    code, _, err = run_cli(*verb, "--python", "./py")
    assert code == 2 and err.strip() == "specpilot: error: --python ./py: unexpected probe output", err


def test_an_activation_path_that_is_a_folder_is_named(run_cli, env):
    path = purelib(env) / act.ACTIVATION_NAME
    path.mkdir()
    try:
        for args in (["apply", "tree"], ["apply", "tree", "--dry-run"], ["status"], ["revert"]):
            code, out, err = run_cli(*args, "--python", env)
            assert code == 2 and err.strip() == (f"specpilot: error: {path}: the activation file is a folder; "
                                                 "SpecPilot did not write it, remove it by hand"), (args, err)
        assert path.is_dir()
    finally:
        path.rmdir()


def test_status_says_what_is_missing(run_cli, env, tmp_path):
    no_sgl = make_env(tmp_path / "a", None)
    code, out, _ = run_cli("status", "--python", no_sgl)
    assert code == 0 and out.strip().endswith("absent); SGLang is not installed there"), out
    code, out, _ = run_cli("status", "--python", env)
    assert code == 0 and out.strip().endswith("absent); SGLang 0.5.23 runs stock"), out
    # an activation left behind in an environment SpecPilot was removed from: its modules went with it
    no_sp = make_env(tmp_path / "b", SGL, with_specpilot=False)
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    try:
        (purelib(no_sp) / act.ACTIVATION_NAME).write_text((purelib(env) / act.ACTIVATION_NAME).read_text())
    finally:
        assert run_cli("revert", "--python", env)[0] == 0
    code, out, _ = run_cli("status", "--python", no_sp, "--format", "json")
    assert code == 1
    assert json.loads(out)["problems"] == ["SpecPilot is no longer installed there: SGLang will not load the plugin"]
    code, out, _ = run_cli("status", "--python", no_sp)   # apply alone cannot mend it: what it needs first
    assert code == 1 and "install SpecPilot there again, then apply it again to this environment:" in out, out
    # the same left in an environment whose SGLang went away (apply would be exit 3: no SGLang)
    (purelib(no_sgl) / act.ACTIVATION_NAME).write_text((purelib(no_sp) / act.ACTIVATION_NAME).read_text())
    code, out, _ = run_cli("status", "--python", no_sgl)
    assert code == 1 and "problem: SGLang is no longer installed" in out, out
    assert "install SGLang there again, then apply it again to this environment:" in out, out


def test_status_on_a_damaged_activation_is_bad_input_or_a_problem(run_cli, env):
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    path = purelib(env) / act.ACTIVATION_NAME
    good = json.loads(path.read_text())
    gone = object()  # the key deleted
    try:
        for damage, field in (({"closure": None}, "closure"), ({"hooks": 5}, "hooks"), ({"hooks": [{"type": 1}]}, "hooks"),
                              ({"bundles": [3]}, "bundles"), ({"targets": []}, "targets"),
                              ({"fingerprints": gone}, "fingerprints"), ({"targets": gone}, "targets"),
                              ({"quantization": "x"}, "quantization"), ({"launch": 5}, "launch"),
                              ({"drafter": 7}, "drafter"), ({"drafter": "medusa"}, "drafter"),
                              ({"sglang": {"forced": "yes"}}, "sglang"), ({"setup": "x"}, "setup")):
            damaged = {k: v for k, v in dict(good, **damage).items() if v is not gone}
            path.write_text(json.dumps(damaged))
            code, _, err = run_cli("status", "--python", env)
            assert code == 2 and f"malformed activation ({field} missing or of the wrong type)" in err, err
        path.write_text(json.dumps(dict(good, bundles=["nope"])))
        code, _, err = run_cli("status", "--python", env)
        assert code == 2 and "malformed activation (bundles: 'nope' not in closure)" in err, err
        path.write_text(json.dumps({"schema": good["schema"]}))
        assert run_cli("status", "--python", env)[0] == 2
        path.write_text(json.dumps(dict(good, settings=dict(good["settings"], node_budget="abc"))))
        code, out, err = run_cli("status", "--python", env, "--format", "json")
        assert code == 1 and any("setting node_budget='abc': must be a number in" in p
                                 for p in json.loads(out)["problems"]), out
    finally:
        path.write_text(json.dumps(good))
        assert run_cli("revert", "--python", env)[0] == 0


_KILL_AT_RENAME = r"""
import os, signal, sys
real = os.replace
def dying_replace(src, dst):
    if str(dst).endswith("specpilot_activation.json"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
os.replace = dying_replace
from specpilot.cli import main
main(sys.argv[1:])
"""


def _state(site: Path):
    p = site / act.ACTIVATION_NAME
    return None if not p.exists() else json.loads(p.read_text())["closure"]


def test_kill_during_apply_leaves_old_or_new_state(run_cli, env, tmp_path):
    site = purelib(env)
    root = env.parent.parent
    assert run_cli("revert", "--python", env)[0] == 0
    stock = tree_digest(root)
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    old = tree_digest(root)
    # 1) killed at the worst moment: the new file fully written, not yet renamed
    proc = subprocess.run([sys.executable, "-c", _KILL_AT_RENAME, "apply", "lattice-trace", "--python", str(env)],
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    assert _state(site) == ["tree"]                      # the old state
    assert list(site.glob(f".{act.ACTIVATION_NAME}.*.part"))  # a leftover temporary file
    code, out, _ = run_cli("status", "--python", env)
    assert code == 0 and not list(site.glob(f".{act.ACTIVATION_NAME}.*.part"))  # swept
    assert tree_digest(root) == old
    # 2) killed at arbitrary times: always the old or the new state, never a broken file
    for delay in (0.05, 0.6):
        p = subprocess.Popen([sys.executable, "-m", "specpilot", "apply", "lattice-trace", "--python", str(env)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        state = _state(site)  # parses: never a half-written file
        assert state in (["tree"], ["lattice-trace"])
        assert run_cli("apply", "tree", "--python", env)[0] == 0  # back to old; sweeps leftovers
    assert set(tree_digest(root)) == set(old)  # same files (the new one differs only in applied_at)
    assert run_cli("revert", "--python", env)[0] == 0
    assert tree_digest(root) == stock


def test_concurrent_commands_are_serialized(env):
    site = purelib(env)
    with act.locked(site):
        with pytest.raises(act.EnvironmentMissing, match="holds"):
            with act.locked(site, timeout=0.2):
                pass
    with act.locked(site, timeout=0.2):  # released
        pass


def test_other_plugins_stay_enabled_in_the_launch_command(run_cli, env, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "xpu_hooks")
    code, out, _ = run_cli("apply", "tree", "--python", env, "--dry-run", "--format", "json")
    assert code == 0 and json.loads(out)["activation"]["launch"].startswith("SGLANG_PLUGINS=specpilot,xpu_hooks ")


def test_the_launch_command_keeps_the_environments_other_plugins(run_cli, env, monkeypatch):
    """With SGLANG_PLUGINS unset SGLang loads every installed plugin: the launch line names them
    all beside SpecPilot's (naming only SpecPilot's turned the others off)."""
    import shutil

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    dist = purelib(env) / "otherplug-1.0.dist-info"
    dist.mkdir()
    try:
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: otherplug\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nother = os:getcwd\n")
        code, out, _ = run_cli("apply", "tree", "--python", env, "--dry-run", "--format", "json")
        assert code == 0 and json.loads(out)["activation"]["launch"].startswith("SGLANG_PLUGINS=specpilot,other ")
    finally:
        shutil.rmtree(dist)
    code, out, _ = run_cli("apply", "tree", "--python", env, "--dry-run", "--format", "json")
    assert code == 0 and json.loads(out)["activation"]["launch"].startswith("SGLANG_PLUGINS=specpilot ")


def test_refuses_a_target_with_a_different_specpilot(run_cli, env, monkeypatch):
    real = act.probe

    def other_specpilot(python=None, timeout=60.0, modules=()):
        e = real(python, timeout, modules)
        e.fingerprints = {m: "sha256:" + "2" * 64 for m in e.fingerprints}
        return e

    monkeypatch.setattr(act, "probe", other_specpilot)
    code, _, err = run_cli("apply", "tree", "--python", env)
    assert code == 3 and "differs from this one" in err and f"{env} -m specpilot apply tree" in err
    assert not (purelib(env) / act.ACTIVATION_NAME).exists()


def test_a_rounds_candidate_launch_carries_applys_warnings(env, tmp_path):
    """A round starts candidate servers through apply's checks (activation_launch): a setting that
    will not act on the deployment's drafter is in the candidate's notes, as apply warns."""
    from types import SimpleNamespace

    from specpilot.auditors.round.sglang import activation_launch

    dep = SimpleNamespace(python=str(env), experimental=False, raw={"model_path": "/models/Qwen3-8B"},
                          facts=SimpleNamespace(drafter="dflash2"))
    launch, notes = activation_launch(dep, ["tree"], {"node_budget": 24}, tmp_path, "tree")
    assert "SPECPILOT_ACTIVATION=" in launch and (tmp_path / "tree.activation.json").is_file()
    assert any(n.startswith("warning: ") and "node_budget=24 has no effect on a DFlash2 drafter" in n for n in notes)


def test_status_with_a_problem_gives_no_launch_command(run_cli, tmp_path):
    """An activation that no longer matches (here: applied to another SGLang version) gets what
    to do instead of its launch command: apply the same bundles again, or revert."""
    py = make_env(tmp_path / "env", SGL)
    assert run_cli("apply", "tree", "--python", py, "--drafter", "eagle", "--set", "node_budget=24")[0] == 0
    code, out, _ = run_cli("status", "--python", py)
    assert code == 0 and "launch with:" in out and "SGLANG_PLUGINS=specpilot" in out, out
    path = purelib(py) / act.ACTIVATION_NAME
    data = json.loads(path.read_text())
    data["sglang"]["version"] = "0.5.22"
    path.write_text(json.dumps(data))
    code, out, _ = run_cli("status", "--python", py)
    assert code == 1 and "problem: SGLang is 0.5.23, the activation was applied to 0.5.22" in out, out
    assert "launch with:" not in out and "SGLANG_PLUGINS" not in out, out
    assert "do not launch with this activation" in out, out
    assert f"  specpilot apply tree --python {py} --drafter eagle --set node_budget=24\n" in out, out
    assert out.rstrip().endswith(f"or remove it:\n  specpilot revert --python {py}"), out


def test_status_and_revert_never_write_their_report_over_the_activation(run_cli, env):
    code, _, err = run_cli("apply", "tree", "--python", env)
    assert code == 0, err
    path = purelib(env) / act.ACTIVATION_NAME
    before = path.read_bytes()
    for verb in ("status", "revert"):
        code, out, err = run_cli(verb, "--python", env, "--out", path)
        refused(code, err, "that is the activation file")
        assert path.read_bytes() == before and out == ""
    code, _, err = run_cli("revert", "--python", env)
    assert code == 0 and not path.exists()
    code, _, err = run_cli("revert", "--python", env, "--out", path)   # absent: a report there would be one too
    refused(code, err, "that is the activation file")
    assert not path.exists()


@pytest.mark.parametrize("field, value, words", [
    ("setup", ["os:abort"], "setup functions"),
    ("setup", [], "setup functions"),
    ("quantization", [], "quantization methods"),
])
def test_an_activation_whose_setup_or_quantization_differs_from_its_bundles_is_refused(run_cli, env, field, value,
                                                                                       words):
    """The plugin calls every setup function the activation names: only the bundles' own run."""
    from specpilot.bundles import plugin

    code, _, err = run_cli("apply", "w12", "--python", env, "--experimental")
    assert code == 0, err
    path = purelib(env) / act.ACTIVATION_NAME
    data = json.loads(path.read_text())
    assert data["setup"] and data["quantization"] == ["w12"]
    data[field] = value
    path.write_text(json.dumps(data))
    code, out, err = run_cli("status", "--python", env, "--format", "json")
    st = json.loads(out)
    assert code == 1 and not st["matches"], err
    assert any(f"the activation's {words} are not its bundles'" in p for p in st["problems"]), st["problems"]
    with pytest.raises(plugin.ActivationError, match=f"the activation's {words} are not its bundles'"):
        plugin.plan(data, data["sglang"]["version"])
    assert run_cli("revert", "--python", env)[0] == 0
