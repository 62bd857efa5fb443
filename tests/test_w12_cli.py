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
    assert code == 0 and "OK: 2 converted tensors restored and identical" in out, err
    code, out, err = run_cli("w12", "stats", dst, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "specpilot.w12-stats/1"
    assert 12.0 < doc["bits_per_weight"] < 16 and doc["escape_rate"] > 0
    assert {t["name"] for t in doc["tensors"]} == {Q, D}
    # a small file's sizes in KiB with three digits, both in one unit
    code, out, err = run_cli("w12", "stats", dst)
    kib = lambda n: f"{n / 1024:.3g}"   # noqa: E731
    assert code == 0 and f"({kib(doc['w12_bytes'])} KiB vs {kib(doc['bf16_bytes'])} KiB bf16)" in out, out


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
    # the report inside the output folder: refused before packing (it packed, then refused the report)
    out.mkdir()
    code, _, err = run_cli("w12", "pack", folder, "-o", out, "--out", out / "report.json")
    assert code == 2 and f"--out {out / 'report.json'}: inside the output folder {out}" in err
    assert list(out.iterdir()) == []
    code, stdout, err = run_cli("w12", "pack", folder, "-o", out, "--format", "json")
    assert code == 0, err
    assert json.loads(stdout)["converted"] == 3
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["weight_map"]["model.layers.1.self_attn.o_proj.weight.w12.records"] == "model-00002-of-00002.safetensors"
    assert (out / "config.json").is_file()
    assert run_cli("w12", "verify", out, "--against", folder)[0] == 0
    code, stdout, _ = run_cli("w12", "stats", out)
    assert code == 0 and "3 tensors" in stdout


def test_a_packed_folder_s_files_all_get_the_umask_mode(tmp_path, run_cli):
    """The config and tokenizer files copied beside the shards are new files too: a world-writable
    source must not make a world-writable copy under umask 077."""
    import os
    import stat

    folder = tmp_path / "model"
    folder.mkdir()
    make_checkpoint(folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    (folder / "config.json").chmod(0o666)
    old = os.umask(0o077)
    try:
        code, _, err = run_cli("w12", "pack", folder, "-o", tmp_path / "out")
    finally:
        os.umask(old)
    assert code == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes == {"model.safetensors": 0o600, "config.json": 0o600}, modes
    assert (tmp_path / "out" / "config.json").read_text() == "{}"


def test_an_index_naming_a_tensor_no_shard_holds_is_warned_of(tmp_path, run_cli):
    folder = tmp_path / "model"
    folder.mkdir()
    t = make_checkpoint(folder / "model-00001-of-00001.safetensors")
    wm = {k: "model-00001-of-00001.safetensors" for k in [*t, "model.layers.9.mlp.down_proj.weight"]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = tmp_path / "model-w12"
    code, stdout, err = run_cli("w12", "pack", folder, "-o", out, "--format", "json")
    assert code == 0, err
    line = ("model.safetensors.index.json names 1 tensor no shard holds (first: model.layers.9.mlp.down_proj.weight); "
            "the output's index lists only the tensors its shards hold")
    assert f"specpilot: warning: {line}" in err and json.loads(stdout)["warnings"] == [line]
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert not any(k.startswith("model.layers.9.") for k in idx["weight_map"])
    assert run_cli("w12", "verify", out, "--against", folder)[0] == 0


def _misindexed(tmp_path):
    """Two shards, the index naming only the second and putting the first's tensor in it."""
    folder = tmp_path / "model"
    folder.mkdir()
    g = torch.Generator().manual_seed(1)
    first = {D: (torch.randn(48, 200, generator=g) * 0.02).bfloat16()}
    second = {Q: (torch.randn(130, 192, generator=g) * 0.02).bfloat16()}
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    return folder, first, second


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_refused_before_anything_is_written(tmp_path, run_cli):
    folder, first, second = _misindexed(tmp_path)
    wm = {k: "model-00002-of-00002.safetensors" for k in [*first, *second]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = tmp_path / "model-w12"
    code, _, err = run_cli("w12", "pack", folder, "-o", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"names model-00002-of-00002.safetensors for {D}, which model-00001-of-00002.safetensors holds and the "
            "index does not name") in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_shard_the_index_does_not_name_is_copied_and_said(tmp_path, run_cli):
    folder, first, second = _misindexed(tmp_path)
    wm = {k: "model-00002-of-00002.safetensors" for k in second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = tmp_path / "model-w12"
    code, stdout, err = run_cli("w12", "pack", folder, "-o", out, "--format", "json")
    assert code == 0, err
    line = "model-00001-of-00002.safetensors is not named by model.safetensors.index.json: copied as it is, not packed"
    assert f"specpilot: warning: {line}" in err and line in json.loads(stdout)["warnings"]
    assert ((out / "model-00001-of-00002.safetensors").read_bytes()
            == (folder / "model-00001-of-00002.safetensors").read_bytes())
    assert run_cli("w12", "verify", out, "--against", folder)[0] == 0


def test_include_exclude_and_report_file(tmp_path, run_cli):
    src, dst, rep = tmp_path / "m.safetensors", tmp_path / "w.safetensors", tmp_path / "rep.json"
    make_checkpoint(src)
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--include", "*embed*", "--exclude", "nothing",
                             "--format", "json", "--out", rep)
    assert code == 0, err
    doc = json.loads(rep.read_text())
    assert doc["converted"] == 1 and doc["tensors"][0]["name"] == "model.embed_tokens.weight"


def test_include_wins_over_the_default_excludes(tmp_path, run_cli):
    """A tensor an --include names is converted although a default exclude (lm_head.weight) would keep
    it; an --exclude the user gives still drops it, and the error says that is why nothing matched."""
    src, dst = tmp_path / "single.safetensors", tmp_path / "lm.safetensors"
    head = (torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    save_file({"lm_head.weight": head, "model.norm.weight": torch.ones(64).bfloat16()}, str(src))
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--include", "lm_head.weight", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["converted"] == 1 and doc["tensors"][0]["name"] == "lm_head.weight"
    assert run_cli("w12", "verify", dst, "--against", src)[0] == 0
    dst.unlink()
    code, _, err = run_cli("w12", "pack", src, "-o", dst, "--include", "lm_head.weight", "--exclude", "lm_*")
    assert code == 2 and len(err.strip().splitlines()) == 1 and not dst.exists()
    assert "lm_head.weight matched --include but --exclude (lm_*) drops it; nothing written" in err
    # the default includes, dropped by the default excludes: the error names those
    save_file({"model.embed_proj.weight": head}, str(src))
    code, _, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 2 and not dst.exists()
    assert "model.embed_proj.weight matched --include but the default excludes (*embed*, lm_head.weight, *norm*) drop it" in err


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


@pytest.mark.parametrize("args,needle", [
    (["stats", "missing"], "no such file"),
    (["stats", "junk.safetensors"], "not a readable safetensors file"),
    (["stats", "m.safetensors"], "pack it first"),
    (["verify", "m.safetensors"], "pack it first"),
    (["verify", "packed", "--against", "junk.safetensors"], "not a readable safetensors file"),
    (["pack", "junk.safetensors", "-o", "o.safetensors"], "not a readable safetensors file"),
    (["pack", "shards", "-o", "out"], "shard"),
])
def test_a_bad_checkpoint_is_refused_before_torch_is_imported(tmp_path, args, needle):
    """What the W12 readers would refuse after loading torch (seconds) is refused from the files'
    headers first."""
    from conftest import cli_imports, refused

    make_checkpoint(tmp_path / "m.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x07" * 40)
    (tmp_path / "packed").mkdir()   # a folder whose one file carries W12 metadata
    save_file({"x": torch.zeros(1)}, str(tmp_path / "packed" / "a.safetensors"), metadata={"specpilot.w12": "{}"})
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {Q: "model-00001-of-00002.safetensors"}}))
    code, out, err, imported = cli_imports("w12", *args, cwd=tmp_path)
    refused(code, err, needle)
    assert imported == [], imported
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "out").exists()


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
        for k in ("low_base", "escapes", "sha256"):   # format 1 had no digest of the original
            e.pop(k)
        e["crc32"]["low_exp"] = _crc(tensors[f"{name}.w12.low_exp"])
        e["crc32"]["esc_pos"] = _crc(tensors[f"{name}.w12.esc_pos"])
    doc["version"] = 1
    write_packed(old, tensors, meta, doc)
    code, out, err = run_cli("w12", "verify", old, "--against", src)
    assert code == 0, err
    code, out, err = run_cli("w12", "verify", old)
    assert code == 0 and "restored (CRC and structure only: packed without the original's sha256)" in out, err
    code, out, err = run_cli("w12", "stats", old, "--format", "json")
    assert code == 0 and json.loads(out)["escape_rate"] > 0
    # the bytes the file holds: format 1's byte windows and int32 positions, not format 2's size
    held = sum(v.numel() * v.element_size() for k, v in tensors.items() if ".w12." in k)
    assert json.loads(out)["w12_bytes"] == held


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
    # a malformed table is bad input for verify too (exit 1 is a tensor that failed to restore)
    assert code == 2 and "W12 metadata field crc32" in err and f"{Q}: {Q}" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("field, value, words", [
    ("shape", "x", "field shape must be [rows, columns]"), ("shape", [64, 128, 1], "field shape must be"),
    ("rows_stored", 0, "field rows_stored must be a positive whole number"), ("low_base", -5, "field low_base"),
    ("escapes", "3", "field escapes must be a whole number"), ("k_pad", 64, "field k_pad must be the columns"),
    ("shape", [16, 192], "does not describe its stored parts"), ("sha256", "abc", "field sha256 must be 64")])
def test_a_malformed_w12_table_is_bad_input_for_stats_and_verify_alike(tmp_path, run_cli, field, value, words):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    doc["tensors"][Q][field] = value
    write_packed(dst, tensors, meta, doc)
    for args in (("w12", "stats", dst), ("w12", "verify", dst, "--against", src)):
        code, out, err = run_cli(*args)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)


