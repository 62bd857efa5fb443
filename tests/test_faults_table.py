"""Faults and bad input: each case of the exit-code contract, as a new user meets it.

Exit 0 done, 1 negative verdict, 2 bad input (one ``specpilot: error:`` line naming the file,
``file:line`` where there is one), 3 missing environment; never 4 (a bug) for any of these.
Signals are in test_faults_signals.py, the fuzz suite in test_fuzz_*.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import LOCAL_FIXTURES, REPO
from specpilot.errors import InputError

LATTICE = [{"schema": "specpilot.lattice/1", "request": 0, "step": s, "tokens": [[5, 6], [7, 8]],
            "logprobs": [[-0.1, -2.0], [-0.3, -1.5]], "transitions": None, "target": [5, 7, 9]} for s in range(4)]


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("specpilot: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------------- decoding

def test_replay_truncated_gz_is_bad_input_naming_the_file(run_cli, tmp_path):
    whole = gzip.compress(_jsonl(LATTICE * 20).encode())
    p = tmp_path / "lat.jsonl.gz"
    p.write_bytes(whole[: len(whole) // 2])
    code, _, err = run_cli("replay", p)
    assert code == 2, err
    line = _one_error(err)
    assert "lat.jsonl.gz:" in line and "truncated" in line and "interrupted" not in err


def test_a_truncated_or_corrupt_gz_prompts_file_is_named(run_cli, tmp_path):
    """The prompts reader peeks at the first line before it reads the rows: a decoding error there
    named no file ("input truncated")."""
    whole = gzip.compress(b'{"schema": "specpilot.prompts/1", "id": "a", "text": "hello there"}\n')
    cut, junk = tmp_path / "cut.jsonl.gz", tmp_path / "junk.jsonl.gz"
    cut.write_bytes(whole[:20])
    junk.write_bytes(b"garbage-not-gzip")
    for p, what in ((cut, "truncated"), (junk, "corrupt gzip data")):
        code, _, err = run_cli("run", "--model", "tiny", "--prompts", p, "--max-new-tokens", "2")
        assert code == 2 and _one_error(err).startswith(f"specpilot: error: {p}: {what}"), err


def test_replay_binary_file_is_bad_input_with_file_and_line(run_cli, tmp_path):
    p = tmp_path / "lat.jsonl"
    p.write_bytes(_jsonl(LATTICE[:2]).encode() + bytes(range(128, 256)) + b"\n")
    code, _, err = run_cli("replay", p)
    assert code == 2, err
    assert "lat.jsonl:3: not UTF-8 text" in _one_error(err)


def test_replay_huge_token_id_is_bad_input_with_file_and_line(run_cli, tmp_path):
    rows = [dict(r) for r in LATTICE]
    rows[2] = dict(rows[2], tokens=[[10**30, 6], [7, 8]])
    p = tmp_path / "lat.jsonl"
    p.write_text(_jsonl(rows))
    code, _, err = run_cli("replay", p)
    assert code == 2, err
    assert "lat.jsonl:3:" in _one_error(err) and "2147483647" in err


def test_outputs_huge_token_id_is_bad_input_with_file_and_line(run_cli, tmp_path):
    p = tmp_path / "o.jsonl"
    p.write_text(_jsonl([{"schema": "specpilot.outputs/1", "id": 0, "prompt_ids": [1], "output_ids": [2]},
                         {"schema": "specpilot.outputs/1", "id": 1, "prompt_ids": [1], "output_ids": [10**30]}]))
    stock = tmp_path / "stock.jsonl"
    stock.write_text(_jsonl([{"schema": "specpilot.outputs/1", "id": i, "prompt_ids": [1], "output_ids": [2]}
                             for i in range(2)]))
    code, _, err = run_cli("audit", p, "--against", stock, "--scorer", tmp_path / "nowhere")
    assert code == 2  # the scorer is checked first; then the file
    (tmp_path / "scorer").mkdir()
    (tmp_path / "scorer" / "config.json").write_text("{}")
    code, _, err = run_cli("audit", p, "--against", stock, "--scorer", tmp_path / "scorer")
    assert code == 2, err
    assert "o.jsonl:2: output_ids must hold token ids in [0, 2147483647]" in _one_error(err)


def test_memory_verify_binary_entry_is_bad_input_naming_the_entry(run_cli, tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    for p in (REPO / "bundles" / "memory_entries").glob("*.yaml"):
        (mem / p.name).write_bytes(p.read_bytes())
    (mem / "tree.yaml").write_bytes(b"id: tree\n\x89PNG\r\n\x1a\n\x00\xff\xfe")
    code, _, err = run_cli("memory", "verify", "--memory-dir", mem)
    assert code == 2, err
    assert "tree.yaml:2: memory entry is not UTF-8 text" in _one_error(err)


@pytest.fixture(scope="module")
def w12_file(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    from specpilot.kernels.w12 import checkpoint

    d = tmp_path_factory.mktemp("w12")
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g).to(torch.bfloat16)},
              str(d / "m.safetensors"))
    checkpoint.pack(str(d / "m.safetensors"), str(d / "m.w12.safetensors"))
    return d / "m.w12.safetensors"


def test_w12_stats_on_a_corrupted_record_names_it(run_cli, w12_file, tmp_path):
    data = bytearray(w12_file.read_bytes())
    data[-100] ^= 0x40  # inside the last stored part
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    code, out, err = run_cli("w12", "stats", bad)
    assert code == 2 and out == "", err
    line = _one_error(err)
    assert "bad.safetensors: model.layers.0.mlp.up_proj.weight:" in line and "corrupted (CRC-32 mismatch)" in line
    code, _, err = run_cli("w12", "stats", w12_file)
    assert code == 0, err


def test_unexpected_decode_error_is_bad_input_not_a_bug():
    """The boundary: a decode error from any library, with the file named by fileio.reading."""
    from specpilot.errors import EXIT_ENV, EXIT_USAGE, as_user_error
    from specpilot.fileio import reading

    with pytest.raises(UnicodeDecodeError) as info, reading("x.yaml"):
        b"\xff".decode("utf-8")
    err = as_user_error(info.value)
    assert err.exit_code == EXIT_USAGE and str(err).startswith("x.yaml: not UTF-8 text")
    with pytest.raises(json.JSONDecodeError) as info, reading("y.json"):
        json.loads('{"a": 1,\n oops}')
    assert str(as_user_error(info.value)).startswith("y.json:2:2: not valid JSON")
    assert as_user_error(OverflowError("int too large")).exit_code == EXIT_USAGE
    assert as_user_error(FileNotFoundError(2, "No such file or directory", "z.txt")).args[0].startswith("z.txt:")
    assert as_user_error(OSError(28, "No space left on device", "out.json")).exit_code == EXIT_ENV
    assert as_user_error(KeyError("a bug")) is None and as_user_error(TypeError("a bug")) is None
    # the machine's memory running out is its environment, not a bug: exit 3 in one line
    for e in (MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate "
                                          "memory: you tried to allocate 68719476736 bytes"),
              RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")):
        err = as_user_error(e)
        assert err.exit_code == EXIT_ENV and str(err).startswith("not enough memory for this run"), e
    assert as_user_error(RuntimeError("shape mismatch")) is None


# ----------------------------------------------------------------------------- absurd numbers

@pytest.mark.parametrize("args, expect", [
    (["ceiling", "--model", "{cfg}", "--gpu", "h200"], "hidden_size must be a whole number in [1, 1048576]"),
    (["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "99999999999"], "in [1, 65536]"),
    (["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "1,2,...,99999999999"], "in [1, 65536]"),
    (["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "8", "--tau", "inf"], "1<=x<=65536"),
    (["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "8", "--tau", "nan"], "from 1 to 65536"),
    (["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--batch", "0"], "1<=x<=65536"),
    (["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--bandwidth", "-1"], "0<x<=10000"),
    (["profile", "{trace}", "--model", "llama-3.1-8b", "--rows", "0"], "1<=x<=65536"),
], ids=["hidden_size", "rows", "rows-series", "tau-inf", "tau-nan", "batch", "bandwidth", "profile-rows"])
def test_absurd_numbers_are_bad_input_with_the_range(run_cli, tmp_path, args, expect):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 10**30, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "vocab_size": 100, "intermediate_size": 10}))
    args = [a.format(cfg=cfg, trace=LOCAL_FIXTURES / "nsys_h200_decode_eager.sqlite") for a in args]
    code, out, err = run_cli(*args)
    assert code == 2 and out == "", err
    assert expect in _one_error(err)


@pytest.mark.parametrize("verb", [["replay", "{lattice}"], ["compare", "--from", "{lattice}"],
                                  ["audit", "check"]], ids=["replay", "compare", "audit-check"])
def test_a_negative_seed_is_bad_input(run_cli, tmp_path, verb):
    lat = tmp_path / "lat.jsonl"
    lat.write_text(_jsonl(LATTICE))
    args = [a.format(lattice=lat) for a in verb]
    code, out, err = run_cli(*args, "--seed", "-1")
    assert code == 2 and "'--seed': -1 is not in the range 0<=x<=4294967295" in _one_error(err), err


ROWS_PROBE = {"schema": "specpilot.rows/1", "model": "tiny", "dtype": "float32", "context": 64, "ar_ms": 1.0,
              "points": [{"rows": 1, "step_ms": 1.0, "c": 1.0}, {"rows": 8, "step_ms": 1.4, "c": 1.4}],
              "reps": 5, "method": "eager, wall clock, median"}


def test_rows_probe_from_a_cpu_beside_gpu_floors_is_refused_naming_both(run_cli, tmp_path):
    p = tmp_path / "rows.json"
    p.write_text(json.dumps({**ROWS_PROBE, "gpu": None, "device": "cpu", "cpu": "Intel Xeon Test"}))
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "8", "--rows-probe", p,
                             "--tau", "3")
    assert code == 2 and out == "", err
    line = _one_error(err)
    assert "measured on the CPU (Intel Xeon Test)" in line and "H200" in line
    code, out, err = run_cli("ceiling", "--rows", "8", "--rows-probe", p, "--tau", "3", "--step-ms", "1.4")
    assert code == 0, err  # the measured figures alone do not mix devices


def test_rows_probe_from_another_gpu_warns_naming_both(run_cli, tmp_path):
    p = tmp_path / "rows.json"
    p.write_text(json.dumps({**ROWS_PROBE, "model": "llama-3.1-8b", "gpu": "NVIDIA A100-SXM4-80GB", "device": "cuda:0", "cpu": None, "ar_path": "fused"}))
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "8", "--rows-probe", p,
                             "--tau", "3", "--format", "json")
    assert code == 0, err
    (warning,) = json.loads(out)["warnings"]
    assert "A100" in warning and "H200" in warning


# ------------------------------------------------------------------------------ output files

@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_output_files_get_the_umask_mode_keep_theirs_and_follow_symlinks(run_cli, tmp_path, umask_022):
    new = tmp_path / "new.json"
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--format", "json", "--out", new)
    assert code == 0 and _mode(new) == 0o644, err
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o640)
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--format", "json", "--out", kept)
    assert code == 0 and _mode(kept) == 0o640 and json.loads(kept.read_text())["schema"] == "specpilot.ceiling/1"
    target = tmp_path / "real" / "target.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--format", "json", "--out", link)
    assert code == 0, err
    assert link.is_symlink() and json.loads(target.read_text())["schema"] == "specpilot.ceiling/1"
    assert not [p for p in tmp_path.rglob("*.part")]


def test_outputs_to_a_pipe_or_device_are_written_in_place(run_cli, tmp_path):
    import threading

    args = ("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--format", "json", "--out")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    code, _, err = run_cli(*args, fifo)
    reader.join(timeout=30)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.stat().st_mode) and json.loads(got[0])["schema"] == "specpilot.ceiling/1"
    code, _, err = run_cli(*args, "/dev/null")
    assert code == 0 and stat.S_ISCHR(os.stat("/dev/null").st_mode), err
    if os.path.exists("/dev/full"):
        code, _, err = run_cli(*args, "/dev/full")
        assert code == 3 and "/dev/full: No space left on device" in _one_error(err)
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    assert not list(tmp_path.glob(".*.part")) and not list(Path("/dev").glob(".*.part"))


def test_outputs_and_lattice_files_get_the_umask_mode(run_cli, tmp_path, umask_022):
    outs, lat = tmp_path / "o.jsonl", tmp_path / "l.jsonl"
    code, _, err = run_cli("run", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                           "--outputs-out", outs, "--lattice-out", lat)
    assert code == 0, err
    assert _mode(outs) == 0o644 and _mode(lat) == 0o644


def test_sglang_activation_file_gets_the_umask_mode(run_cli, tmp_path, umask_022):
    from sglang_support import make_env, sglang_dir

    from specpilot.bundles import activation as act

    root = sglang_dir()
    if root is None:
        pytest.skip("the SGLang wheel is not installed")
    py = make_env(tmp_path / "env", root)
    code, _, err = run_cli("apply", "lattice-trace", "--python", py)
    assert code == 0, err
    purelib = Path(subprocess.run([str(py), "-B", "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    path = purelib / act.ACTIVATION_NAME
    assert _mode(path) == 0o644
    path.chmod(0o600)
    code, _, err = run_cli("apply", "lattice-trace", "--python", py)
    assert code == 0 and _mode(path) == 0o600, err  # an existing file keeps its mode
    assert run_cli("revert", "--python", py)[0] == 0


def test_w12_pack_folder_output_gets_the_umask_mode(tmp_path, umask_022):
    import torch
    from safetensors.torch import save_file

    from specpilot.kernels.w12 import checkpoint

    src = tmp_path / "model"
    src.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.ones(128, 64, dtype=torch.bfloat16)},
              str(src / "a.safetensors"))
    checkpoint.pack(str(src), str(tmp_path / "packed"))
    assert _mode(tmp_path / "packed") == 0o755 and _mode(tmp_path / "packed" / "a.safetensors") == 0o644


# ----------------------------------------------------------------------- the option at fault

def test_errors_name_the_option_at_fault(run_cli, tmp_path):
    trace = tmp_path / "t.sqlite"
    trace.write_bytes((LOCAL_FIXTURES / "nsys_h200_decode_eager.sqlite").read_bytes())
    code, _, err = run_cli("profile", trace, "--plot", trace)
    assert code == 2 and "--plot" in _one_error(err) and "--out" not in err, err
    code, _, err = run_cli("profile", trace, "--plot", tmp_path / "missing" / "p.png")
    assert code == 2 and _one_error(err).startswith("specpilot: error: --plot "), err
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--out", tmp_path / "no" / "x")
    assert code == 2 and _one_error(err).startswith("specpilot: error: --out "), err
    stock = tmp_path / "stock.jsonl"
    stock.write_text(_jsonl([{"schema": "specpilot.outputs/1", "id": 0, "prompt_ids": [1], "output_ids": [2]}]))
    (tmp_path / "scorer").mkdir()
    (tmp_path / "scorer" / "config.json").write_text("{}")
    a_file = tmp_path / "taken"
    a_file.write_text("")
    code, _, err = run_cli("audit", "engine:model=tiny,mode=ar", "--against", stock, "--scorer", tmp_path / "scorer",
                           "--prompts", stock, "--save-outputs", a_file)
    assert code == 2 and "'--save-outputs'" in _one_error(err) and "--out" not in err, err
    code, _, err = run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", stock, "--save", stock)
    assert code == 2 and "--save" in _one_error(err) and "refusing to overwrite input file" in err, err
    assert stock.read_text().startswith('{"schema": "specpilot.outputs/1"')


# ---------------------------------------------------------------------------------- compare

def test_a_file_that_is_not_a_gguf_model_is_bad_input(run_cli, tmp_path):
    (tmp_path / "text.gguf").write_text("hello")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + bytes(60))
    for name in ("text", "empty", "cut"):
        code, _, err = run_cli("run", "--model", tmp_path / f"{name}.gguf", "--prompt-ids", "1,2", "--max-new-tokens", "1")
        line = _one_error(err)
        assert code == 2 and f"{name}.gguf: " in line and ("magic bytes" in line or "cannot load it" in line), err


def test_text_that_is_not_unicode_is_bad_input_before_the_model_loads(run_cli, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"schema": "specpilot.prompts/1", "id": "a", "text": "hi \\ud800 there"}\n')
    code, _, err = run_cli("run", "--model", "smollm2", "--prompts", p)
    assert code == 2 and "p.jsonl:1: the text is not valid Unicode (a lone surrogate at character 3)" in _one_error(err)
    code, _, err = run_cli("run", "--model", "smollm2", "--raw", "--prompt", "bad \udcff bytes")
    assert code == 2 and "--prompt: the text is not valid Unicode" in _one_error(err) and "loading" not in err


@pytest.mark.parametrize("args", [["audit", "selftest"], ["run", "--model", "tiny", "--prompt-ids", "1"]])
def test_a_device_that_is_not_one_is_bad_input(run_cli, args):
    code, _, err = run_cli(*args, "--device", "banana")
    assert code == 2 and "banana" in _one_error(err) and "cuda:N" in err
    code, _, err = run_cli(*args, "--device", "cuda:abc")
    assert code == 2, err


def test_a_prompts_file_with_a_byte_order_mark_is_read_as_its_rows(tmp_path):
    from specpilot.auditors.outputs import read_prompt_rows

    p = tmp_path / "bom.jsonl"
    p.write_bytes("\ufeff".encode() + _jsonl([{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2]}]).encode())
    assert [(r.id, r.prompt_ids) for r in read_prompt_rows(p)] == [("a", [1, 2])]
    t = tmp_path / "bom.txt"
    t.write_bytes("\ufeffhello\n".encode())
    assert [r.text for r in read_prompt_rows(t)] == ["hello"]
    # text that starts with "{" is text; a broken JSON row is still reported as one
    t.write_text("{curly braces} make a set\nsecond\n")
    assert [r.text for r in read_prompt_rows(t)] == ["{curly braces} make a set", "second"]
    # a file named .jsonl is not read as text: a line of it that is no JSON object is refused
    for line in ("[1, 2, 3]", "hello", "{curly braces} make a set"):
        p.write_text(line + "\n")
        with pytest.raises(InputError, match=r"bom.jsonl: its first line is not a JSON object .* \.jsonl prompts file"):
            read_prompt_rows(p)
    p.write_text('{"schema": "specpilot.prompts/1", "id": 1, "prompt_ids": [1, 2\n')
    with pytest.raises(InputError, match="not valid JSON"):
        read_prompt_rows(p)


@pytest.mark.parametrize("content, needle", [
    (b'{"schema": "specpilot.prompts/1", "id": "a", "text": "abc", "prompt_ids": [1, 2]}\n',
     ':1: a prompt row has "prompt_ids" or "text", not both'),
    (b"first\nhello\x00world\n", ":2: a NUL byte in a text prompts file (a binary file?)"),
    (b'{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, true]}\n', "found true"),
    (b'{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, null]}\n', "found null"),
])
def test_a_prompts_row_that_is_not_one_prompt_is_refused(run_cli, tmp_path, content, needle):
    """What `run`, `audit` and `compare` read as prompts: one of prompt_ids and text (a row with
    both would drop one unseen), no NUL bytes in a text file, values named as the JSON has them."""
    p = tmp_path / "p.txt"
    p.write_bytes(content)
    out = tmp_path / "out.json"
    code, _, err = run_cli("run", "--model", "tiny", "--prompts", p, "--max-new-tokens", "2", "--out", out)
    assert code == 2 and needle in _one_error(err) and not out.exists(), err


@pytest.mark.parametrize("args, needle", [
    (["run", "--model", "tiny", "--prompt-ids", "1,,2"], "comma-separated integers"),
    (["audit", "selftest", "--biases", "nan"], "positive finite numbers"),
    (["audit", "selftest", "--engine-prompts", "-1"], "choose 0..24"),
    (["audit", "selftest", "--prompts", "4", "--repeats", "2", "--engine-prompts", "5"], "choose 0..4"),
])
def test_nonsense_values_are_refused_not_clamped(run_cli, args, needle):
    code, _, err = run_cli(*args)
    assert code == 2 and needle in _one_error(err), err


def test_audit_refuses_a_file_of_other_prompts_before_running_a_system(run_cli, tmp_path):
    prompts, stock = tmp_path / "p.jsonl", tmp_path / "stock.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [1 + n, 2]} for n, i in enumerate("ab")]))
    stock.write_text(_jsonl([{"schema": "specpilot.outputs/1", "id": "a", "prompt_ids": [99], "output_ids": [5]},
                             {"schema": "specpilot.outputs/1", "id": "c", "prompt_ids": [1], "output_ids": [5]}]))
    code, _, err = run_cli("audit", "engine:model=tiny,mode=ar", "--against", stock, "--scorer", "smollm2",
                           "--prompts", prompts)
    line = _one_error(err)
    assert code == 2 and "stock.jsonl: its prompts are not those of --prompts" in line, err
    assert "1 missing (first: b); 1 with other token ids (first: a); 1 not in --prompts (first: c)" in line
    assert "loading model" not in err   # the engine never ran


def test_an_empty_out_is_refused_not_stdout(run_cli):
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--out", "")
    assert code == 2 and out == "" and "an empty file name" in _one_error(err)


@pytest.mark.parametrize("args, needle", [
    (["--out-dir", "/proc/x"], "--out-dir /proc/x: /proc/x does not exist and cannot be made in /proc"),
    (["--out-dir", "/proc/x/rd"], "--out-dir /proc/x/rd: /proc/x does not exist and cannot be made in /proc"),
    (["--records", "/proc/x/rec"], "--records /proc/x/rec: /proc/x does not exist and cannot be made in /proc"),
    (["--out-dir", "{file}/sub"], "is not a folder"),
    (["--out-dir", "{file}"], "is a file"),
    (["--out-dir", "/dev/null"], "--out-dir /dev/null exists and is not a folder; choose another --out-dir"),
    (["--candidates", "tree,,chain"], "an empty name between commas"),
])
def test_round_dry_run_refuses_what_the_round_would(run_cli, tmp_path, args, needle):
    (tmp_path / "afile").write_text("x")
    args = [a.format(file=tmp_path / "afile") for a in args]
    code, _, err = run_cli("round", "engine:model=tiny,mode=ar", "--dry-run", *args)
    assert code == 2 and needle.format(file=tmp_path / "afile") in _one_error(err), err
    assert "--resume" not in err   # nothing there to continue


def test_round_dry_run_proposes_from_the_memory_it_is_given(run_cli, tmp_path):
    (tmp_path / "mem").mkdir()
    code, out, err = run_cli("round", "engine:model=tiny,mode=ar", "--dry-run", "--memory-dir", tmp_path / "mem",
                             "--format", "json")
    assert code == 0, err
    reasons = {x["id"]: x["reason"] for x in json.loads(out)["not_runnable"]}
    assert reasons["tree"] == "memory entry 'tree' is not in the memory used"


def test_audit_collect_resume_refuses_a_save_of_other_prompts_and_keeps_it(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2, 3]}]))
    save = tmp_path / "s.jsonl"
    other = [{"schema": "specpilot.outputs/1", "id": f"x{i}", "prompt_ids": [9, i], "output_ids": [5] * 4}
             for i in range(8)]
    save.write_text(_jsonl(other))
    args = ("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", save, "--resume")
    code, _, err = run_cli(*args, "--max-new-tokens", "4")
    assert code == 2 and "8 of its 8 rows answer none of --prompts (first: id 'x0')" in _one_error(err)
    assert save.read_text() == _jsonl(other)
    save.write_text(_jsonl([{"schema": "specpilot.outputs/1", "id": "a", "prompt_ids": [1, 2, 3], "output_ids": [5] * 8}]))
    code, _, err = run_cli(*args, "--max-new-tokens", "4")
    assert code == 2 and "row 'a' has 8 output tokens, more than --max-new-tokens 4" in _one_error(err)
    assert run_cli(*args, "--max-new-tokens", "8")[0] == 0


def test_audit_collect_rows_record_their_limit_and_resume_refuses_another(run_cli, tmp_path):
    """A row collected under --max-new-tokens 3 that stopped at the limit would stay 3 tokens long in
    a collection resumed with 6; the saved rows record their limit, so the resume is refused."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [1, 2 + i]} for i in range(2)]))
    save = tmp_path / "s.jsonl"
    args = ("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", save)
    code, _, err = run_cli(*args, "--max-new-tokens", "3")
    assert code == 0, err
    rows = [json.loads(line) for line in save.read_text().splitlines()]
    assert [r["max_new_tokens"] for r in rows] == [3, 3] and all(len(r["output_ids"]) <= 3 for r in rows)
    before = save.read_text()
    code, _, err = run_cli(*args, "--resume", "--max-new-tokens", "6")
    assert code == 2 and "row 0 was collected with --max-new-tokens 3, not 6" in _one_error(err)
    assert save.read_text() == before
    assert run_cli(*args, "--resume", "--max-new-tokens", "3")[0] == 0 and save.read_text() == before
    rows[0]["max_new_tokens"] = 0
    save.write_text(_jsonl(rows))
    code, _, err = run_cli(*args, "--resume", "--max-new-tokens", "3")
    assert code == 2 and '"max_new_tokens" must be a positive integer' in _one_error(err)
    rows[0].update(max_new_tokens=2, output_ids=[5, 6, 7])
    save.write_text(_jsonl(rows))
    code, _, err = run_cli(*args, "--resume", "--max-new-tokens", "3")
    assert code == 2 and '3 output_ids, more than its "max_new_tokens" 2' in _one_error(err)
    rows[0].update(max_new_tokens=True, output_ids=[5])
    save.write_text(_jsonl(rows))
    code, _, err = run_cli(*args, "--resume", "--max-new-tokens", "3")
    assert code == 2 and 'must be a positive integer, got true' in _one_error(err)


