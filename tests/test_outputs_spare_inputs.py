"""An output option never replaces what the command reads: a model folder or the files beside a
config, a scorer, a round's folder and records, the memory entries, a baseline folder. Each is
refused (exit 2, one line) before any work, and the input is left as it was."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import refused

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face folder (config.json + model.safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    folder = tmp_path_factory.mktemp("hf") / "m"
    model.save_pretrained(folder)
    return folder


def _example_round(dst: Path) -> Path:
    """A copy of the committed CPU round (its folder is a round's and a baseline's)."""
    shutil.copytree(REPO / "examples" / "rounds" / "smollm2-cpu", dst)
    return dst


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _prompts(tmp_path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2, 3]}) + "\n")
    return p


@pytest.mark.parametrize("target", ["model.safetensors", "config.json"])
@pytest.mark.parametrize("option", ["--out", "--outputs-out", "--lattice-out"])
def test_run_never_writes_over_its_model(run_cli, hf_model, tmp_path, option, target):
    before = _snapshot(hf_model)
    code, out, err = run_cli("run", "--model", hf_model, "--mode", "ar", "--prompt-ids", "1,2,3",
                             "--max-new-tokens", "2", option, hf_model / target)
    refused(code, err, f"{option} {hf_model / target}: refusing to overwrite")
    assert _snapshot(hf_model) == before


def test_a_config_given_as_the_model_keeps_its_weights_beside_it(run_cli, hf_model, tmp_path):
    before = _snapshot(hf_model)
    code, _, err = run_cli("run", "--model", hf_model / "config.json", "--mode", "ar", "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "2", "--out", hf_model / "model.safetensors")
    refused(code, err, "refusing to overwrite input file")
    assert _snapshot(hf_model) == before


def test_probe_compare_and_audit_never_write_over_a_model(run_cli, hf_model, tmp_path):
    before = _snapshot(hf_model)
    cfg = hf_model / "config.json"
    prompts = _prompts(tmp_path)
    for args in (["probe", "rows", "--model", hf_model, "--rows", "1"],
                 ["compare", "--base", f"engine:model={hf_model},mode=ar", "--candidate",
                  f"engine:model={hf_model},mode=chain", "--prompts", prompts, "--runs", "2"],
                 ["audit", "engine:model=tiny,mode=chain", "--against", "engine:model=tiny,mode=ar",
                  "--scorer", hf_model, "--prompts", prompts],
                 ["audit", "collect", f"engine:model={hf_model},mode=ar", "--prompts", prompts,
                  "--save", tmp_path / "s.jsonl"]):
        code, _, err = run_cli(*args, "--out", cfg)
        refused(code, err, "refusing to overwrite")
    code, _, err = run_cli("audit", "collect", f"engine:model={hf_model},mode=ar", "--prompts", prompts,
                           "--save", cfg)
    refused(code, err, f"--save {cfg}: refusing to overwrite")
    assert _snapshot(hf_model) == before


def test_memory_never_writes_over_its_entries(run_cli, tmp_path):
    mem = tmp_path / "mem"
    shutil.copytree(REPO / "bundles" / "memory_entries", mem)
    before = _snapshot(mem)
    for args in (["list"], ["show", "tree"], ["verify"]):
        for name in ("tree.yaml", "list.yaml"):   # a new file there was written, and read as an entry after
            code, _, err = run_cli("memory", *args, "--memory-dir", mem, "--out", mem / name)
            refused(code, err, f"inside the memory folder {mem}, which holds its entries only")
    assert _snapshot(mem) == before


def test_round_never_writes_over_its_folder_or_records(run_cli, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "engine-tiny.yaml").write_text("kept: true\n")
    code, _, err = run_cli("round", "engine:model=tiny,mode=ar", "--dry-run", "--records", rec,
                           "--out", rec / "engine-tiny.yaml")
    refused(code, err, "refusing to overwrite a file of input folder")
    assert (rec / "engine-tiny.yaml").read_text() == "kept: true\n"
    done = _example_round(tmp_path / "done")
    before = (done / "round.json").read_bytes()
    code, _, err = run_cli("round", "--resume", done, "--out", done / "round.json")
    refused(code, err, f"inside the round's folder {done}, which the round writes")
    assert (done / "round.json").read_bytes() == before


def test_check_refuses_a_report_into_the_baseline_folder_before_measuring(run_cli, tmp_path):
    ex = _example_round(tmp_path / "ex")
    before = (ex / "report.md").read_bytes()
    code, _, err = run_cli("check", "--baseline", ex, "--out", ex / "report.md")
    refused(code, err, "refusing to overwrite a file of input folder")
    assert (ex / "report.md").read_bytes() == before


def test_a_config_in_the_working_folder_leaves_its_other_files_writable(run_cli, hf_model, tmp_path, monkeypatch):
    """Only the checkpoint's own files beside a config are inputs: an earlier result there is not."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(hf_model / "config.json", tmp_path / "config.json")
    shutil.copy(hf_model / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "result.json").write_text("{}")
    code, _, err = run_cli("run", "--model", "config.json", "--mode", "ar", "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "2", "--format", "json", "--out", "result.json")
    assert code == 0, err
    assert json.loads((tmp_path / "result.json").read_text())["schema"].startswith("specpilot.run")


def test_check_spares_the_round_folder_of_a_named_baseline_file_and_a_system_model(run_cli, hf_model, tmp_path):
    """--baseline DIR/baseline.json left the round.json beside it writable (replaced, and the next
    check failed on it); a --system engine's model folder was not an input."""
    ex = _example_round(tmp_path / "ex")
    before = _snapshot(ex)
    code, _, err = run_cli("check", "--baseline", ex / "baseline.json", "--out", ex / "round.json")
    refused(code, err, f"refusing to overwrite input file {ex / 'round.json'}")
    code, _, err = run_cli("check", "--baseline", ex, "--system", f"engine:model={hf_model},mode=ar",
                           "--out", hf_model / "config.json")
    refused(code, err, "refusing to overwrite")
    assert _snapshot(ex) == before and json.loads((hf_model / "config.json").read_text())["vocab_size"] == 256


def test_round_spares_the_files_a_deployment_file_names(run_cli, tmp_path):
    """An SGLang deployment file's prompts and measurements were overwritten by --out (dry run too)."""
    import yaml

    (tmp_path / "p.jsonl").write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a",
                                                  "prompt_ids": [1, 2]}) + "\n")
    (tmp_path / "rows.json").write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "points": [
        {"rows": r, "step_ms": 10.0 + r * 0.1} for r in (1, 2, 3)]}))
    dep = {"schema": "specpilot.deployment/1", "drafter": "eagle", "prompts": "p.jsonl",
           "measurements": {"rows_probe": "rows.json"},
           "servers": {"stock": {"url": "http://127.0.0.1:1", "start": "true"}}}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(dep))
    before = _snapshot(tmp_path)
    for name in ("p.jsonl", "rows.json"):
        code, _, err = run_cli("round", tmp_path / "d.yaml", "--dry-run", "--records", tmp_path / "rec",
                               "--out", tmp_path / name)
        refused(code, err, "refusing to overwrite input file")
    assert _snapshot(tmp_path) == before