@pytest.mark.parametrize("damage", ["a part removed", "an entry with no parts"])
def test_a_table_naming_parts_the_file_lacks_is_bad_input_for_stats_and_verify_alike(tmp_path, run_cli, damage):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    if damage == "a part removed":
        del tensors[f"{Q}.w12.esc_bits"]
    else:
        doc["tensors"]["ghost.weight"] = doc["tensors"][Q]
    write_packed(dst, tensors, meta, doc)
    for args in (("w12", "stats", dst), ("w12", "verify", dst), ("w12", "verify", dst, "--against", src)):
        code, out, err = run_cli(*args)
        assert code == 2 and "is missing" in err and len(err.strip().splitlines()) == 1, (args, out, err)


@pytest.mark.parametrize("table, words", [("{", "is not valid JSON"), ("[" * 100000 + "]" * 100000, "is nested too deeply")])
def test_an_unreadable_w12_table_names_the_file(tmp_path, run_cli, table, words):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, _ = read_packed(dst)
    save_file(tensors, str(dst), metadata={**meta, "specpilot.w12": table})
    for args in (("w12", "stats", dst), ("w12", "verify", dst)):
        code, _, err = run_cli(*args)
        assert code == 2 and f"{dst}: the specpilot.w12 metadata {words}" in err and err.count("\n") == 1, err