def test_audit_checks_every_engine_spec_before_any_system_runs(run_cli, tmp_path):
    code, _, err = run_cli("audit", "engine:model=tiny,batch=1,block=fixed", "--against", "engine:model=tiny,mode=ar",
                           "--scorer", "smollm2", "--prompts", REPO / "examples" / "prompts.jsonl", "--max-new-tokens", "2",
                           "--save-outputs", tmp_path / "outs")
    assert code == 2 and "engine:model=tiny,batch=1,block=fixed: engine option block applies to batched decoding" \
        in _one_error(err)
    assert "loading model" not in err and not (tmp_path / "outs").exists()


def test_audit_collect_resume_refuses_another_system_and_checks_out_first(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [1, 2 + i]} for i in range(2)]))
    save = tmp_path / "s.jsonl"
    ar = ("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", save, "--max-new-tokens", "3")
    assert run_cli(*ar)[0] == 0
    assert {json.loads(line)["system"] for line in save.read_text().splitlines()} == {"engine:model=tiny,mode=ar"}
    before = save.read_text()
    code, _, err = run_cli("audit", "collect", "engine:model=tiny,mode=tree", "--prompts", prompts, "--save", save,
                           "--max-new-tokens", "3", "--resume")
    assert code == 2 and "was collected from engine:model=tiny,mode=ar, not engine:model=tiny,mode=tree" \
        in _one_error(err)
    assert save.read_text() == before
    # the same system written another way is the same system, its dtype given or left to the default too
    for same in ("engine:mode=ar,model=tiny", "engine:model=tiny,mode=ar,dtype=float32"):
        code, _, err = run_cli("audit", "collect", same, "--prompts", prompts, "--save", save,
                               "--max-new-tokens", "3", "--resume")
        assert code == 0, err
    # a save that answers every prompt: nothing runs, no model loads (no server is asked)
    code, _, err = run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", save,
                           "--max-new-tokens", "3", "--resume")
    assert code == 0 and "loading model" not in err and save.read_text() == before
    # --out is checked before anything runs: not the save, not an input
    fresh = tmp_path / "fresh.jsonl"
    for out, what in ((fresh, "the same file as --save"), (prompts, "refusing to overwrite input file")):
        code, _, err = run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", fresh,
                               "--format", "json", "--out", out)
        assert code == 2 and what in _one_error(err) and "loading model" not in err and not fresh.exists()
    # an empty save (nothing collected yet) resumes from nothing; rows recording no system are kept with a warning
    fresh.write_text("")
    assert run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", fresh,
                   "--max-new-tokens", "3", "--resume")[0] == 0
    assert fresh.read_text() == before
    old = [{k: v for k, v in json.loads(line).items() if k not in ("system", "max_new_tokens")}
           for line in before.splitlines()]
    fresh.write_text(_jsonl(old[:1]))
    code, _, err = run_cli("audit", "collect", "engine:model=tiny,mode=ar", "--prompts", prompts, "--save", fresh,
                           "--max-new-tokens", "3", "--resume")
    assert code == 0 and "1 of the 1 rows kept do not record the system or --max-new-tokens" in err


