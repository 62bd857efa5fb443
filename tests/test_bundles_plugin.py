"""The SGLang plugin: what ``register`` installs, through SGLang 0.5.23's real HookRegistry."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from specpilot.bundles import activation as act
from specpilot.bundles import plugin
from sglang_support import SKIP_REASON, fresh_hook_registry, make_env, sglang_dir

SGL = sglang_dir()
pytestmark = pytest.mark.skipif(SGL is None, reason=SKIP_REASON)


@pytest.fixture
def hooks():
    """A fresh copy of SGLang's hook_registry module (stdlib-only imports)."""
    with fresh_hook_registry(SGL, "_sp_hook_registry_under_test") as mod:
        yield mod


@pytest.fixture(scope="module")
def activation_of(tmp_path_factory):
    py = make_env(tmp_path_factory.mktemp("plugenv") / "env", SGL)

    def _make(bundles, where):
        res = act.apply(bundles, python=str(py), dry_run=True)
        path = where / "activation.json"
        path.write_text(json.dumps(res.activation))
        return path, res.activation

    return _make


def test_registers_exactly_the_applied_hooks(hooks, activation_of, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.23")
    path, activation = activation_of("tree,lattice-trace", tmp_path)
    done = plugin.register(hooks.HookRegistry, hooks.HookType, path)
    reg = hooks.HookRegistry._hooks
    assert set(reg) == {h["target"] for h in activation["hooks"]}
    # tree and lattice-trace both hook build_lattice and forward_batch_generation: one entry each
    got = sorted((t, kind.value, fn.__module__ + ":" + fn.__name__) for t, entries in reg.items()
                 for kind, fn, _src in entries)
    want = sorted((h["target"], hooks.HookType[h["type"].upper()].value, h["handler"]) for h in activation["hooks"])
    assert got == want
    assert len([d for d in done if not d.startswith("setup")]) == len(activation["hooks"]) == 10
    assert plugin.current_settings()["node_budget"] == 32


def test_refuses_other_sglang_version_and_registers_nothing(hooks, activation_of, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.24")
    path, _ = activation_of("tree", tmp_path)
    with pytest.raises(plugin.ActivationError, match="SGLang is 0.5.24"):
        plugin.register(hooks.HookRegistry, hooks.HookType, path)
    assert dict(hooks.HookRegistry._hooks) == {}


def test_refuses_a_tampered_hook_set(hooks, activation_of, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.23")
    path, activation = activation_of("tree", tmp_path)
    activation["hooks"].append({"target": "sglang.srt.x.y", "type": "replace", "handler": "os:system"})
    path.write_text(json.dumps(activation))
    with pytest.raises(plugin.ActivationError, match="different hook set"):
        plugin.register(hooks.HookRegistry, hooks.HookType, path)
    assert dict(hooks.HookRegistry._hooks) == {}


def test_refuses_changed_bundle_code(hooks, activation_of, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.23")
    path, activation = activation_of("tree", tmp_path)
    activation["fingerprints"]["specpilot.bundles.tree"] = "sha256:" + "1" * 64
    path.write_text(json.dumps(activation))
    with pytest.raises(plugin.ActivationError, match="specpilot.bundles.tree changed since"):
        plugin.register(hooks.HookRegistry, hooks.HookType, path)
    assert dict(hooks.HookRegistry._hooks) == {}


def test_no_activation_installs_nothing(hooks, tmp_path):
    assert plugin.register(hooks.HookRegistry, hooks.HookType, tmp_path / "absent.json") == []
    assert dict(hooks.HookRegistry._hooks) == {}


def test_hooks_through_sglang_wrappers_keep_stock_values(hooks):
    """SGLang's own wrapper code calls our handlers with the conventions they assume: AFTER hooks
    get (result, self, **kwargs) and returning None keeps stock's result; REPLACE gets the args."""
    import torch

    from specpilot.bundles import lattice_trace as lt
    from specpilot.bundles import tree

    fake = types.ModuleType("_sp_fake_sglang")

    class CandidateSelector:
        def build_lattice(self, *, candidate_ids, unary_logits, hidden_states, anchor_token_ids):
            return unary_logits[:, :, None, :].expand(-1, -1, unary_logits.shape[-1], -1) + 0.5

    def organize_draft_results(score_list, token_list, parents_list, num_draft_token):
        raise AssertionError("stock must be replaced")

    fake.CandidateSelector, fake.organize_draft_results = CandidateSelector, organize_draft_results
    sys.modules["_sp_fake_sglang"] = fake
    try:
        hooks.HookRegistry.register("_sp_fake_sglang.CandidateSelector.build_lattice", lt.after_build_lattice,
                                    hooks.HookType.AFTER)
        hooks.HookRegistry.register("_sp_fake_sglang.organize_draft_results", tree.organize_draft_results,
                                    hooks.HookType.REPLACE)
        hooks.HookRegistry.apply_hooks()
        cand = torch.arange(12).view(1, 3, 4)
        unary = torch.randn(1, 3, 4)
        step = {"lattice": None, "commit": None}
        token = lt._step.set(step)
        try:
            out = CandidateSelector().build_lattice(candidate_ids=cand, unary_logits=unary, hidden_states=None,
                                                    anchor_token_ids=torch.tensor([1]))
        finally:
            lt._step.reset(token)
        assert torch.equal(out, unary[:, :, None, :].expand(-1, -1, 4, -1) + 0.5)  # stock value
        assert step["lattice"][0] is cand and step["lattice"][2] is out
        scores = [torch.rand(1, 1, 2), torch.rand(1, 2, 2)]
        tokens = [torch.tensor([[5, 6]]), torch.tensor([[7, 8, 9, 10]])]
        parents = [torch.arange(-1, 2).expand(1, -1), torch.tensor([[2, 3]])]
        pl, sel, draft = fake.organize_draft_results(scores, tokens, parents, 4)
        assert sel.shape == (1, 3) and draft.shape == (1, 3)
    finally:
        sys.modules.pop("_sp_fake_sglang", None)


_DISCOVER = r"""
import json, os, sys, types
from pathlib import Path
sys.path[:] = [p for p in sys.path if p not in ("", ".")] + [TESTS]
from specpilot.bundles import plugin
from sglang_support import load_sglang_function, load_sglang_module_file, sglang_dir
root = sglang_dir()
hr = load_sglang_module_file(root, "sglang.srt.plugins.hook_registry", "hook_registry_under_test")

class _Env:  # SGLang's envs.SGLANG_PLUGINS.get(), read from the environment as SGLang does
    class SGLANG_PLUGINS:
        @staticmethod
        def get():
            return os.environ.get("SGLANG_PLUGINS", "")

from importlib.metadata import entry_points
import logging
ns = {"envs": _Env, "entry_points": entry_points, "logger": logging.getLogger("x"), "Callable": object, "Any": object}
load = load_sglang_function(root, "sglang.srt.plugins", "load_plugins_by_group", ns)
found = load("sglang.srt.plugins")
out = {"found": sorted(found)}
if "specpilot" in found:
    func, dist = found["specpilot"]
    plugin.installed_sglang_version = lambda: "0.5.23"
    out["dist"] = dist
    out["registered"] = func(hr.HookRegistry, hr.HookType)
print(json.dumps(out))
"""


def test_sglang_discovers_the_entry_point_in_the_target_env(tmp_path):
    """SGLang's own load_plugins_by_group, run by the target interpreter, finds SpecPilot's entry
    point under SGLANG_PLUGINS=specpilot, skips it when filtered out, and register() installs the
    activation written by apply."""
    import os
    import subprocess

    py = make_env(tmp_path / "env", SGL)
    res = act.apply("tree", python=str(py))
    env = dict(os.environ, SGLANG_PLUGINS="specpilot", SPECPILOT_SGLANG_DIR=str(SGL))
    env.pop("SPECPILOT_ACTIVATION", None)
    script = f"TESTS = {str(Path(__file__).resolve().parent)!r}\n" + _DISCOVER
    proc = subprocess.run([str(py), "-B", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["found"] == ["specpilot"] and out["dist"] == "specpilot"
    assert out["registered"] == [f"{h['type']} {h['target']} <- {h['handler']}" for h in res.activation["hooks"]]
    env["SGLANG_PLUGINS"] = "someone_else"
    proc = subprocess.run([str(py), "-B", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"found": []}
    act.revert(str(py))


def test_w12_activation_plans_its_setup_and_head_hook(activation_of, tmp_path):
    from specpilot.bundles import lm_head, w12_quantization_sglang

    res = act.apply("w12", python=str(make_env(tmp_path / "e", SGL)), dry_run=True, experimental=True)
    activation = res.activation
    assert activation["setup"] == ["specpilot.bundles.w12_quantization_sglang:install"]
    assert activation["quantization"] == ["w12"]
    assert "--quantization w12" in activation["launch"]
    hooks, setups = plugin.plan(activation, "0.5.23")
    assert setups == [("specpilot.bundles.w12_quantization_sglang:install", w12_quantization_sglang.install)]
    lp, worker = "sglang.srt.layers.logits_processor.LogitsProcessor", "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"
    graphs = "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend"
    assert sorted((t, k, fn.__name__) for t, k, fn, _ in hooks) == sorted([
        ("sglang.srt.model_loader.loader.DefaultModelLoader._get_weights_iterator", "around",
         w12_quantization_sglang.around_get_weights_iterator.__name__),
        (f"{worker}._greedy_sample_from_vocab_parallel_head", "around", lm_head.around_greedy_sample_from_head.__name__),
        (f"{worker}.forward_batch_generation", "around", lm_head.around_forward_batch_generation.__name__),
        (f"{lp}._get_logits", "around", lm_head.around_get_logits.__name__),
        (f"{lp}.deferred_argmax", "around", lm_head.around_deferred_argmax.__name__),
        (f"{lp}.finish_deferred_gather", "around", lm_head.around_finish_deferred_gather.__name__),
        (f"{graphs}.capture_one", "around", lm_head.around_graph_capture_one.__name__),
        (f"{graphs}.replay", "around", lm_head.around_graph_replay.__name__)])
    assert all(fn is getattr(w12_quantization_sglang if t.startswith("sglang.srt.model_loader") else lm_head, fn.__name__)
               for t, _, fn, _ in hooks)