def test_verify_checks_the_restored_weights_against_the_originals_sha256(tmp_path, run_cli):
    """Without the original: a table whose parts are intact (CRC) but describe other weights than
    those pack was given (here: the digest of one flipped weight) fails the sha256 pack recorded."""
    import hashlib

    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    orig = make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    assert doc["tensors"][Q]["sha256"] == hashlib.sha256(orig[Q].view(torch.int16).numpy().tobytes()).hexdigest()
    other = orig[Q].clone()
    other[3, 4] = -other[3, 4]
    doc["tensors"][Q]["sha256"] = hashlib.sha256(other.view(torch.int16).numpy().tobytes()).hexdigest()
    write_packed(dst, tensors, meta, doc)
    code, out, err = run_cli("w12", "verify", dst)
    assert code == 1 and Q in err and "sha256" in err, err
    assert D not in err


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
    assert f"W12 version {version!r} tile [128, 64] is not supported (this SpecPilot reads version 1 or 2" in err


def test_pack_and_verify_count_converted_and_kept_tensors_alike(tmp_path, run_cli):
    """A tensor that matched --include but is not bf16 is kept: pack and verify both count it so."""
    src, dst, ref = tmp_path / "m.safetensors", tmp_path / "w.safetensors", tmp_path / "r.safetensors"
    t = make_checkpoint(src)
    code, out, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 0, err
    assert "2 tensors converted, 3 kept (1 not bf16)" in out
    code, out, err = run_cli("w12", "pack", src, "-o", tmp_path / "w2.safetensors", "--format", "json")
    packed = json.loads(out)
    assert (packed["converted"], packed["kept"]) == (2, 3)
    code, out, err = run_cli("w12", "verify", dst, "--against", src, "--format", "json")
    doc = json.loads(out)
    assert code == 0 and (doc["converted"], doc["kept"], doc["checked"], doc["kept_checked"]) == (2, 3, 2, 3)
    code, out, _ = run_cli("w12", "verify", dst, "--against", src)
    assert "OK: 2 converted tensors restored and identical to" in out and ", 3 kept tensors identical" in out
    code, out, _ = run_cli("w12", "verify", dst)
    assert code == 0 and ("2 converted tensors restored (CRC, structure and the original's sha256), 3 kept tensors "
                          "not compared") in out
    # a reference lacking one converted and one kept tensor, holding one the packed file lacks: each
    # is counted once, as not identical, and the extra one as missing
    del t[Q], t["model.norm.weight"]
    t["extra.weight"] = torch.ones(3)
    save_file(t, str(ref))
    code, out, err = run_cli("w12", "verify", dst, "--against", ref, "--format", "json")
    doc = json.loads(out)
    assert code == 1 and (doc["converted"], doc["kept"], doc["checked"], doc["kept_checked"]) == (2, 3, 1, 2)
    assert doc["missing"] == ["extra.weight"]
    assert {m["tensor"]: m["what"] for m in doc["mismatches"]} == {
        Q: "not in the reference checkpoint", "model.norm.weight": "kept tensor not in the reference checkpoint",
        "extra.weight": "missing from the packed checkpoint"}
    code, out, _ = run_cli("w12", "verify", dst, "--against", ref)
    assert ("FAILED: 1 of 2 converted tensors restored and identical to" in out
            and "2 of 3 kept tensors identical; 1 tensor of" in out and "missing" in out)