def test_audit_collect_checks_save_first_and_reads_stored_specs_as_engines(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [1, 2 + i]} for i in range(3)]))
    spec = "engine:model=tiny,mode=tree,nodes=4"
    args = ("audit", "collect", spec, "--prompts", prompts, "--max-new-tokens", "3")
    # an empty --save, or one in a folder that does not exist: refused before the model loads
    for save, what in (("", "--save': an empty path"), (tmp_path / "no" / "s.jsonl", "does not exist")):
        code, _, err = run_cli(*args, "--save", save)
        assert code == 2 and what in _one_error(err) and "loading model" not in err
    save = tmp_path / "s.jsonl"
    save.write_text("\n  \n")   # white space only: nothing collected yet
    code, out, err = run_cli(*args, "--save", save, "--resume", "--format", "json")
    assert code == 0, err
    rows = [json.loads(line) for line in save.read_text().splitlines()]
    assert json.loads(out)["system"] == rows[0]["system"] == spec
    # a row that stored the same engine with its keys in another order resumes; any row of another
    # engine is refused, not only the first
    rows[0]["system"] = "engine:nodes=4,mode=tree,model=tiny"
    rows[2]["system"] = "engine:model=tiny,mode=chain"
    save.write_text(_jsonl(rows[:1] + rows[2:]))
    code, _, err = run_cli(*args, "--save", save, "--resume")
    assert code == 2 and "row 2 was collected from engine:model=tiny,mode=chain" in _one_error(err)
    save.write_text(_jsonl(rows[:1]))
    assert run_cli(*args, "--save", save, "--resume")[0] == 0


