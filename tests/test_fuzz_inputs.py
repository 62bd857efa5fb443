"""Fuzz: the real ``specpilot`` command on truncated, bit-flipped, binary, huge-number and empty
variants of every input type it reads keeps the CLI contract (tests/fuzzing.py): exit 0-3 and
never 4, no traceback, one ``specpilot: error:`` line naming the file, inputs unchanged, no
debris. The default run tries each kind once per input type; ``-m slow`` tries 6 seeds of each.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fuzzing import KINDS, Case, prepare, run_case, specpilot_cmd

from conftest import FIXTURES, LOCAL_FIXTURES, REPO

V = 96  # vocabulary of the tiny scorer


def _lattice_rows(rng_seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(rng_seed)
    rows = []
    for req in range(3):
        for step in range(4):
            m, k = 3, 2
            tokens = [rng.sample(range(V), k) for _ in range(m)]
            lp = [sorted((-rng.random() * 3 for _ in range(k)), reverse=True) for _ in range(m)]
            target = [tokens[i][0] if rng.random() < 0.7 else rng.randrange(V) for i in range(m)] + [rng.randrange(V)]
            rows.append({"schema": "specpilot.lattice/1", "request": req, "step": step, "tokens": tokens,
                         "logprobs": lp, "transitions": None, "target": target})
    return rows


def _outputs(seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"schema": "specpilot.outputs/1", "id": f"p{i}", "prompt_ids": [1, 5 + i, 9],
             "output_ids": [rng.randrange(2, V) for _ in range(6)]} for i in range(4)]


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _cli(args, cwd):
    proc = subprocess.run(specpilot_cmd() + [str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode in (0, 1), proc.stderr  # 1: a negative verdict (compare of two equal commands)
    return proc


SQLITE = LOCAL_FIXTURES / "nsys_h200_decode_graph.sqlite"


def _kineto() -> Path:
    small = FIXTURES / "kineto_torch_compile_triton.json.gz"
    return small if small.is_file() else LOCAL_FIXTURES / "kineto_h200_decode_eager.json.gz"


def _seed(name: str, d: Path):
    """Write the valid seed input of one type into ``d``; returns (target, args, outputs)."""
    if name == "kineto-json":
        (d / "trace.json").write_bytes(gzip.decompress(_kineto().read_bytes()))
        return "trace.json", ["profile", "{in}", "--top", "3"], ()
    if name == "kineto-gz":
        shutil.copy(_kineto(), d / "trace.json.gz")
        return "trace.json.gz", ["profile", "{in}", "--top", "3"], ()
    if name == "nsys-sqlite":
        shutil.copy(SQLITE, d / "trace.sqlite")
        return "trace.sqlite", ["profile", "{in}", "--model", "llama-3.1-8b", "--top", "3"], ()
    if name == "rules":
        shutil.copy(SQLITE, d / "trace.sqlite")
        (d / "rules.yaml").write_text("schema: specpilot.kernel_classes/1\nclasses: [mine]\nrules:\n"
                                      "  - {class: mine, match: 'gemv|gemm', note: \"my GEMMs\"}\n"
                                      "  - {class: norm, match: 'rms', args: 'bf16', per_step: 2}\n")
        return "rules.yaml", ["profile", "trace.sqlite", "--rules", "{in}", "--top", "1"], ()
    if name == "config":
        shutil.copy(LOCAL_FIXTURES / "decode_target_config.json", d / "config.json")
        return "config.json", ["ceiling", "--model", "{in}", "--gpu", "h200", "--rows", "1,8"], ()
    if name == "lattice":
        (d / "lat.jsonl").write_text(_jsonl(_lattice_rows()))
        return "lat.jsonl", ["replay", "{in}", "--bootstrap", "100", "--nodes", "2,4"], ()
    if name == "lattice-gz":
        (d / "lat.jsonl.gz").write_bytes(gzip.compress(_jsonl(_lattice_rows(1)).encode()))
        return "lat.jsonl.gz", ["replay", "{in}", "--bootstrap", "100"], ()
    if name == "replay-json":
        (d / "lat.jsonl").write_text(_jsonl(_lattice_rows()))
        _cli(["replay", "lat.jsonl", "--nodes", "2,4", "--bootstrap", "100", "--format", "json", "--out",
              "replay.json"], d)
        (d / "lat.jsonl").unlink()
        return "replay.json", ["ceiling", "--replay", "{in}", "--step-ms", "2", "--ar-ms", "1", "--policy", "chain"], ()
    if name == "profile-json":
        shutil.copy(SQLITE, d / "t.sqlite")
        _cli(["profile", "t.sqlite", "--model", "llama-3.1-8b", "--format", "json", "--out", "profile.json"], d)
        (d / "t.sqlite").unlink()
        return "profile.json", ["ceiling", "--profile", "{in}", "--tau", "2", "--ar-ms", "1"], ()
    if name == "rows-json":
        (d / "rows.json").write_text(json.dumps({
            "schema": "specpilot.rows/1", "model": "tiny", "gpu": "NVIDIA H200", "device": "cuda:0",
            "dtype": "bfloat16", "context": 1024, "ar_ms": 1.5,
            "points": [{"rows": 1, "step_ms": 1.5, "c": 1.0}, {"rows": 8, "step_ms": 1.8, "c": 1.2}],
            "reps": 50, "method": "cuda graph", "cpu": None}, indent=1))
        return "rows.json", ["ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "8", "--rows-probe",
                             "{in}", "--tau", "3"], ()
    if name == "timing":
        _cli(["compare", "--base-cmd", "true", "--candidate-cmd", "true", "--runs", "4", "--warmup", "0", "--format",
              "json", "--out", "timing.json"], d)
        return "timing.json", ["compare", "--from", "{in}", "--format", "json"], ()
    if name == "prompts":
        (d / "prompts.jsonl").write_text(_jsonl([{"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [1, 2 + i, 7]}
                                                 for i in range(3)]))
        return "prompts.jsonl", ["run", "--model", "tiny", "--mode", "ar", "--prompts", "{in}", "--max-new-tokens", "4",
                                 "--outputs-out", "out.jsonl"], ("out.jsonl",)
    if name == "outputs":
        from specpilot.engine.api import load_engine

        _tiny_scorer(d / "scorer")
        # stock is the scorer's own greedy output (a stock it disagrees with is refused); the system
        # differs from it at one token a prompt
        engine = load_engine(f"engine:model={d / 'scorer'},mode=ar,threads=1")
        stock = [dict(r, output_ids=engine.generate(r["prompt_ids"], 6).output_ids) for r in _outputs(0)]
        system = [dict(r, output_ids=r["output_ids"][:3] + [(r["output_ids"][3] + 1) % V] + r["output_ids"][4:])
                  for r in stock]
        (d / "sys.jsonl").write_text(_jsonl(system))
        (d / "stock.jsonl").write_text(_jsonl(stock))
        return "sys.jsonl", ["audit", "{in}", "--against", "stock.jsonl", "--scorer", "scorer", "--bootstrap",
                             "100"], ()
    if name == "memory":
        shutil.copytree(REPO / "bundles" / "memory_entries", d / "mem")
        return "mem/tree.yaml", ["memory", "verify", "--memory-dir", "mem"], ()
    if name.startswith("w12"):
        _w12_checkpoint(d)
        if name == "w12-stats":
            return "model.w12.safetensors", ["w12", "stats", "{in}"], ()
        if name == "w12-verify":
            return "model.w12.safetensors", ["w12", "verify", "{in}", "--against", "model.safetensors", "--device",
                                             "cpu"], ()
        return "model.safetensors", ["w12", "pack", "{in}", "-o", "again.safetensors", "--device", "cpu"], \
            ("again.safetensors",)
    raise KeyError(name)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The seed folder of an input type, made on first use: (folder, target, args, outputs)."""
    root = tmp_path_factory.mktemp("fuzz_seeds")
    made = {}

    def get(name: str):
        if name not in made:
            d = root / name
            d.mkdir()
            made[name] = (d, *_seed(name, d))
        return made[name]

    return get