def test_kept_scalar_tensors_are_compared_by_their_bytes(tmp_path, run_cli):
    """A 0-D tensor (a checkpoint's logit scale) kept as it was: verify compares it, no crash."""
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    t = make_checkpoint(src)
    t["logit_scale"], t["temperature"] = torch.tensor(1.5).bfloat16(), torch.tensor(2.0)
    save_file(t, str(src))
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    code, out, err = run_cli("w12", "verify", dst, "--against", src)
    assert code == 0 and ", 5 kept tensors identical" in out, out + err
    t["logit_scale"] = torch.tensor(1.25).bfloat16()
    save_file(t, str(src))
    code, out, err = run_cli("w12", "verify", dst, "--against", src, "--format", "json")
    assert code == 1 and {m["tensor"]: m["what"] for m in json.loads(out)["mismatches"]} == {
        "logit_scale": "kept tensor differs from the reference"}, out + err


def test_tensors_the_includes_pick_that_are_not_2d_are_named_as_kept(tmp_path, run_cli):
    """A stacked experts tensor (3-D) matches the default ``*experts*.weight``: pack keeps it and
    says why, in the summary, the JSON and the error when nothing else converts."""
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    t = make_checkpoint(src)
    E = "model.layers.0.mlp.experts.weight"
    t[E] = (torch.randn(2, 8, 16) * 0.02).bfloat16()
    Z = "model.layers.0.self_attn.k_proj.weight"   # empty: kept and listed too
    t[Z] = torch.zeros(0, 16).bfloat16()
    save_file(t, str(src))
    code, out, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 0 and "tensors converted, 5 kept (1 not bf16, 1 empty, 1 not 2-D)" in out, out + err
    assert f"not converted (not 2-D): {E}" in out and f"not converted (empty): {Z}" in out
    code, out, err = run_cli("w12", "pack", src, "-o", tmp_path / "w2.safetensors", "--format", "json")
    assert code == 0 and json.loads(out)["skipped_not_2d"] == [E]
    only = tmp_path / "e.safetensors"
    save_file({E: t[E], "model.norm.weight": t["model.norm.weight"]}, str(only))
    code, _, err = run_cli("w12", "pack", only, "-o", tmp_path / "e.w12.safetensors")
    assert code == 2 and f"1 tensors it matches are not 2-D (first: {E}, kept as they are)" in err
    assert not (tmp_path / "e.w12.safetensors").exists()