def test_audit_saves_outputs_with_their_system_and_checks_out_first(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": 0, "prompt_ids": [1, 2]}]))
    outs = tmp_path / "outs"
    code, _, err = run_cli("audit", "engine:model=tiny,mode=tree", "--against", "engine:model=tiny,mode=ar",
                           "--scorer", "smollm2", "--prompts", prompts, "--max-new-tokens", "2",
                           "--save-outputs", outs, "--out", prompts)
    assert code == 2 and "refusing to overwrite input file" in _one_error(err) and "loading model" not in err
    from specpilot.auditors.outputs import Prompt
    from specpilot.auditors.systems import load_system, parse_system

    got = load_system(parse_system("engine:mode=ar,model=tiny"), [Prompt(0, [1, 2])], 2,
                      save_to=str(tmp_path / "stock.jsonl"))
    assert [r.system for r in got.rows] == ["engine:model=tiny,mode=ar"]
    assert json.loads((tmp_path / "stock.jsonl").read_text())["system"] == "engine:model=tiny,mode=ar"


def test_run_refuses_a_prompt_it_cannot_run_before_running_any(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2]},
                               {"schema": "specpilot.prompts/1", "id": "b", "prompt_ids": [1, 300]}]))
    for batch in ("1", "2"):
        code, _, err = run_cli("run", "--model", "tiny", "--prompts", prompts, "--max-new-tokens", "2",
                               "--batch", batch, "--outputs-out", tmp_path / "o.jsonl")
        assert code == 2 and "prompt 'b': prompt token id 300 is outside the vocabulary" in _one_error(err)
        assert not (tmp_path / "o.jsonl").exists()
    for option in ("--outputs-out", "--lattice-out"):
        code, _, err = run_cli("run", "--model", "tiny", "--prompt-ids", "1,2", option, "")
        assert code == 2 and f"'{option}': an empty path" in _one_error(err)