def test_serve_spares_its_model_files_at_start(run_cli, hf_model, tmp_path):
    """serve --out onto its model's config was written at exit, over the config."""
    code, _, err = run_cli("serve", "--model", hf_model, "--mode", "ar", "--port", "0", "--out", hf_model / "config.json")
    refused(code, err, "refusing to overwrite")
    assert json.loads((hf_model / "config.json").read_text())["vocab_size"] == 256


def test_audit_refuses_a_report_inside_the_outputs_folder(run_cli, tmp_path):
    """audit check --out into --save-outputs replaced an outputs file it had just written."""
    prompts = _prompts(tmp_path)
    save = tmp_path / "so"
    save.mkdir()
    code, _, err = run_cli("audit", "check", "engine:model=tiny,mode=tree", "--against", "engine:model=tiny,mode=ar",
                           "--prompts", prompts, "--max-new-tokens", "4", "--scorer", "tiny", "--save-outputs", save,
                           "--out", save / "system.outputs.jsonl")
    refused(code, err, f"where --save-outputs {save} keeps the system outputs")
    assert list(save.iterdir()) == []
    # a report beside the outputs, or an audit of files that saves nothing: written as before
    rows = [{"schema": "specpilot.outputs/1", "id": "a", "prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6]}]
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli("audit", "check", tmp_path / "b.jsonl", "--against", tmp_path / "a.jsonl", "--scorer", "tiny",
                           "--save-outputs", save, "--out", save / "rep.json")
    assert code in (0, 1) and (save / "rep.json").is_file(), err
    code, _, err = run_cli("audit", "selftest", "--save-outputs", save, "--out", save / "ar.jsonl")
    refused(code, err, f"inside --save-outputs {save}")


def test_profile_plot_and_out_are_one_file_however_spelled(run_cli, tmp_path, monkeypatch):
    """--plot a.png --out ./a.png: the report was written over the plot."""
    monkeypatch.chdir(tmp_path)
    trace = REPO / "tests" / "fixtures" / "nsys_h200_decode_eager.sqlite"
    code, _, err = run_cli("profile", trace, "--plot", "a.png", "--out", "./a.png")
    refused(code, err, "--plot and --out name the same file")


def test_an_out_that_leads_to_a_program_is_refused(run_cli, tmp_path):
    """A report through a link into a venv's bin/ replaced the interpreter it leads to."""
    prog = tmp_path / "prog"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(0o755)
    (tmp_path / "link").symlink_to(prog)
    for out in (prog, tmp_path / "link"):
        code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--out", out)
        refused(code, err, f"{prog} is a program, not a file to write a report over")
    assert prog.read_text() == "#!/bin/sh\necho hi\n"



def test_smollm2_by_name_spares_its_cached_folder(run_cli, hf_model, tmp_path, monkeypatch):
    """--model smollm2 reads the folder it was converted into: --out there replaced its config, and
    every later smollm2 run failed on it."""
    cache = tmp_path / "cache"
    folder = cache / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    shutil.copy(hf_model / "config.json", folder)   # a finished conversion: none runs
    shutil.copy(hf_model / "model.safetensors", folder)
    (folder / ".complete").write_text("")
    before = _snapshot(folder)
    monkeypatch.setenv("SPECPILOT_CACHE", str(cache))
    for args in (("run", "--model", "smollm2", "--prompt", "hi"), ("probe", "rows", "--model", "smollm2")):
        code, _, err = run_cli(*args, "--out", folder / "config.json")
        refused(code, err, "refusing to overwrite a file of input folder")
    assert _snapshot(folder) == before
