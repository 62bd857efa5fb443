"""apply / status / revert: the re-apply command status suggests, what the activation path may be
(a report, a link, a deeply nested file), read-only site-packages, signals after the rename,
strict --set values and the notes' quoting (against the real SGLang 0.5.23 wheel)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
from pathlib import Path

import pytest

from specpilot.bundles import activation as act
from sglang_support import SKIP_REASON, make_env, purelib, sglang_dir
from sglang_support import env_fixture  # noqa: F401  (the env fixture: a target environment per module)

SGL = sglang_dir()
pytestmark = pytest.mark.skipif(SGL is None, reason=SKIP_REASON)


@pytest.fixture
def clean(run_cli, env):
    """The environment with nothing active before and after the test."""
    path = purelib(env) / act.ACTIVATION_NAME
    yield path
    if path.is_symlink() or path.is_file():
        path.unlink()
    for p in purelib(env).glob(f".{act.ACTIVATION_NAME}.*.part"):
        p.unlink()


def _env_with_own_speculative(tmp_path) -> tuple[Path, Path]:
    """(python, speculative folder): the real SGLang but for a copy of sglang/srt/speculative."""
    import shutil

    own = tmp_path / "sgl" / "sglang" / "srt" / "speculative"
    shutil.copytree(SGL / "sglang" / "srt" / "speculative", own)
    root = tmp_path / "sgl2"
    (root / "sglang" / "srt").mkdir(parents=True)
    for item in (SGL / "sglang").iterdir():
        if item.name != "srt":
            (root / "sglang" / item.name).symlink_to(item)
    for item in (SGL / "sglang" / "srt").iterdir():
        if item.name != "speculative":
            (root / "sglang" / "srt" / item.name).symlink_to(item)
    (root / "sglang" / "srt" / "speculative").symlink_to(own)
    shutil.copytree(next(SGL.glob("sglang-*.dist-info")), root / "sglang-0.5.23.dist-info")
    return make_env(tmp_path / "env", root), own


def test_the_reapply_command_status_suggests_runs(run_cli, tmp_path):
    py, spec = _env_with_own_speculative(tmp_path)
    code, _, err = run_cli("apply", "tree,w12", "--experimental", "--drafter", "eagle", "--python", py,
                           "--model", "/models/My Model", "--set", "node_budget=24")
    assert code == 0, err
    f = spec / "eagle_utils.py"
    f.write_text(f.read_text() + "\n# edited after apply\n")
    code, out, _ = run_cli("status", "--python", py)
    assert code == 1 and "eagle_utils.py changed since apply" in out, out
    lines = out.splitlines()
    suggested = lines[lines.index("do not launch with this activation; apply it again to this environment:") + 1]
    words = shlex.split(suggested)
    assert words[:2] == ["specpilot", "apply"] and "--experimental" in words, suggested
    assert words[words.index("--model") + 1] == "/models/My Model" and "node_budget=24" in words, suggested
    code, out, err = run_cli(*words[1:])
    assert code == 0, err
    assert ("--model-path '/models/My Model' --speculative-num-steps 5 --speculative-eagle-topk 4 "
            "--speculative-num-draft-tokens 24 --quantization w12") in out, out
    code, out, err = run_cli("status", "--python", py)
    assert code == 0 and "the activation matches" in out, (out, err)


def test_the_reapply_command_of_an_older_activation_reads_its_launch(run_cli, clean, env):
    """An activation written before apply recorded model and experimental: both from its launch
    command and the memory."""
    from specpilot.commands.status import reapply_command

    assert run_cli("apply", "tree,w12", "--experimental", "--drafter", "eagle", "--python", env,
                   "--model", "/m/x y")[0] == 0
    data = json.loads(clean.read_text())
    for k in ("model", "experimental"):
        data.pop(k)
    cmd, left_out = reapply_command(data, str(env))
    assert "--model '/m/x y'" in cmd and "--experimental" in cmd and left_out == [], cmd
    assert run_cli(*shlex.split(cmd)[1:])[0] == 0


@pytest.mark.parametrize("damage, left", [
    ({"settings": {"node_budget": "x"}}, "setting node_budget=x"),
    ({"settings": {"zzz": 1}}, "setting zzz=1"),
    ({"bundles": ["tree", "zzz"], "closure": ["tree", "zzz"]}, "bundle zzz"),
    # valid one by one, refused together: eagle's 5 steps x top-4 draft 68 tokens, 80 nodes need 79
    ({"settings": {"node_budget": 80}}, "setting node_budget=80"),
    ({"drafter": "dspark"}, "--drafter dspark"),
])
def test_the_reapply_command_leaves_out_what_apply_would_refuse(run_cli, clean, env, damage, left):
    """An activation whose settings or bundles this SpecPilot refuses: status suggested an apply
    command that was then refused (exit 2); it leaves them out, says so, and the command runs."""
    assert run_cli("apply", "tree", "--drafter", "eagle", "--python", env)[0] == 0
    data = json.loads(clean.read_text())
    for k, v in damage.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    data["sglang"]["version"] = "0.0.1"   # so that status finds a mismatch and suggests the command
    clean.write_text(json.dumps(data))
    code, out, _ = run_cli("status", "--python", env)
    assert code == 1, out
    lines = out.splitlines()
    cmd = lines[lines.index("do not launch with this activation; apply it again to this environment:") + 1]
    assert lines[lines.index(cmd) + 1] == f"  (left out, as this SpecPilot's memory would refuse them: {left})"
    code, _, err = run_cli(*shlex.split(cmd)[1:])
    assert code == 0, err


@pytest.mark.parametrize("damage, problem", [
    ({"drafter": "dspark"}, "tree needs"),
    ({"bundles": ["tree", "tree"], "closure": ["tree", "tree"]}, "bundle tree is listed twice"),
    ({"fingerprints": {}}, "its module fingerprints do not name its bundles' modules"),
])
def test_status_and_the_plugin_refuse_an_activation_apply_could_not_write(run_cli, clean, env, damage, problem):
    """A hand-edited activation: status said it matched (and printed a launch line with every flag
    twice) and the plugin registered its hooks, where apply refuses the same bundles and drafter; an
    empty fingerprint map let the plugin compare no module at all."""
    from specpilot.bundles import plugin

    assert run_cli("apply", "tree", "--drafter", "eagle", "--python", env)[0] == 0
    data = {**json.loads(clean.read_text()), **damage}
    clean.write_text(json.dumps(data))
    code, out, _ = run_cli("status", "--python", env)
    assert code == 1 and problem in out and "the activation matches" not in out, out
    with pytest.raises(plugin.ActivationError, match=problem):
        plugin.plan(data, "0.5.23")
    del data["fingerprints"]   # status: a malformed activation; the plugin registered every hook
    with pytest.raises(plugin.ActivationError, match="fingerprints"):
        plugin.plan(data, "0.5.23")


def test_status_of_an_activation_of_only_unknown_bundles_suggests_revert(run_cli, clean, env):
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    data = json.loads(clean.read_text())
    data["bundles"] = data["closure"] = ["zzz"]
    data["sglang"]["version"] = "0.0.1"
    clean.write_text(json.dumps(data))
    code, out, _ = run_cli("status", "--python", env)
    assert code == 1 and "this SpecPilot knows none of its bundles (bundle zzz); remove it:" in out, out
    assert "apply it again" not in out


@pytest.mark.parametrize("how", ["same", "link", "relative"])
def test_apply_refuses_an_out_that_is_the_activation_file(run_cli, clean, env, tmp_path, monkeypatch, how):
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    before = clean.read_text()
    out = clean
    if how == "link":
        out = tmp_path / "report.json"
        out.symlink_to(clean)
    elif how == "relative":
        monkeypatch.chdir(clean.parent)
        out = Path(act.ACTIVATION_NAME)
    for extra in ([], ["--dry-run"]):
        code, stdout, err = run_cli("apply", "lattice-trace", "--python", env, "--format", "json", "--out", out, *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--out {out}: that is the activation file ({clean})" in err, err
        assert clean.read_text() == before


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_activation_is_renamed_into_place_is_success(run_cli, clean, env, monkeypatch, signame):
    real = os.replace

    def replace(a, b, *args, **kw):
        real(a, b, *args, **kw)
        if os.fspath(b) == os.fspath(clean):
            os.kill(os.getpid(), getattr(signal, signame))

    monkeypatch.setattr(os, "replace", replace)
    code, out, err = run_cli("apply", "tree", "--drafter", "eagle", "--python", env)
    monkeypatch.undo()
    assert code == 0, err
    assert err.strip() == f"specpilot: {signame} came after {clean} was written; the activation is in place", err
    assert "launch with" in out and json.loads(clean.read_text())["closure"] == ["tree"]


def test_a_signal_while_the_apply_report_is_written_is_success(run_cli, clean, env, monkeypatch):
    from specpilot.commands import apply as cmd

    real = cmd.emit

    def emit(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        real(*a, **kw)

    monkeypatch.setattr(cmd, "emit", emit)
    code, _, err = run_cli("apply", "tree", "--python", env)
    monkeypatch.undo()
    assert code == 0 and f"{clean} is written (the activation is in place), its report was not" in err, err
    assert json.loads(clean.read_text())["closure"] == ["tree"]


def test_a_signal_before_the_rename_still_stops_the_apply(run_cli, clean, env, monkeypatch):
    from specpilot import fileio

    real = fileio.os.fsync

    def fsync(fd):
        real(fd)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    code, _, err = run_cli("apply", "tree", "--python", env)
    monkeypatch.undo()
    assert code == 130 and "interrupted by SIGINT" in err and not os.path.lexists(clean), err
    assert not list(clean.parent.glob(f".{act.ACTIVATION_NAME}.*.part"))


def test_a_deeply_nested_activation_is_a_malformed_one_that_revert_removes(run_cli, clean, env):
    clean.write_text("[" * 100000 + "]" * 100000)
    for args in (["status"], ["apply", "tree"], ["apply", "tree", "--dry-run"]):
        code, _, err = run_cli(*args, "--python", env)
        assert code == 2 and err.strip() == (f"specpilot: error: {clean}: malformed activation (nested too deeply); "
                                             "run 'specpilot revert' to remove it"), (args, err)
    code, out, err = run_cli("revert", "--python", env)
    assert code == 0 and f"removed {clean}: (unreadable activation) no longer active" in out, (out, err)
    assert not clean.exists()


def _read_only(monkeypatch, folder: Path):
    """``folder`` as a read-only file system shows it: access(W_OK) false, unlink EROFS."""
    real_access, real_unlink = os.access, Path.unlink

    def access(path, mode, *a, **kw):
        if Path(path) == folder and mode & os.W_OK:
            return False
        return real_access(path, mode, *a, **kw)

    def unlink(self, *a, **kw):
        if self.parent == folder:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(Path, "unlink", unlink)


def test_revert_on_a_read_only_site_packages_is_a_missing_environment(run_cli, clean, env, monkeypatch):
    purelib = clean.parent
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    leftover = purelib / f".{act.ACTIVATION_NAME}.x1y2.part"
    leftover.write_text("{")
    _read_only(monkeypatch, purelib)
    want = f"specpilot: error: {purelib} is not writable; run as the environment's owner"
    # the dry run too: it says whether apply would succeed (it said "would write", exit 0)
    for verb in (["revert"], ["apply", "tree"], ["apply", "tree", "--dry-run"]):
        code, out, err = run_cli(*verb, "--python", env)
        assert code == 3 and err.strip() == want, (verb, err)
    assert clean.is_file() and leftover.is_file()
    code, out, err = run_cli("status", "--python", env)   # status reads; it sweeps only where it may write
    assert code == 0, err
    # nothing to remove: nothing refused
    monkeypatch.undo()
    leftover.unlink()
    clean.unlink()
    _read_only(monkeypatch, purelib)
    code, out, err = run_cli("revert", "--python", env)
    assert code == 0 and "nothing was active" in out, err
    # a leftover alone is refused too (sweep_partial)
    monkeypatch.undo()
    leftover.write_text("{")
    _read_only(monkeypatch, purelib)
    code, _, err = run_cli("revert", "--python", env)
    assert code == 3 and err.strip() == want, err
    monkeypatch.undo()
    leftover.unlink()


def test_revert_where_the_unlink_is_refused_is_a_missing_environment(run_cli, clean, env, monkeypatch):
    """access() may say yes where the file system says no (root on a read-only mount)."""
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    real_unlink = Path.unlink

    def unlink(self, *a, **kw):
        if self == clean:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr(Path, "unlink", unlink)
    code, _, err = run_cli("revert", "--python", env)
    assert code == 3 and err.strip() == (f"specpilot: error: {clean.parent} is not writable (Read-only file "
                                         "system); run as the environment's owner"), err
    monkeypatch.undo()
    assert clean.is_file()


def test_a_symlinked_activation_is_refused_and_its_target_never_written(run_cli, clean, env, tmp_path):
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    outside = tmp_path / "elsewhere.json"
    outside.write_text(clean.read_text())
    clean.unlink()
    clean.symlink_to(outside)
    before = outside.read_text()
    want = (f"specpilot: error: {clean}: the activation file is a symbolic link (to {outside}); SpecPilot did not "
            "write it, remove it by hand")
    for args in (["apply", "lattice-trace"], ["apply", "tree", "--dry-run"], ["status"], ["revert"]):
        code, _, err = run_cli(*args, "--python", env)
        assert code == 2 and err.strip() == want, (args, err)
    assert clean.is_symlink() and outside.read_text() == before
    clean.unlink()
    clean.symlink_to(tmp_path / "dangling.json")   # a dangling link: not written through either
    assert run_cli("apply", "tree", "--python", env)[0] == 2 and not (tmp_path / "dangling.json").exists()


@pytest.mark.parametrize("setting, msg", [
    ("node_budget=0x18", "--set node_budget=0x18: must be a number in [2, 256] (tree)"),
    ("node_budget=0b11", "--set node_budget=0b11: must be a number in [2, 256] (tree)"),
    ("node_budget=0o30", "--set node_budget=0o30: must be a number in [2, 256] (tree)"),
    ("node_budget=2_4", "--set node_budget=2_4: must be a number in [2, 256] (tree)"),
    ("node_budget=24.0", "--set node_budget=24.0: must be an integer (tree)"),
    ("node_budget=2.4e1", "--set node_budget=2.4e1: must be an integer (tree)"),
    ("node_budget=.inf", "--set node_budget=.inf: must be a number in [2, 256] (tree)"),
    ("node_budget=yes", "--set node_budget=yes: must be a number in [2, 256] (tree)"),
    ("node_budget=true", "--set node_budget=true: must be a number in [2, 256] (tree)"),
])
def test_set_values_are_read_strictly(run_cli, env, setting, msg):
    code, _, err = run_cli("apply", "tree", "--python", env, "--dry-run", "--set", setting)
    assert code == 2 and err.strip() == f"specpilot: error: {msg}", err


@pytest.mark.parametrize("setting, msg", [
    ("block_sizes=[0x10,8]", "block_sizes=[0x10,8]: must be a non-empty list like [16, 12, 8]"),
    ("block_sizes=[12.0,8]", "block_sizes=[12.0,8]: must be a non-empty list like [16, 12, 8]"),
    ("block_sizes=[7,5", "block_sizes=[7,5: must be a non-empty list like [16, 12, 8]"),
    ("block_sizes=[]", "block_sizes=[]: must be a non-empty list like [16, 12, 8]"),
    ("block_sizes=[7,,5]", "block_sizes=[7,,5]: must be a non-empty list like [16, 12, 8]"),
])
def test_list_values_are_read_strictly(run_cli, env, setting, msg):
    code, _, err = run_cli("apply", "batching", "--python", env, "--dry-run", "--set", setting)
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_a_setting_given_twice_is_refused(run_cli, env):
    code, _, err = run_cli("apply", "tree", "--python", env, "--dry-run", "--set", "node_budget=24",
                           "--set", "node_budget=32")
    assert code == 2 and err.strip() == ("specpilot: error: --set node_budget given twice (node_budget=24 and "
                                         "node_budget=32); give it once"), err


def test_plain_values_are_read(run_cli, env):
    code, out, err = run_cli("apply", "tree", "--python", env, "--dry-run", "--format", "json", "--drafter",
                             "eagle", "--set", "node_budget= 24")
    assert code == 0 and json.loads(out)["activation"]["settings"]["node_budget"] == 24, err
    code, out, err = run_cli("apply", "batching", "--python", env, "--dry-run", "--format", "json",
                             "--set", "block_sizes=[ 12, 8 ]", "--set", "shared_budget=+128")
    settings = json.loads(out)["activation"]["settings"]
    assert code == 0 and settings["block_sizes"] == [12, 8] and settings["shared_budget"] == 128, err


def test_the_lattice_trace_note_quotes_its_folder(run_cli, env):
    code, out, err = run_cli("apply", "lattice-trace", "--python", env, "--dry-run", "--format", "json",
                             "--set", "lattice_dir=a b")
    assert code == 0, err
    res = json.loads(out)
    assert "SPECPILOT_LATTICE_DIR='a b'" in res["activation"]["launch"]
    note = next(n for n in res["notes"] if n.startswith("lattice-trace: "))
    assert "cat 'a b'/lattice-*.jsonl > run.lattice.jsonl" in note, note


def test_the_lattice_trace_note_takes_a_folder_starting_with_a_dash_as_a_path(run_cli, env):
    """lattice_dir=-rf: the note's command was `cat -rf/lattice-*.jsonl` (an option to cat)."""
    code, out, err = run_cli("apply", "lattice-trace", "--python", env, "--dry-run", "--format", "json",
                             "--set", "lattice_dir=-rf")
    assert code == 0, err
    note = next(n for n in json.loads(out)["notes"] if n.startswith("lattice-trace: "))
    assert "cat ./-rf/lattice-*.jsonl > run.lattice.jsonl" in note, note