@pytest.mark.parametrize("verb", ["round", "audit", "compare"])
def test_a_prompt_an_engine_cannot_run_is_refused_before_any_system_runs(verb, run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": "good", "prompt_ids": [10, 20, 30]},
                               {"schema": "specpilot.prompts/1", "id": "long", "prompt_ids": [5] * 300}]))
    tight = "engine:model=tiny,mode=tree,nodes=4,ctx=256"
    args = {"round": ["round", tight, "--prompts", prompts, "--out-dir", tmp_path / "r", "--budget", "1",
                      "--max-new-tokens", "8"],
            "audit": ["audit", tight, "--against", "engine:model=tiny,mode=ar", "--scorer", "smollm2", "--prompts",
                      prompts, "--max-new-tokens", "8", "--save-outputs", tmp_path / "so"],
            "compare": ["compare", "--base", "engine:model=tiny,mode=ar", "--candidate", tight, "--prompts", prompts,
                        "--max-new-tokens", "8", "--runs", "2"]}[verb]
    code, _, err = run_cli(*args)
    line = _one_error(err)
    want = ("prompt 'long': 300 tokens + 8 new tokens + 43 cache slots for draft rows do not fit the engine's cache "
            "(ctx=256)" if verb == "round"   # the largest tree the round runs
            else "prompt 'long': 300 tokens + 8 new tokens + 15 slots for draft rows need 323 cache slots; the engine "
                 "has ctx=256")
    assert code == 2 and want in line, line
    assert "loading model" not in err and not (tmp_path / "r").exists() and not (tmp_path / "so").exists()