def _tiny_scorer(folder: Path) -> None:
    """A random 2-layer Llama in Hugging Face's layout (config.json + model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    h, inter, layers, heads, kv = 32, 64, 2, 4, 2
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "max_position_embeddings": 128, "tie_word_embeddings": True,
           "rms_norm_eps": 1e-6, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    hd = h // heads
    shapes = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                       p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    tensors = {k: (torch.ones(s) if len(s) == 1 else torch.randn(*s, generator=g) * 0.2) for k, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _w12_checkpoint(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from specpilot.kernels.w12 import checkpoint

    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16),
               "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
               "model.embed_tokens.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16)},
              str(folder / "model.safetensors"))
    checkpoint.pack(str(folder / "model.safetensors"), str(folder / "model.w12.safetensors"))


TYPES = ("kineto-json", "kineto-gz", "nsys-sqlite", "rules", "config", "lattice", "lattice-gz", "replay-json",
         "profile-json", "rows-json", "timing", "prompts", "outputs", "memory", "w12-stats", "w12-verify", "w12-pack")
# input types whose command imports torch (about 2 s a run): two kinds each in the default run
HEAVY = {"w12-stats": ("bitflip", "truncated"), "w12-verify": ("bitflip", "huge"), "w12-pack": ("binary", "bitflip")}


def _cases(corpus, input_type, work: Path, seeds, kinds=KINDS) -> list[Case]:
    seed_folder, target, args, outputs = corpus(input_type)
    return [Case(input_type, args, prepare(seed_folder, work, target, kind, seed), target, outputs, kind)
            for kind in kinds for seed in seeds]


def _run_all(cases: list[Case]) -> None:
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for f in [pool.submit(run_case, c) for c in cases]:
            f.result()


@pytest.mark.parametrize("input_type", TYPES)
def test_fuzz_input(corpus, input_type, tmp_path):
    _run_all(_cases(corpus, input_type, tmp_path, seeds=[0], kinds=HEAVY.get(input_type, KINDS)))


@pytest.mark.slow
@pytest.mark.parametrize("input_type", TYPES)
def test_fuzz_seed_is_valid(corpus, input_type, tmp_path):
    """Every seed is an input the command accepts, so its variants probe past the first check."""
    seed_folder, target, args, _ = corpus(input_type)
    work = tmp_path / "seed"
    shutil.copytree(seed_folder, work)
    _cli([a.replace("{in}", target) for a in args], work)


@pytest.mark.slow
@pytest.mark.parametrize("input_type", TYPES)
def test_fuzz_input_many_seeds(corpus, input_type, tmp_path):
    _run_all(_cases(corpus, input_type, tmp_path, seeds=range(1, 7)))


def test_fuzz_sees_the_error_boundary(tmp_path):
    """The contract check itself fails on a traceback or exit 4 (a test that cannot fail is a defect)."""
    from fuzzing import check_contract

    case = Case("self-check", ["replay", "{in}"], tmp_path, "x.jsonl")
    (tmp_path / "x.jsonl").write_text("")
    bad = subprocess.CompletedProcess([], 4, "", "specpilot: internal error: KeyError: 'x'\n")
    with pytest.raises(AssertionError):
        check_contract(case, bad, {})
    tb = subprocess.CompletedProcess([], 2, "", "Traceback (most recent call last):\nspecpilot: error: x.jsonl: y\n")
    with pytest.raises(AssertionError):
        check_contract(case, tb, {})
    assert sys.executable