def test_a_tensor_named_in_two_files_of_a_folder_is_refused(tmp_path, run_cli):
    """Without an index a folder's files are read in turn: which copy a reader takes would be chance."""
    d = tmp_path / "dup"
    d.mkdir()
    w = torch.randn(16, 16).bfloat16()
    save_file({Q: w}, str(d / "a.safetensors"))
    save_file({Q: w + 1, D: w}, str(d / "b.safetensors"))
    for args in (("w12", "pack", d, "-o", tmp_path / "out"), ("w12", "stats", d)):
        code, _, err = run_cli(*args)
        assert code == 2 and f"tensor {Q} is in both a.safetensors and b.safetensors" in err, (args, err)
    assert not (tmp_path / "out").exists()


def test_sharded_index_states_the_packed_total_size(tmp_path, run_cli):
    """The index's total_size is the byte size of the tensors it maps (what transformers writes)."""
    folder, out = tmp_path / "model", tmp_path / "model-w12"
    folder.mkdir()
    a = make_checkpoint(folder / "a.safetensors")
    b = {"model.layers.1.self_attn.o_proj.weight": (torch.randn(64, 64) * 0.02).bfloat16()}
    save_file(b, str(folder / "b.safetensors"))
    total_in = sum(v.numel() * v.element_size() for v in [*a.values(), *b.values()])
    wm = {**{k: "a.safetensors" for k in a}, **{k: "b.safetensors" for k in b}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total_in},
                                                                     "weight_map": wm}))
    assert run_cli("w12", "pack", folder, "-o", out)[0] == 0
    meta = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
    total_out = sum(v.numel() * v.element_size() for f in ("a", "b")
                    for v in load_file(str(out / f"{f}.safetensors")).values())
    assert total_out != total_in
    assert meta == {"total_size": total_out, "specpilot.w12": "specpilot.w12/1"}


@pytest.mark.parametrize("dtype", ["float16", None], ids=["float16", "absent"])
def test_a_w12_dtype_other_than_bf16_is_refused(tmp_path, run_cli, dtype):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    if dtype is None:
        del doc["tensors"][Q]["dtype"]
    else:
        doc["tensors"][Q]["dtype"] = dtype
    write_packed(dst, tensors, meta, doc)
    for args in (["stats", dst], ["verify", dst], ["verify", dst, "--against", src]):
        code, _, err = run_cli("w12", *args)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert str(dst) in err and Q in err and f"dtype {'is missing' if dtype is None else f'is {dtype!r}'}" in err