def test_a_draft_model_of_another_vocabulary_is_refused_before_either_loads(run_cli):
    code, _, err = run_cli("run", "--model", "smollm2", "--random-weights", "--drafter", "model", "--prompt-ids", "1,2",
                           "--max-new-tokens", "2")
    assert code == 2 and "draft model tiny has a vocabulary of 256" in _one_error(err) and "loading model" not in err


def test_audit_checks_an_engine_systems_draft_model_first(run_cli, tmp_path):
    code, _, err = run_cli("audit", "engine:model=tiny,drafter=model,draft_model=" + str(tmp_path / "none"),
                           "--against", "engine:model=tiny,mode=ar", "--scorer", "smollm2", "--prompts",
                           REPO / "examples" / "prompts.jsonl", "--save-outputs", tmp_path / "so")
    assert code == 2 and "draft_model: unknown model" in _one_error(err) and "loading model" not in err


def test_report_keeps_the_round_and_refuses_one_missing_a_finished_stage(run_cli, tmp_path):
    import shutil

    r = tmp_path / "r"
    shutil.copytree(REPO / "examples" / "rounds" / "smollm2-cpu", r)
    before = (r / "round.json").read_text()
    code, _, err = run_cli("report", r, "--out", r / "round.json")
    assert code == 2 and "refusing to overwrite input file" in _one_error(err)
    assert (r / "round.json").read_text() == before
    (r / "approve" / "decisions.json").unlink()
    code, _, err = run_cli("report", r)
    assert code == 2 and "decisions.json: missing, though round.json says the approve stage is done" in _one_error(err)
    shutil.copy(REPO / "examples" / "rounds" / "smollm2-cpu" / "approve" / "decisions.json", r / "approve")
    for name in ("record.yaml", "changes.json"):   # a recorded round's stage 5 files (the report left out a paragraph)
        kept = (r / "remember" / name).read_bytes()
        (r / "remember" / name).unlink()
        code, _, err = run_cli("report", r)
        assert code == 2 and f"{name}: missing, though round.json says the remember stage is done" in _one_error(err)
        (r / "remember" / name).write_bytes(kept)
    code, _, err = run_cli("report", r)
    assert code == 0, err


