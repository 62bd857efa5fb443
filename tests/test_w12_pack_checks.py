"""``specpilot w12``: re-packing a packed checkpoint, empty tensors, --device, --force and the
fields and part dtypes verify insists on (CPU only)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

Q = "model.layers.0.self_attn.q_proj.weight"
D = "model.layers.0.mlp.down_proj.weight"
EMB = "model.embed_tokens.weight"


def make_checkpoint(path):
    g = torch.Generator().manual_seed(0)
    t = {Q: (torch.randn(130, 192, generator=g) * 0.02).bfloat16(),
         D: (torch.randn(48, 200, generator=g) * 0.02).bfloat16(),
         EMB: (torch.randn(100, 64, generator=g) * 0.02).bfloat16(),
         "model.norm.weight": torch.ones(64).bfloat16()}
    save_file(t, str(path), metadata={"format": "pt", "custom": "keepme"})
    return t


def table(path) -> dict:
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    return meta, json.loads(meta["specpilot.w12"])


def test_repacking_a_packed_file_keeps_its_w12_tensors_and_adds_the_new_ones(tmp_path, run_cli):
    src, once, twice = tmp_path / "m.safetensors", tmp_path / "m.w12.safetensors", tmp_path / "y.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", once, "--device", "cpu")[0] == 0
    code, out, err = run_cli("w12", "pack", once, "-o", twice, "--include", "*", "--device", "cpu", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["converted"] == 1 and doc["already_w12"] == 2 and doc["kept"] == 1, doc
    meta, w12 = table(twice)
    assert set(w12["tensors"]) == {Q, D, EMB} and meta["custom"] == "keepme"
    assert table(once)[1]["tensors"][Q] == w12["tensors"][Q]   # carried over as it was
    code, out, err = run_cli("w12", "verify", twice, "--against", src)
    assert code == 0 and "OK: 3 converted tensors restored and identical" in out and "1 kept" in out, (out, err)
    code, out, _ = run_cli("w12", "pack", once, "-o", tmp_path / "y2.safetensors", "--include", "*", "--device", "cpu")
    assert "1 tensors converted, 2 already W12 (carried over as packed), 1 kept" in out, out


def test_packing_what_an_exclude_kept_later_converts_it_beside_the_others(tmp_path, run_cli):
    src = tmp_path / "model"
    src.mkdir()
    make_checkpoint(src / "model.safetensors")
    assert run_cli("w12", "pack", src, "-o", tmp_path / "a", "--exclude", "*down_proj*", "--device", "cpu")[0] == 0
    code, _, err = run_cli("w12", "pack", tmp_path / "a", "-o", tmp_path / "b", "--include", "*down_proj*",
                           "--device", "cpu")
    assert code == 0, err
    assert set(table(tmp_path / "b" / "model.safetensors")[1]["tensors"]) == {Q, D}
    assert run_cli("w12", "verify", tmp_path / "b", "--against", src)[0] == 0
    # nothing left to convert: the error says the rest is W12 already, and nothing is written
    code, _, err = run_cli("w12", "pack", tmp_path / "b", "-o", tmp_path / "c", "--device", "cpu")
    assert code == 2 and "2 matching tensors are already W12; nothing written" in err and not (tmp_path / "c").exists(), err
    # only those the patterns pick are counted
    code, _, err = run_cli("w12", "pack", tmp_path / "b", "-o", tmp_path / "c", "--include", "*q_proj*",
                           "--device", "cpu")
    assert code == 2 and "; 1 matching tensors are already W12; nothing written" in err, err


def test_a_packed_input_whose_table_does_not_hold_is_not_merged(tmp_path, run_cli):
    src, once = tmp_path / "m.safetensors", tmp_path / "m.w12.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", once, "--device", "cpu")[0] == 0
    tensors = load_file(str(once))
    meta, doc = table(once)
    doc["tensors"][Q]["crc32"]["records"] ^= 1
    save_file(tensors, str(once), metadata={**meta, "specpilot.w12": json.dumps(doc)})
    code, _, err = run_cli("w12", "pack", once, "-o", tmp_path / "y.safetensors", "--include", "*", "--device", "cpu")
    assert code == 2 and f"{Q}: records is corrupted" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "y.safetensors").exists()


@pytest.mark.parametrize("shape", [(0, 64), (16, 0)])
def test_an_empty_weight_is_kept_not_converted(tmp_path, run_cli, shape):
    src, dst = tmp_path / "e.safetensors", tmp_path / "e.w12.safetensors"
    save_file({"z.empty_proj.weight": torch.zeros(*shape, dtype=torch.bfloat16),
               "y.ok_proj.weight": torch.ones(16, 64, dtype=torch.bfloat16)}, str(src))
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")
    assert code == 0 and "1 tensors converted, 1 kept (1 empty)" in out, (out, err)
    for args in (("verify", dst), ("verify", dst, "--against", src), ("stats", dst)):
        code, out, err = run_cli("w12", *args)
        assert code == 0, (args, err)
    save_file({"z.empty_proj.weight": torch.zeros(*shape, dtype=torch.bfloat16)}, str(src))
    code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "n.safetensors", "--device", "cpu")
    assert code == 2 and "1 matching tensors are empty" in err, err


@pytest.mark.parametrize("device", ["cuda:x", "cudax", "cpu:0", "cuda:-1", "CUDA", "tpu"])
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-host", "gpu-host"])
def test_a_malformed_device_is_bad_input(tmp_path, run_cli, monkeypatch, device, gpu):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")[0] == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    for args in (("pack", src, "-o", tmp_path / "o.safetensors"), ("verify", dst)):
        code, _, err = run_cli("w12", *args, "--device", device)
        assert code == 2 and err.strip() == f"specpilot: error: --device {device}: expected auto, cpu or cuda[:N]", err
    assert not (tmp_path / "o.safetensors").exists()


def test_a_wellformed_cuda_device_without_cuda_is_a_missing_environment(tmp_path, run_cli, monkeypatch):
    src = tmp_path / "m.safetensors"
    make_checkpoint(src)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        code, _, err = run_cli("w12", "pack", src, "-o", tmp_path / "o.safetensors", "--device", device)
        assert code == 3 and "no CUDA device here" in err, err


def test_pack_refuses_an_existing_output_file_unless_forced(tmp_path, run_cli):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    dst.write_bytes(b"precious")
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")
    assert code == 2 and err.strip() == (f"specpilot: error: --output {dst}: the file exists; pass --force to "
                                         "replace it"), err
    assert dst.read_bytes() == b"precious"
    code, _, err = run_cli("w12", "pack", src, "-o", dst, "--device", "cpu", "--force")
    assert code == 0 and run_cli("w12", "verify", dst, "--against", src)[0] == 0, err
    code, out, _ = run_cli("w12", "pack", "--help")
    assert code == 0 and "--force" in out and "Replace an existing output file" in out


def test_pack_refuses_force_with_a_folder_output(tmp_path, run_cli):
    """A folder IN packs into a folder OUT, which --force never replaces: the flag is refused, not
    ignored, before anything is read or written."""
    src, dst = tmp_path / "model", tmp_path / "packed"
    src.mkdir()
    make_checkpoint(src / "model.safetensors")
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--device", "cpu", "--force")
    assert code == 2 and out == "" and err.strip() == (
        f"specpilot: error: --force: a folder IN packs into a folder --output {dst}, which is never replaced (it "
        "must be absent or empty); leave --force out"), err
    assert not dst.exists()
    code, _, err = run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")
    assert code == 0 and (dst / "model.safetensors").is_file(), err


def _rewrite(path, edit_tensors=None, edit_doc=None):
    tensors = load_file(str(path))
    meta, doc = table(path)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_doc:
        edit_doc(doc)
    save_file(tensors, str(path), metadata={**meta, "specpilot.w12": json.dumps(doc)})


def test_a_w12_entry_without_its_sha256_is_refused(tmp_path, run_cli):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")[0] == 0
    _rewrite(dst, edit_doc=lambda d: d["tensors"][Q].pop("sha256"))
    for args in (("verify", dst), ("verify", dst, "--against", src), ("stats", dst)):
        code, out, err = run_cli("w12", *args)
        assert code == 2 and f"{Q}: W12 metadata field sha256 must be 64 lowercase hex digits, got null" in err, \
            (args, out, err)


@pytest.mark.parametrize("part, dtype", [("records", torch.int8), ("low_exp", torch.int8), ("esc_pos", torch.uint8),
                                         ("esc_bits", torch.uint8)])
def test_a_part_stored_in_another_dtype_is_refused(tmp_path, run_cli, part, dtype):
    src, dst = tmp_path / "m.safetensors", tmp_path / "w.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")[0] == 0
    key = f"{Q}.w12.{part}"

    def retype(t):   # the same bytes (so the CRC still holds), another element type
        t[key] = t[key].contiguous().view(torch.uint8).view(dtype)

    _rewrite(dst, edit_tensors=retype)
    want = "int16" if part in ("esc_pos", "esc_bits") else "uint8"
    for args in (("verify", dst), ("stats", dst)):
        code, _, err = run_cli("w12", *args)
        assert code == 2 and f"part {key} is {str(dtype)[6:]}, W12 stores it as {want}" in err, (args, err)


def test_verify_help_says_the_sha256_is_checked_without_against(run_cli):
    code, out, _ = run_cli("w12", "verify", "--help")
    text = " ".join(out.split())
    assert code == 0 and "only CRCs and structure are checked" not in text
    assert "without it each restored tensor is checked against the sha256 pack recorded" in text


def test_a_format_1_input_is_not_merged_into_a_format_2_table(tmp_path, run_cli):
    """One file holds one format version: a format 1 table is refused (exit 2), nothing written."""
    from specpilot.kernels.w12.checkpoint import _crc, load_w12, w12_info

    src, dst, old = tmp_path / "m.safetensors", tmp_path / "w.safetensors", tmp_path / "v1.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", dst, "--device", "cpu")[0] == 0
    tensors = load_file(str(dst))
    meta, doc = table(dst)
    for name, entry in w12_info(meta, "x").items():
        t = load_w12(tensors, name, entry, "x")
        tensors[f"{name}.w12.low_exp"] = t.low_exp.clone()
        tensors[f"{name}.w12.esc_pos"] = t.esc_pos.to(torch.int32)
        e = doc["tensors"][name]
        for k in ("low_base", "escapes", "sha256"):
            e.pop(k)
        e["crc32"]["low_exp"] = _crc(tensors[f"{name}.w12.low_exp"])
        e["crc32"]["esc_pos"] = _crc(tensors[f"{name}.w12.esc_pos"])
    doc["version"] = 1
    save_file(tensors, str(old), metadata={**meta, "specpilot.w12": json.dumps(doc)})
    assert run_cli("w12", "verify", old, "--against", src)[0] == 0
    code, _, err = run_cli("w12", "pack", old, "-o", tmp_path / "y.safetensors", "--include", "*", "--device", "cpu")
    assert code == 2 and "its W12 tensors are format 1, new ones would be format 2" in err, err
    assert not (tmp_path / "y.safetensors").exists()


def test_a_weight_whose_name_holds_w12_is_converted(tmp_path, run_cli):
    """Only a packed tensor's stored parts (NAME.w12.records ...) are never converted: a bf16 weight
    named layers.0.w12.q_proj.weight was skipped without a word, and --include 'layers.0.*' said
    no tensor matched."""
    src, dst = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"layers.0.w12.q_proj.weight": (torch.randn(32, 64, generator=g) * 0.02).bfloat16(),
               "layers.1.q_proj.weight": (torch.randn(32, 64, generator=g) * 0.02).bfloat16(),
               "a.w12.records": (torch.randn(32, 64, generator=g) * 0.02).bfloat16()}, str(src))
    code, out, err = run_cli("w12", "pack", src, "-o", dst, "--device", "cpu", "--include", "*", "--format", "json")
    assert code == 0 and json.loads(out)["converted"] == 3, (out, err)   # a bf16 weight, whatever its name
    code, out, err = run_cli("w12", "pack", src, "-o", tmp_path / "p.safetensors", "--include", "layers.0.*",
                             "--device", "cpu", "--format", "json")
    assert code == 0 and json.loads(out)["converted"] == 1, (out, err)
    assert run_cli("w12", "verify", dst, "--against", src)[0] == 0


@pytest.mark.parametrize("damage", ["entry", "table"])
def test_stored_parts_the_table_does_not_name_are_refused(tmp_path, run_cli, damage):
    """A packed file whose table lost an entry (or the whole table) packed with exit 0, copying the
    weight's parts as plain tensors no entry names (the weight lost); stats and verify said OK."""
    src, once, bad = tmp_path / "m.safetensors", tmp_path / "m.w12.safetensors", tmp_path / "bad.safetensors"
    make_checkpoint(src)
    assert run_cli("w12", "pack", src, "-o", once, "--device", "cpu")[0] == 0
    meta, doc = table(once)
    if damage == "entry":
        del doc["tensors"][D]
        meta["specpilot.w12"] = json.dumps(doc)
    else:
        del meta["specpilot.w12"]
    save_file(load_file(str(once)), str(bad), metadata=meta)
    lost = D if damage == "entry" else None
    for argv in (("w12", "pack", bad, "-o", tmp_path / "x.safetensors", "--device", "cpu"),
                 ("w12", "stats", bad), ("w12", "verify", bad)):
        code, _, err = run_cli(*argv)
        assert code == 2 and err.count("\n") == 1, (argv, err)
        if damage == "table" and argv[1] != "pack":   # no table at all: said before any tensor is read
            assert "no specpilot.w12 metadata" in err, err
            continue
        assert "table does not name (the table is damaged or missing)" in err, (argv, err)
        assert lost is None or f"of a W12 weight {lost} " in err, err
    assert not (tmp_path / "x.safetensors").exists()
