"""``specpilot w12 pack|verify|stats`` through the CLI, on real files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

Q = "model.layers.0.self_attn.q_proj.weight"
D = "model.layers.0.mlp.down_proj.weight"


def make_checkpoint(path, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {Q: (torch.randn(130, 192, generator=g) * 0.02).bfloat16(),
         D: (torch.randn(48, 200, generator=g) * 0.02).bfloat16(),
         "model.embed_tokens.weight": (torch.randn(100, 64, generator=g) * 0.02).bfloat16(),
         "model.norm.weight": torch.ones(64),
         "model.layers.0.mlp.up_proj.weight": torch.randn(8, 64, generator=g)}  # fp32: not converted
    t[Q][0, :5] = 0.0
    save_file(t, str(path), metadata={"format": "pt"})
    return t


def flip_byte_in(path, tensor_name, offset_in_tensor=100):
    raw = bytearray(path.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    start, end = header[tensor_name]["data_offsets"]
    pos = 8 + hlen + start + min(offset_in_tensor, end - start - 1)
    raw[pos] ^= 0x10
    path.write_bytes(bytes(raw))


def test_pack_verify_stats_round_trip(tmp_path, run_cli):
    src, dst = tmp_path / "m.safetensors", tmp_path / "m.w12.safetensors"
    orig = make_checkpoint(src)
    code, out, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 0, err
    assert "2 tensors converted" in out and "not bf16" in out
    stored = load_file(str(dst))
    assert f"{Q}.w12.records" in stored and Q not in stored
    assert torch.equal(stored["model.norm.weight"], orig["model.norm.weight"])
    code, out, err = run_cli("w12", "verify", dst, "--against", src)
    assert code == 0 and "OK: 2 W12 tensors" in out, err
    code, out, err = run_cli("w12", "stats", dst, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "specpilot.w12-stats/1"
    assert 12.0 < doc["bits_per_weight"] < 16 and doc["escape_rate"] > 0
    assert {t["name"] for t in doc["tensors"]} == {Q, D}


def test_verify_catches_a_corrupted_record(tmp_path, run_cli):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    flip_byte_in(dst, f"{D}.w12.records", 777)
    code, out, err = run_cli("w12", "verify", dst, "--against", src)
    assert code == 1
    assert D in err and "verify failed" in err
    code, out, err = run_cli("w12", "verify", dst)   # the CRC catches it without the original too
    assert code == 1 and D in err


def test_verify_catches_a_different_checkpoint_by_bits(tmp_path, run_cli):
    from specpilot.kernels.w12.checkpoint import verify

    a, b, dst = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(a, seed=0)
    t = make_checkpoint(b, seed=0)
    t[Q] = t[Q].clone()
    t[Q][5, 7] = -t[Q][5, 7]   # one weight, one bit
    save_file(t, str(b))
    assert run_cli("w12", "pack", a, "-o", dst)[0] == 0
    res = verify(str(dst), str(b))
    assert not res.ok and res.mismatched[0][0] == Q and "1 weights differ" in res.mismatched[0][1]
    code, _, err = run_cli("w12", "verify", dst, "--against", b)
    assert code == 1 and Q in err
    # a reference without some kept tensor says it is missing, not that it differs
    del t["model.norm.weight"]
    t[Q] = load_file(str(a))[Q]
    save_file(t, str(b))
    assert dict(verify(str(dst), str(b)).mismatched) == {"model.norm.weight": "kept tensor not in the reference checkpoint"}


def test_sharded_folder(tmp_path, run_cli):
    folder = tmp_path / "model"
    folder.mkdir()
    t = make_checkpoint(folder / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": (torch.randn(100, 64) * 0.02).bfloat16(),
               "model.layers.1.self_attn.o_proj.weight": (torch.randn(64, 64) * 0.02).bfloat16()},
              str(folder / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in t}
    wm.update({"lm_head.weight": "model-00002-of-00002.safetensors",
               "model.layers.1.self_attn.o_proj.weight": "model-00002-of-00002.safetensors"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (folder / "config.json").write_text("{}")
    out = tmp_path / "model-w12"
    code, stdout, err = run_cli("w12", "pack", folder, "-o", out, "--format", "json")
    assert code == 0, err
    assert json.loads(stdout)["converted"] == 3
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["weight_map"]["model.layers.1.self_attn.o_proj.weight.w12.records"] == "model-00002-of-00002.safetensors"
    assert (out / "config.json").is_file()
    assert run_cli("w12", "verify", out, "--against", folder)[0] == 0
    code, stdout, _ = run_cli("w12", "stats", out)
    assert code == 0 and "3 tensors" in stdout


def test_include_exclude_and_report_file(tmp_path, run_cli):
    src, dst, rep = tmp_path / "m.safetensors", tmp_path / "w.safetensors", tmp_path / "rep.json"
    make_checkpoint(src)
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--include", "*embed*", "--exclude", "nothing",
                             "--format", "json", "--out", rep)
    assert code == 0, err
    doc = json.loads(rep.read_text())
    assert doc["converted"] == 1 and doc["tensors"][0]["name"] == "model.embed_tokens.weight"


@pytest.mark.parametrize("args,needle", [
    (["w12", "pack", "missing.safetensors", "-o", "x.safetensors"], "no such file"),
    (["w12", "stats", "missing"], "no such file"),
    (["w12", "verify", "missing", "--against", "m.safetensors"], "no such file"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, run_cli, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    make_checkpoint(tmp_path / "m.safetensors")
    code, out, err = run_cli(*args)
    assert code == 2
    assert err.startswith("specpilot: error:") and needle in err and len(err.strip().splitlines()) == 1


def test_bad_input_leaves_no_output(tmp_path, run_cli):
    src = tmp_path / "m.safetensors"
    make_checkpoint(src)
    # nothing matches: no output file
    code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "o.safetensors", "--include", "nope*")
    assert code == 2 and "no tensor matched" in err
    # output into a missing folder
    code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "nofolder" / "o.safetensors")
    assert code == 2 and err.startswith("specpilot: error:")
    # output onto the input
    code, _, err = run_cli("w12", "pack", src, "-o", src)
    assert code == 2
    assert load_file(str(src))[Q].dtype == torch.bfloat16   # the input is untouched
    # the report onto the packed file, or a name verify and stats would not read: refused before packing
    for args, what in ((["-o", tmp_path / "p.safetensors", "--out", tmp_path / "p.safetensors"], "the same file as --output"),
                       (["-o", tmp_path / "p.w12"], "name a .safetensors file")):
        code, _, err = run_cli("w12", "pack", src, *args)
        assert code == 2 and what in err and not (tmp_path / "p.safetensors").exists() and not (tmp_path / "p.w12").exists()
    # a plain (unpacked) file is not a W12 checkpoint
    code, _, err = run_cli("w12", "stats", src)
    assert code == 2 and "pack it first" in err
    # not a safetensors file at all
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 40)
    code, _, err = run_cli("w12", "stats", junk)
    assert code == 2 and err.startswith("specpilot: error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.safetensors", "m.safetensors"]


def test_device_option(tmp_path, run_cli):
    src = tmp_path / "m.safetensors"
    make_checkpoint(src)
    code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "o.safetensors", "--device", "tpu")
    assert code == 2 and "--device tpu" in err
    if not torch.cuda.is_available():
        code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "o.safetensors", "--device", "cuda")
        assert code == 3 and "no CUDA device" in err
    assert run_cli("w12", "pack", src, "-o", tmp_path / "o.safetensors", "--device", "cpu")[0] == 0
    assert run_cli("w12", "verify", tmp_path / "o.safetensors", "--against", src, "--device", "auto")[0] == 0


def read_packed(path):
    """(tensors, safetensors metadata, the parsed specpilot.w12 document) of a packed file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    return load_file(str(path)), meta, json.loads(meta["specpilot.w12"])