def test_compare_ends_a_hung_command_after_the_default_timeout(run_cli, tmp_path, monkeypatch, own_folder):
    """No --timeout: 10 x the slowest base run, at least AUTO_TIMEOUT_MIN_S (lowered here)."""
    from specpilot.auditors import pairing

    monkeypatch.setattr(pairing, "AUTO_TIMEOUT_MIN_S", 1.0)
    pidfile = tmp_path / "pid"
    cand = f"if [ -e {tmp_path}/once ]; then echo $$ > {pidfile}; sleep 300; fi; touch {tmp_path}/once"
    code, _, err = run_cli("compare", "--base-cmd", "sleep 0.01", "--candidate-cmd", cand, "--runs", "2",
                           "--warmup", "1")
    assert code == 2, err
    line = _one_error(err)
    # the limit is 10 x the slowest base run or the (lowered) minimum, whichever is larger: a loaded
    # machine's `sleep 0.01` can take 0.1 s
    m = re.search(r"candidate command ran past the default limit of ([\d.]+) s \(10 x the slowest base run, "
                  r"([\d.]+) s, at least 1 s; set --timeout\)", line)
    assert m and float(m[1]) == pytest.approx(max(1.0, 10 * float(m[2])), rel=0.01), line
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # its process group was ended


def test_compare_help_states_the_default_timeout(run_cli):
    code, out, _ = run_cli("compare", "--help")
    assert code == 0 and "10 x the slowest base run" in " ".join(out.split()) and "--resume" in out


def test_run_timeout_rule():
    from specpilot.auditors.pairing import AUTO_TIMEOUT_MIN_S, FIRST_RUN_TIMEOUT_S, RunTimeout

    t = RunTimeout()
    assert t.seconds() == FIRST_RUN_TIMEOUT_S
    t.observe("candidate", 50.0)
    assert t.seconds() == FIRST_RUN_TIMEOUT_S  # only base (A) runs set it
    t.observe("base", 2.0)
    assert t.seconds() == AUTO_TIMEOUT_MIN_S
    t.observe("base", 30.0)
    t.observe("base", 5.0)
    assert t.seconds() == 300.0
    assert RunTimeout(7.5).seconds() == 7.5


# ---------------------------------------------------------------------------------- ci_gate.sh

@pytest.mark.parametrize("check_code, expect", [
    (0, (0, "no regression, audit passed")),
    (1, (1, "a regression beyond the noise or a failed audit")),
    (2, (2, "check failed on bad input (exit 2")),
    (3, (3, "check failed: missing environment (exit 3")),
    (130, (130, "check failed (exit 130")),
])
def test_ci_gate_reports_the_real_reason(tmp_path, check_code, expect):
    stub = tmp_path / "specpilot"
    stub.write_text(f"#!/bin/sh\ncase \"$1\" in check) echo 'specpilot: error: x' >&2; exit {check_code};; esac\n"
                    "exit 99\n")
    stub.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "examples" / "ci_gate.sh")], capture_output=True, text=True,
                          env=dict(os.environ, SPECPILOT=str(stub), OUT_DIR=str(tmp_path / "out")))
    assert proc.returncode == expect[0] and expect[1] in proc.stderr, proc.stderr


def test_ci_gate_takes_paths_from_where_it_is_called(tmp_path):
    """BASELINE and OUT_DIR relative to the caller's folder (the script's cd to the repository made
    them the repository's: a baseline beside the caller was 'no such file', the results went into
    the checkout)."""
    stub = tmp_path / "specpilot"
    stub.write_text('#!/bin/sh\n[ -f "$3" ] || { echo "specpilot: error: $3: no such file" >&2; exit 2; }\n'
                    'echo "checked $3"\n')
    stub.chmod(0o755)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "baseline.json").write_text("{}")
    proc = subprocess.run(["bash", str(REPO / "examples" / "ci_gate.sh"), "mine/baseline.json"], capture_output=True,
                          text=True, cwd=tmp_path, env=dict(os.environ, SPECPILOT="./specpilot", OUT_DIR="res"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "res" / "check.txt").read_text() == "checked mine/baseline.json\n"
    assert not (REPO / "res").exists()


# ------------------------------------------------------------------ long work in a non-tty

def test_non_tty_progress_lines_and_loading_model_line(run_cli, tmp_path, monkeypatch, own_folder):
    """stderr is not a terminal here (as in CI): plain progress lines, no carriage returns."""
    from specpilot import machine

    monkeypatch.setattr(machine, "_announced", set())
    monkeypatch.setenv("SPECPILOT_PROGRESS_SECONDS", "0")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [1, 2 + i]}
                               for i in range(3)]))
    code, _, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompts", prompts, "--max-new-tokens", "3")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0] == "specpilot: loading model tiny (ar, cpu) ..."
    assert "specpilot: CPU engine: 1 torch thread (tiny model)" in lines
    assert [ln for ln in lines if "/3 " in ln] and "\r" not in err
    code, _, err = run_cli("compare", "--base-cmd", "true", "--candidate-cmd", "true", "--runs", "4", "--warmup", "0")
    assert code == 1 and "paired runs: 4/4 pair" in err, err