def _signal_after(monkeypatch, target, signum):
    """Make ``os.replace`` onto ``target`` send this process ``signum`` right after the rename."""
    import os

    real = os.replace

    def replace(a, b, *args, **kw):
        real(a, b, *args, **kw)
        if os.fspath(b) == os.fspath(target):
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "folder"])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_after_the_output_is_renamed_into_place_is_success(tmp_path, run_cli, monkeypatch, sharded,
                                                                    signame):
    import signal

    if sharded:
        src, dst = tmp_path / "model", tmp_path / "model-w12"
        src.mkdir()
        make_checkpoint(src / "a.safetensors")
    else:
        src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
        make_checkpoint(src)
    _signal_after(monkeypatch, dst, getattr(signal, signame))
    code, out, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 0, err
    assert "interrupted" not in err and "2 tensors converted" in out
    monkeypatch.undo()
    assert run_cli("w12", "verify", dst, "--against", src)[0] == 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_a_signal_while_the_pack_report_is_written_is_success(tmp_path, run_cli, monkeypatch):
    import os
    import signal

    from specpilot.commands import w12

    src, dst, rep = tmp_path / "m.safetensors", tmp_path / "w.safetensors", tmp_path / "rep.json"
    make_checkpoint(src)
    real = w12.emit

    def emit(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        real(*a, **kw)

    monkeypatch.setattr(w12, "emit", emit)
    code, _, err = run_cli("w12", "pack", src, "-o", dst, "--format", "json", "--out", rep)
    assert code == 0 and f"{dst} is complete, its report was not written" in err, err
    monkeypatch.undo()
    assert not rep.exists() and run_cli("w12", "verify", dst, "--against", src)[0] == 0


def test_a_signal_before_the_rename_still_stops_the_pack(tmp_path, run_cli, monkeypatch):
    import os
    import signal

    from specpilot.kernels.w12 import checkpoint

    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    real = checkpoint._save_bytes

    def save_bytes(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    monkeypatch.setattr(checkpoint, "_save_bytes", save_bytes)
    code, _, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 143 and "interrupted by SIGTERM" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_out_never_overwrites_a_file_inside_an_input_folder(tmp_path, run_cli):
    """--out is the report: a file of the checkpoint folder read is an input, like a file named as one."""
    src = tmp_path / "model"
    src.mkdir()
    make_checkpoint(src / "model.safetensors")
    before = (src / "model.safetensors").read_bytes()
    code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "w", "--out", src / "model.safetensors")
    assert code == 2 and "refusing to overwrite a file of input folder" in err and not (tmp_path / "w").exists()
    assert (src / "model.safetensors").read_bytes() == before
    assert run_cli("w12", "pack", src, "-o", tmp_path / "w")[0] == 0
    packed = (tmp_path / "w" / "model.safetensors").read_bytes()
    code, _, err = run_cli("w12", "stats", tmp_path / "w", "--out", tmp_path / "w" / "model.safetensors")
    assert code == 2 and (tmp_path / "w" / "model.safetensors").read_bytes() == packed
    # a new file beside them is not an input
    assert run_cli("w12", "stats", tmp_path / "w", "--out", tmp_path / "w" / "stats.txt")[0] == 0


def test_ceiling_out_never_overwrites_the_model_config(tmp_path, run_cli):
    import shutil
    from pathlib import Path

    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "specpilot_cli" / "catalog" / "llama-3.1-8b.json",
                cfg / "config.json")
    before = (cfg / "config.json").read_text()
    code, _, err = run_cli("ceiling", "--model", cfg, "--gpu", "h200", "--out", cfg / "config.json")
    assert code == 2 and "refusing to overwrite" in err and (cfg / "config.json").read_text() == before, err