def write_packed(path, tensors, meta, doc):
    save_file(tensors, str(path), metadata={**meta, "specpilot.w12": json.dumps(doc)})


def test_format_1_files_are_still_read(tmp_path, run_cli):
    """A checkpoint written by format 1 (windows as bytes, int32 positions) stats and verifies."""
    src, dst, old = tmp_path / "m.safetensors", tmp_path / "w.safetensors", tmp_path / "v1.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    from specpilot.kernels.w12.checkpoint import _crc, load_w12, w12_info

    tensors, meta, doc = read_packed(dst)
    for name, entry in w12_info(meta, "x").items():
        t = load_w12(tensors, name, entry, "x")
        tensors[f"{name}.w12.low_exp"] = t.low_exp.clone()
        tensors[f"{name}.w12.esc_pos"] = t.esc_pos.to(torch.int32)
        e = doc["tensors"][name]
        for k in ("low_base", "escapes"):
            e.pop(k)
        e["crc32"]["low_exp"] = _crc(tensors[f"{name}.w12.low_exp"])
        e["crc32"]["esc_pos"] = _crc(tensors[f"{name}.w12.esc_pos"])
    doc["version"] = 1
    write_packed(old, tensors, meta, doc)
    code, out, err = run_cli("w12", "verify", old, "--against", src)
    assert code == 0, err
    code, out, err = run_cli("w12", "stats", old, "--format", "json")
    assert code == 0 and json.loads(out)["escape_rate"] > 0


def test_escape_count_mismatch_is_a_format_error(tmp_path, run_cli):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    doc["tensors"][Q]["escapes"] += 1
    write_packed(dst, tensors, meta, doc)
    code, out, err = run_cli("w12", "stats", dst)
    assert code == 2 and "escape positions" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("crc", [None, "x", {"records": "1"}], ids=["null", "string", "string-value"])
def test_a_damaged_crc_table_is_reported_not_a_crash(tmp_path, run_cli, crc):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    doc["tensors"][Q]["crc32"] = crc
    write_packed(dst, tensors, meta, doc)
    code, out, err = run_cli("w12", "stats", dst)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    code, out, err = run_cli("w12", "verify", dst)
    assert code == 1 and f"{Q}: {Q}" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("version", [True, 3, "2"])
def test_a_version_this_reader_does_not_know_is_refused(tmp_path, run_cli, version):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    doc["version"] = version   # true == 1 to Python, but no W12 file says so
    write_packed(dst, tensors, meta, doc)
    code, _, err = run_cli("w12", "stats", dst)
    assert code == 2 and "is not supported" in err and len(err.strip().splitlines()) == 1, err