def test_progress_is_quiet_for_short_work_without_a_tty(run_cli, tmp_path):
    """The first line waits for the interval (15 s by default): quick runs print nothing."""
    p = tmp_path / "lat.jsonl"
    p.write_text(_jsonl(LATTICE))
    code, _, err = run_cli("replay", p)
    assert code == 0 and err == "", err


@pytest.mark.parametrize("value, argv", [
    ("abc", ["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200"]),   # a verb that shows no progress
    ("nan", ["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200"]),
    ("inf", ["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200"]),
    ("-5", ["run", "--model", "tiny", "--prompt", "hi"]),
])
def test_a_progress_interval_that_is_not_a_number_of_seconds_is_bad_input(run_cli, monkeypatch, value, argv):
    from specpilot.output import progress

    monkeypatch.setenv("SPECPILOT_PROGRESS_SECONDS", value)
    code, out, err = run_cli(*argv)
    assert code == 2 and out == "", err
    assert _one_error(err).startswith(f"specpilot: error: SPECPILOT_PROGRESS_SECONDS={value!r}: give the seconds")
    assert "loading model" not in err
    with pytest.raises(InputError, match="SPECPILOT_PROGRESS_SECONDS"):   # read where the progress line is made too
        progress(total=1)
    code, out, err = run_cli(argv[0], "--help")   # a verb's help runs nothing: shown whatever the value
    assert code == 0 and out.startswith(f"Usage: specpilot {argv[0]}") and err == "", err


# ------------------------------------------------------------------------------ CPU threads

def test_default_cpu_threads_leave_room_for_the_load(monkeypatch):
    from specpilot import machine

    monkeypatch.setattr(machine, "physical_cores", lambda: 8)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (13.6, 0, 0))
    assert machine.default_cpu_threads()[0] == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0, 0))
    n, why = machine.default_cpu_threads()
    assert n == 8 and "8 physical cores" in why
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 0, 0))
    assert machine.default_cpu_threads()[0] == 1


def test_cpu_engine_prints_its_threads_once(run_cli, tmp_path, monkeypatch):
    from specpilot import machine

    monkeypatch.setattr(machine, "_announced", set())
    cfg = tmp_path / "small"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": True}))
    base = ["run", "--model", cfg, "--random-weights", "--mode", "ar", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    code, _, err = run_cli(*base)
    assert code == 0, err
    (line,) = [ln for ln in err.splitlines() if "CPU engine:" in ln]
    assert "physical cores, load average" in line and "--threads overrides" in line
    code, _, err = run_cli(*base)
    assert code == 0 and "CPU engine:" not in err  # once per process
    monkeypatch.setattr(machine, "_announced", set())
    code, _, err = run_cli(*base, "--threads", "2")
    assert "specpilot: CPU engine: 2 torch threads (--threads)" in err.splitlines(), err


def test_a_progress_line_cut_short_while_being_built_closes_quietly(monkeypatch):
    """A signal inside tqdm's constructor leaves the line without its position; closing it (as its
    __del__ does at exit) must not raise (a SIGTERM there printed a traceback)."""
    from specpilot.output import progress

    monkeypatch.setenv("SPECPILOT_PROGRESS_SECONDS", "15")
    cls = type(progress(total=1))
    half = cls.__new__(cls)
    half.disable = False   # set early in tqdm's __init__; ``pos`` comes later
    half.close()


@pytest.mark.parametrize("argv", [("run", "--model", "nosuch", "--prompt", "hi"), ("serve", "--model", "nosuch"),
                                  ("run", "--model", "llama-3.1-8b", "--prompt", "hi")])
def test_a_bad_model_is_refused_before_torch_is_imported(argv, tmp_path):
    """``run`` and ``serve`` check the model before importing the engine (torch: seconds)."""
    from conftest import cli_imports, refused

    code, out, err, imported = cli_imports(*argv, cwd=tmp_path)
    refused(code, err, "unknown model 'nosuch'" if "nosuch" in argv else "is a catalog config with no weights")
    assert out == "" and imported == [], imported


@pytest.mark.parametrize("argv", [
    ["round", "engine:model=tiny,mode=ar", "--dry-run", "--scorer", ""],
    ["check", "--baseline", "examples/rounds/smollm2-cpu", "--scorer", ""],
    ["audit", "a.jsonl", "--against", "b.jsonl", "--scorer", ""],
    ["apply", "tree", "--model", "", "--dry-run"],
])
def test_an_empty_scorer_or_model_is_refused_in_every_verb(run_cli, argv):
    """round and check took --scorer '' as the default scorer, apply wrote --model-path ''."""
    from pathlib import Path

    argv = [str(Path(__file__).resolve().parents[1] / a) if a.startswith("examples/") else a for a in argv]
    code, out, err = run_cli(*argv)
    assert code == 2 and out == "" and "empty; give a value" in _one_error(err), err
    # audit's --scorer is required: "leave it out" would be refused next
    assert ("leave --scorer out" in err) == (argv[0] != "audit" and "--scorer" in argv), err