def test_the_engine_runs_a_packed_folder_as_its_bf16_original(tmp_path, run_cli):
    """``run --model`` of a folder ``w12 pack`` wrote: its weights restored bit for bit (the
    digest pack recorded checked), so the outputs are the original's; a corrupted record is one
    line naming the file, exit 2."""
    import torch
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                      initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    src = tmp_path / "model"
    LlamaForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(str(src))
    packed = tmp_path / "packed"
    assert run_cli("w12", "pack", src, "-o", packed)[0] == 0
    outs = {}
    for name, folder in (("bf16", src), ("w12", packed)):
        code, _, err = run_cli("run", "--model", folder, "--mode", "ar", "--prompt-ids", "5,6,7,8",
                               "--max-new-tokens", "12", "--outputs-out", tmp_path / f"{name}.jsonl")
        assert code == 0, err
        outs[name] = json.loads((tmp_path / f"{name}.jsonl").read_text())["output_ids"]
    assert outs["w12"] == outs["bf16"] and len(outs["bf16"]) == 12
    f = packed / "model.safetensors"
    with safe_open(str(f), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    key = next(k for k in tensors if k.endswith(".w12.records"))
    tensors[key][0] ^= 1
    save_file(tensors, str(f), metadata=meta)
    code, _, err = run_cli("run", "--model", packed, "--mode", "ar", "--prompt-ids", "5,6", "--max-new-tokens", "2")
    lines = [x for x in err.splitlines() if x.startswith("specpilot: error:")]
    assert code == 2 and len(lines) == 1 and f"{f}: " in lines[0] and "CRC-32 mismatch" in lines[0], err


def test_verify_against_a_packed_checkpoint_is_refused(tmp_path, run_cli):
    src, one, two = tmp_path / "m.safetensors", tmp_path / "m.w12.safetensors", tmp_path / "m2.w12.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", one)[0] == 0
    assert run_cli("w12", "pack", one, "-o", two, "--include", "*embed*")[0] == 0
    code, _, err = run_cli("w12", "verify", one, "--against", two)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--against {two}: a W12 checkpoint; give the original (unpacked) checkpoint" in err, err
    assert run_cli("w12", "verify", two, "--against", src)[0] == 0


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"a": 3}, {"a": ""}, "model.safetensors"])
def test_an_index_whose_weight_map_is_not_names_to_files_is_refused(tmp_path, run_cli, weight_map):
    folder = tmp_path / "model"
    folder.mkdir()
    make_checkpoint(folder / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for argv in (("w12", "pack", folder, "-o", tmp_path / "out"), ("w12", "stats", folder)):
        code, _, err = run_cli(*argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "not a safetensors index" in err
    assert not (tmp_path / "out").exists()


def _two_shards(folder, names=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
    """Two shards under ``folder`` at ``names`` (paths relative to it) and an index naming them so."""
    g = torch.Generator().manual_seed(3)
    tensors = [{f"a{i}.q_proj.weight": (torch.randn(16, 64, generator=g) * 0.02).bfloat16(),
                f"a{i}.norm.weight": torch.ones(4).bfloat16()} for i in range(2)]
    wm = {}
    for name, t in zip(names, tensors):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(t, str(folder / name))
        wm.update({k: name for k in t})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return wm


@pytest.mark.parametrize("names", [("p1/model.safetensors", "p2/model.safetensors"),
                                   ("model-00001-of-00002.safetensors", "../elsewhere/model.safetensors")])
def test_an_index_naming_shards_outside_its_folder_is_refused(tmp_path, run_cli, names):
    """Two shards of one file name in subfolders were written over each other in the packed folder
    (exit 0, half the tensors lost); a shard in ../ was read from outside the checkpoint."""
    folder = tmp_path / "m"
    folder.mkdir()
    _two_shards(folder, names)
    out = tmp_path / "out"
    code, _, err = run_cli("w12", "pack", folder, "-o", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not a file name in the index's folder" in err and not out.exists()


def test_an_index_that_puts_a_tensor_in_another_of_its_shards_is_refused(tmp_path, run_cli):
    folder = tmp_path / "m"
    folder.mkdir()
    wm = _two_shards(folder)
    wm["a1.norm.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    code, _, err = run_cli("w12", "pack", folder, "-o", tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("names model-00001-of-00002.safetensors for a1.norm.weight, which model-00002-of-00002.safetensors "
            "holds; fix the index") in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("metadata", [None, "abc", [1], 5])
def test_an_index_s_metadata_is_an_object_or_null(tmp_path, run_cli, metadata):
    """A metadata that was no object was an internal error (exit 4) when the packed index was written."""
    folder = tmp_path / "m"
    folder.mkdir()
    wm = _two_shards(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": metadata, "weight_map": wm}))
    out = tmp_path / "out"
    code, _, err = run_cli("w12", "pack", folder, "-o", out)
    if metadata is None:
        assert code == 0, err
        meta = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
        assert meta["specpilot.w12"] == "specpilot.w12/1" and meta["total_size"] > 0
        return
    assert code == 2 and "metadata is not an object" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_an_index_file_as_in_packs_its_folder_into_a_folder(tmp_path, run_cli):
    folder = tmp_path / "m"
    folder.mkdir()
    _two_shards(folder)
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text("{}")
    index = folder / "model.safetensors.index.json"
    code, _, err = run_cli("w12", "pack", index, "-o", tmp_path / "x.safetensors")
    assert code == 2 and "name a folder, not a .safetensors file" in err and not (tmp_path / "x.safetensors").exists()
    out = tmp_path / "out"
    code, stdout, err = run_cli("w12", "pack", index, "-o", out, "--format", "json")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    line = "original/ is a subfolder: not copied (copy it beside the output if the model needs it)"
    assert f"specpilot: warning: {line}" in err and json.loads(stdout)["warnings"] == [line]
    assert run_cli("w12", "verify", out, "--against", folder)[0] == 0


@pytest.mark.parametrize("dangling", [False, True])
def test_a_folder_output_that_is_a_symbolic_link_is_refused_before_packing(tmp_path, run_cli, dangling):
    folder = tmp_path / "model"
    folder.mkdir()
    make_checkpoint(folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    link = tmp_path / "link"
    if not dangling:
        (tmp_path / "empty").mkdir()
    link.symlink_to(tmp_path / "empty")
    code, out, err = run_cli("w12", "pack", folder, "-o", link)
    assert code == 2 and out == "" and "is a symbolic link; give the folder's own path" in err, err
    assert link.is_symlink() and not list(tmp_path.glob(".link.*"))


def test_a_tensor_stored_both_plain_and_as_w12_parts_is_refused(tmp_path, run_cli):
    """pack never writes both; a reader that met them took the W12 one silently (verify counted it twice)."""
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst)[0] == 0
    tensors, meta, doc = read_packed(dst)
    tensors[Q] = torch.zeros(1, 1, dtype=torch.bfloat16)
    write_packed(dst, tensors, meta, doc)
    for args in (["stats", dst], ["verify", dst, "--against", src], ["verify", dst]):
        code, out, err = run_cli("w12", *args)
        assert code == 2 and f"{Q} is stored twice, as a plain tensor and as W12 parts" in err, (args, err)


def test_a_device_is_not_called_missing(run_cli):
    for args in (["stats", "/dev/null"], ["pack", "/dev/null", "-o", "x.safetensors"]):
        code, out, err = run_cli("w12", *args)
        assert code == 2 and "/dev/null: not a regular file or folder" in err, err


def test_an_output_inside_the_input_folder_is_not_warned_of_as_its_subfolder(tmp_path, run_cli):
    """Pack's own temporary folder inside the input was listed as one of its subfolders ('.packed.*.part/
    is a subfolder: not copied'); the output folder given empty, too."""
    folder = tmp_path / "model"
    folder.mkdir()
    make_checkpoint(folder / "model.safetensors")
    for out in (folder / "packed", folder / "given"):
        out.mkdir()   # given as an empty folder
        code, stdout, err = run_cli("w12", "pack", folder, "-o", out, "--format", "json")
        assert code == 0, err
        warnings = json.loads(stdout)["warnings"]
        assert not any(".part" in w or "given/" in w for w in warnings), warnings
    # the first output is a subfolder of the input now: the second pack names it
    assert "packed/ is a subfolder: not copied (copy it beside the output if the model needs it)" in warnings


def test_metadata_with_an_empty_tensor_table_is_said_so(tmp_path, run_cli):
    """W12 metadata whose tensor table is empty was 'no specpilot.w12 metadata; pack it first'."""
    p = tmp_path / "e.safetensors"
    table = {"schema": "specpilot.w12/1", "version": 2, "tile": [128, 64], "row_align": 16, "tensors": {}}
    save_file({"a": torch.zeros(2, 2)}, str(p), metadata={"specpilot.w12": json.dumps(table)})
    for verb in ("stats", "verify"):
        code, _, err = run_cli("w12", verb, p)
        assert code == 2 and "specpilot.w12 metadata with an empty tensor table" in err, err
