"""EngineSpec is the one place of the engine's options: the flags are generated from it and the spec
text is their serialization (both round-trip for every field)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from conftest import refused

from specpilot.engine.spec import EngineSpec
from specpilot.engine_options import engine_options, spec_from_cli
from specpilot.errors import InputError

# one non-default, valid value per option; a new field must be added here
OTHER = {"model": "tiny", "mode": "chain", "nodes": 12, "depth": 3, "topk": 2, "drafter": "self", "draft_layers": 2,
         "draft_model": "tiny-hybrid", "random": True, "seed": 7, "dtype": "bfloat16", "device": "cuda:1",
         "ctx": 512, "graphs": False, "threads": 3, "compile": True, "w12": True, "attn": "torch",
         "head": "certified", "decode": "layers", "batch": 4, "budget": "equal", "block": "fixed", "admit": "all",
         "admit_rows": 64, "gdn": "wy", "deterministic": True, "qview": "fp8"}
# what an option needs beside it to be valid; ALONE_ONLY: options the others of OTHER rule out
TOGETHER = {"deterministic": {"device": "cuda"}, "compile": {"device": "cuda"}, "qview": {"mode": "tlv"}, "nodes": {"mode": "tree"},
            "topk": {"mode": "tree"}, "draft_layers": {"drafter": "self"}, "draft_model": {"drafter": "model"},
            **{k: {"batch": 4} for k in ("budget", "block", "admit", "admit_rows")}}
ALONE_ONLY = ("deterministic", "qview", "nodes", "topk", "draft_model")


def _flags(spec: EngineSpec) -> list[str]:
    out = []
    for o in EngineSpec.options():
        v = getattr(spec, o.name)
        if v == o.default:
            continue
        if o.kind is bool:
            out.append(o.flag if v else f"--no-{o.flag[2:]}")
        else:
            out += [o.flag, str(v)]
    return out


@click.command()
@engine_options()
def _probe_command(**kw):
    click.echo(str(spec_from_cli(kw)))


def _spec_from_flags(args) -> EngineSpec:
    res = CliRunner().invoke(_probe_command, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return EngineSpec.parse(res.output.strip())


def test_every_option_has_a_round_trip_value():
    assert set(OTHER) == {o.name for o in EngineSpec.options()}


@pytest.mark.parametrize("name", list(OTHER))
def test_spec_text_and_flags_round_trip(name):
    spec = EngineSpec.from_options(**{name: OTHER[name], **TOGETHER.get(name, {})})
    assert getattr(spec, name) == OTHER[name] != getattr(EngineSpec(), name)
    text = str(spec)
    assert f"{name}={OTHER[name]}" in text
    assert EngineSpec.parse(text) == spec
    assert _spec_from_flags(_flags(spec)) == spec
    assert _spec_from_flags(["--engine", text]) == spec


def test_all_options_at_once_round_trip():
    spec = EngineSpec.from_options(**{k: v for k, v in OTHER.items() if k not in ALONE_ONLY})
    assert EngineSpec.parse(str(spec)) == spec == _spec_from_flags(_flags(spec))


def test_flag_defaults_are_the_spec_defaults():
    assert _spec_from_flags([]) == EngineSpec() and EngineSpec().mode == "tree"
    assert EngineSpec.parse("engine:model=tiny") == EngineSpec(model="tiny")


def test_spec_keys_take_flag_names_and_dtype_aliases():
    s = EngineSpec.parse("engine:model=tiny,random-weights=1,drafter=self,draft-layers=2,dtype=bf16")
    assert (s.random, s.draft_layers, s.dtype) == (True, 2, "bfloat16")


@pytest.mark.parametrize("text,msg", [
    ("engine:mode=beam", "unknown mode 'beam'"), ("engine:drafter=x", "unknown drafter"),
    ("engine:attn=flash", "unknown attention"), ("engine:nodes=5000", "out of range"),
    ("engine:ctx=x", "not an integer"), ("engine:graphs=maybe", "must be 0 or 1"),
    ("engine:dtype=int8", "unknown dtype"), ("engine:device=tpu", "unknown device"),
    ("engine:model=tiny,batch=2,batch=3", "batch is given twice"),
    ("engine:random=1,random-weights=0", "random is given twice"),
    ("engine:model=tiny,,mode=tree", "an empty item between commas"),
    ("engine:model=tiny,", "an empty item between commas"),
    ("engine:nodes=1_0", "not an integer"), ("engine:nodes=\uff18", "not an integer"),
])
def test_spec_errors(text, msg):
    with pytest.raises(InputError, match=msg):
        EngineSpec.parse(text)


@pytest.mark.parametrize("text,msg,flag_msg", [
    ("engine:model=tiny,budget=equal", "engine option budget applies to batched decoding",
     "--budget applies to batched decoding; give --batch above 1"),
    ("engine:model=tiny,admit_rows=64,batch=1", "engine option admit_rows applies to batched decoding",
     "--admit-rows applies to batched decoding"),
    ("engine:model=tiny,batch=2,admit=all,admit_rows=64", "engine option admit_rows sizes the room of "
     "admit=waiting, and admission is all", "--admit-rows sizes the room of --admit waiting, and admission is all"),
    ("engine:model=tiny,mode=ar,batch=2,block=fixed", "block applies to batched chain and tree steps, not mode ar",
     "--block applies to batched chain and tree steps, not mode ar"),
    ("engine:model=tiny,mode=tlv,batch=2,budget=shared", "budget applies to batched chain and tree steps, not mode tlv",
     "--budget applies to batched chain and tree steps, not mode tlv"),
    ("engine:model=tiny,mode=tree,qview=fp8", "engine option qview sets the TLV Q pass's weights, and the mode is "
                                              "tree: add mode=tlv", "--qview sets the TLV Q pass's weights, and the "
                                                                    "mode is tree: add --mode tlv"),
])
def test_options_given_where_they_change_nothing_are_refused(text, msg, flag_msg, run_cli):
    with pytest.raises(InputError, match=msg):
        EngineSpec.parse(text, strict=True)
    # a stored spec (a baseline, a record written before the rule) still reads: the option keeps its default
    stored = EngineSpec.parse(text)
    assert all(getattr(stored, k) == getattr(EngineSpec(), k) for k in EngineSpec.parse_fields(text)
               if k in ("budget", "block", "admit", "admit_rows", "qview") and not (k == "admit" and stored.batch > 1))
    # the same through the flags, the error naming them; defaults left alone are fine, and admit
    # applies to every mode
    fields = EngineSpec.parse_fields(text)
    flags = [a for k, v in fields.items() if k != "model" for a in (f"--{k.replace('_', '-')}", v)]
    code, _, err = run_cli("run", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2", *flags)
    assert code == 2 and flag_msg in err.strip().splitlines()[-1]
    assert EngineSpec.parse("engine:model=tiny,mode=ar,batch=2,admit=off").admit == "off"
    assert _spec_from_flags(["--mode", "ar"]).batch == 1


@pytest.mark.parametrize("args,warning", [
    (["--mode", "ar", "--nodes", "7"], "--nodes does nothing in mode ar (it shapes the drafts of modes tree and tlv)"),
    (["--mode", "ar", "--depth", "3"], "--depth does nothing in mode ar (it shapes the drafts of modes chain, tree and "
                                       "tlv)"),
    (["--mode", "chain", "--topk", "3"], "--topk does nothing in mode chain"),
    (["--draft-layers", "2"], "--draft-layers does nothing with the ngram drafter (it is an option of --drafter "
                              "self)"),
    (["--drafter", "self", "--draft-model", "tiny-hybrid"], "--draft-model does nothing with the self drafter"),
])
def test_draft_options_that_do_nothing_are_warned_about_and_left_out(run_cli, args, warning):
    """One set of flags swept over modes or drafters is a common script: a warning, not a refusal;
    the value is left out of the spec (a run's JSON would record it as if it applied)."""
    code, out, err = run_cli("run", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2",
                             "--format", "json", *args)
    assert code == 0, err
    assert f"specpilot: warning: {warning}" in err
    engine = json.loads(out)["engine"]
    assert not any(f"{k}=" in engine for k in ("nodes", "depth", "topk", "draft_layers", "draft_model"))
    code, _, err = run_cli("run", "--engine", "engine:model=tiny,mode=ar,nodes=7", "--prompt-ids", "1,2",
                           "--max-new-tokens", "2")
    assert code == 0 and "specpilot: warning: nodes does nothing in mode ar" in err
    stored = EngineSpec.parse("engine:model=tiny,mode=chain,nodes=7,topk=3,draft_layers=2")
    assert (stored.nodes, stored.topk, stored.draft_layers) == (32, 8, None)


def test_rules_between_options_name_flags_or_spec_keys_as_given(run_cli):
    code, _, err = run_cli("run", "--model", "tiny", "--deterministic", "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "error: --deterministic needs --device cuda" in err
    code, _, err = run_cli("run", "--engine", "engine:model=tiny,deterministic=1", "--prompt", "hi")
    assert code == 2 and "error: deterministic needs device=cuda" in err
    code, _, err = run_cli("run", "--model", "tiny", "--mode", "tlv", "--dtype", "float16", "--prompt", "hi")
    assert code == 2 and "use --dtype bfloat16 or float32, or --qview fp8" in err


def test_auto_q_view_is_fp8_for_bf16_and_fp16_targets_on_gpus_with_fp8_tensor_cores(monkeypatch):
    """``qview=auto``: fp8 where the device multiplies e4m3 and the target is bf16 or fp16 (not
    W12), w12 elsewhere; what the resolved spec records, and float16 TLV taken there."""
    import torch

    from specpilot.engine import spec as S

    if not torch.cuda.is_available():
        assert S.fp8_tensor_cores("cuda") is False and S.fp8_tensor_cores("cuda:3") is False
    for capable in (True, False):
        monkeypatch.setattr(S, "fp8_tensor_cores", lambda device, c=capable: c and device.startswith("cuda"))
        kinds = {text: EngineSpec.parse(f"engine:model=tiny,mode=tlv,{text}").qview_kind
                 for text in ("device=cuda", "device=cuda,dtype=float32", "device=cuda,w12=1",
                              "device=cpu,dtype=bfloat16", "device=cuda,qview=w12")}
        fp8 = "fp8" if capable else "w12"
        assert kinds == {"device=cuda": fp8, "device=cuda,dtype=float32": "w12", "device=cuda,w12=1": "w12",
                         "device=cpu,dtype=bfloat16": "w12", "device=cuda,qview=w12": "w12"}
        assert EngineSpec.parse("engine:model=tiny,mode=tlv,device=cuda").resolved().qview == fp8
        half = "engine:model=tiny,mode=tlv,device=cuda:1,dtype=float16"
        if capable:   # float16 weights have no W12 view; the e4m3 copy takes them
            assert EngineSpec.parse(half).qview_kind == "fp8"
        else:
            with pytest.raises(InputError, match="or qview=fp8"):
                EngineSpec.parse(half)


def test_an_unknown_qview_is_refused_in_any_mode():
    for text in ("engine:model=tiny,mode=ar,qview=bogus", "engine:model=tiny,mode=tlv,qview=FP8"):
        with pytest.raises(InputError, match="unknown qview '(bogus|FP8)'; choose one of auto, w12, fp8"):
            EngineSpec.parse(text)


def test_a_spec_changed_to_where_a_rule_cannot_apply_drops_it():
    """A batched tree's stock turned into its AR reference (the round does) or into one request keeps
    only the rules that still apply, so its text parses back to it."""
    tree = EngineSpec.parse("engine:model=tiny,mode=tree,batch=4,budget=equal,block=fixed,admit=off")
    for changed, text in ((tree.with_(mode="ar"), "engine:model=tiny,mode=ar,batch=4,admit=off"),
                          (tree.with_(mode="tlv"), "engine:model=tiny,mode=tlv,batch=4,admit=off"),
                          (tree.with_(batch=1), "engine:model=tiny,mode=tree")):
        assert str(changed) == text and EngineSpec.parse(text) == changed


@pytest.mark.parametrize("verb", [["run"], ["serve"]])
def test_run_and_serve_help_list_every_engine_flag(run_cli, verb):
    code, out, _ = run_cli(*verb, "--help")
    assert code == 0
    for o in EngineSpec.options():
        assert o.flag in out, o.flag
    assert "--engine SPEC" in out and "[default: tree]" in out


def test_probe_rows_help_lists_its_engine_flags(run_cli):
    from specpilot.commands.probe import PROBE_OPTIONS

    code, out, _ = run_cli("probe", "rows", "--help")
    assert code == 0
    flags = {o.name: o.flag for o in EngineSpec.options()}
    for name in PROBE_OPTIONS:
        assert flags[name] in out, name
    assert "--mode " not in out and "--engine" not in out
    assert "[default: auto]" in out and "cuda when" in out


def test_probe_rows_never_times_a_cold_first_step_and_says_where_the_certified_head_stops(run_cli):
    code, out, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1,2,65", "--context", "8",
                             "--reps", "1", "--warmup", "0", "--head", "certified", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["warmup"] == 0 and any("points above 64 rows run the linear head" in w for w in d["warnings"])


def test_a_typed_spec_text_warns_about_draft_options_that_do_nothing(run_cli):
    """round's DEPLOYMENT, check --system, audit and compare systems: the warning run gives."""
    code, out, err = run_cli("round", "engine:model=tiny,mode=ar,nodes=16,threads=1", "--dry-run")
    assert code == 0 and "specpilot: warning: nodes does nothing in mode ar" in err, err
    assert "deployment: engine:model=tiny,mode=ar,threads=1" in out


@pytest.mark.parametrize("text", ["mode=ar", "mode=chain,depth=5", "mode=tree,nodes=12,depth=4", "mode=tlv,nodes=9",
                                  "mode=tree,nodes=6,batch=3", "mode=tree,nodes=6,batch=3,budget=equal",
                                  "mode=tlv,nodes=7,batch=2", "mode=chain,depth=3,batch=2"])
def test_cache_room_is_what_the_decoders_reserve(text):
    """``EngineSpec.cache_room`` (the round's check of its prompts) against the real decoders'
    ``capacity_needed``: one request's and the batch decoder's."""
    from specpilot.engine.api import load_engine

    spec = EngineSpec.parse(f"engine:model=tiny,threads=1,{text}")
    eng = load_engine(spec)
    dec = eng.batch_decoder() if spec.batch > 1 else eng.decoder
    assert spec.cache_room() == dec.capacity_needed(0, 0)


@pytest.mark.parametrize("fields, idle", [
    ({"model": "smollm2"}, True), ({"model": "/models/Llama-3.1-8B"}, True),
    ({"model": "smollm2", "random": True}, False), ({"model": "tiny"}, False), ({"model": "TINY-hybrid"}, False),
    ({"model": "smollm2", "mode": "chain", "drafter": "model", "draft_model": "tiny"}, False),
])
def test_a_seed_beside_a_checkpoints_weights_is_said_to_do_nothing(fields, idle):
    spec = EngineSpec.from_options(**fields, seed=7)
    lines = spec.idle_options(["seed"], as_flags=True)
    assert bool(lines) is idle and all(line.startswith("--seed does nothing here") for line in lines), lines


def test_library_callers_get_input_errors_for_arguments_of_the_wrong_kind():
    """A library caller's wrong argument is InputError (or EnvironmentMissing), not a TypeError or
    AttributeError from deep inside: a spec that is no text, max_new_tokens as text (it was added to
    the prompt length before it was checked), prompt ids that are no sequence; a KernelPack for CUDA
    on a machine without it."""
    import torch

    from specpilot.engine.api import load_engine
    from specpilot.errors import EnvironmentMissing, InputError

    with pytest.raises(InputError, match="an engine spec is text"):
        EngineSpec.parse(None)
    eng = load_engine(EngineSpec.parse("engine:model=tiny,mode=tree,threads=1"))
    with pytest.raises(InputError, match="max_new_tokens must be an integer, got '4'"):
        eng.generate([1, 2], max_new_tokens="4")
    with pytest.raises(InputError, match="prompt_ids must be a sequence of integer token ids"):
        eng.generate(5, max_new_tokens=4)
    dec = eng.batch_decoder()
    from specpilot.engine.batch.requests import Request

    with pytest.raises(InputError, match="max_new_tokens must be an integer"):
        dec.check(Request(prompt_ids=[1, 2], max_new_tokens=2.5))
    if not torch.cuda.is_available():
        from specpilot.kernels.w12.format import encode
        from specpilot.kernels.w12.pack import KernelPack

        w = (torch.randn(128, 64, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
        with pytest.raises(EnvironmentMissing, match="no CUDA device here"):
            KernelPack.from_w12(encode(w), "cuda")


def test_a_value_with_a_comma_is_refused_as_no_spec_text_could_hold_it(run_cli, tmp_path):
    """Commas separate a spec text's options: a model folder named ``smol,v2`` ran, but the run
    JSON's ``engine`` field (``str(spec)``) was then no spec ``--engine`` could read back."""
    folder = tmp_path / "smol,v2"
    folder.mkdir()
    out = tmp_path / "run.json"
    code, _, err = run_cli("run", "--model", folder, "--mode", "ar", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                           "--format", "json", "--out", out)
    refused(code, err, f"--model '{folder}' holds a comma", "symlink")
    assert not out.exists()
    for kw in ({"model": "tiny,v2"}, {"model": "tiny", "mode": "chain", "drafter": "model", "draft_model": "a,b"}):
        with pytest.raises(InputError, match=r"engine option \w+ '[^']*' holds a comma"):
            EngineSpec.from_options(**kw)
    with pytest.raises(InputError, match="holds a comma"):   # any spec, however it is made
        EngineSpec(model="a,b")
    with pytest.raises(InputError, match="holds a comma"):
        EngineSpec(model="tiny").with_(model="a,b")
    spec = EngineSpec.from_options(model=str(tmp_path / "smol=v2"), mode="ar")   # '=' needs nothing: keys hold none
    assert EngineSpec.parse(str(spec)) == spec