def test_a_report_onto_the_target_interpreter_is_refused(run_cli, clean, env, tmp_path):
    """--out naming --python's interpreter (or a link to it) replaced the interpreter with the report,
    exit 0: the verbs protected the activation file alone."""
    # a wrapper stands for the interpreter: were the report written over it, no real Python is lost
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nexec {env} \"$@\"\n")
    py.chmod(0o755)
    before = py.read_bytes()
    link = tmp_path / "link"
    link.symlink_to(py)
    for args in (("apply", "tree", "--drafter", "eagle", "--python", py, "--dry-run"),
                 ("apply", "tree", "--drafter", "eagle", "--python", py),
                 ("status", "--python", py), ("revert", "--python", py),
                 ("memory", "verify", "tree", "--python", py)):
        for out in (py, link):
            code, _, err = run_cli(*args, "--out", out)
            # refused as a program (any --out) or as the verb's input
            assert code == 2 and (f"--out {out}: refusing to overwrite input file" in err
                                  or "is a program, not a file to write a report over" in err), (args, err)
            assert py.read_bytes() == before
    assert not clean.exists()


def test_a_report_onto_a_file_of_the_target_sglang_is_refused(run_cli, tmp_path):
    """status --out onto a hook target's file (SGLang's own, which status reads) replaced it, exit 0,
    and apply then failed on a target that did not parse."""
    py, spec = _env_with_own_speculative(tmp_path)
    target = tmp_path / "sgl2" / "sglang" / "srt" / "speculative" / "eagle_utils.py"
    before = (spec / "eagle_utils.py").read_bytes()
    for args in (("status",), ("revert",), ("apply", "tree", "--drafter", "eagle", "--dry-run")):
        code, _, err = run_cli(*args, "--python", py, "--out", target)
        assert code == 2 and "refusing to overwrite a file of input folder" in err, (args, err)
    assert (spec / "eagle_utils.py").read_bytes() == before
