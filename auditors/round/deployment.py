"""What a round works on: a deployment and the facts its candidates are matched against.

Two forms:

* **an embedded-engine spec** (``engine:model=smollm2,mode=ar,threads=1``; ``engine`` alone is
  the default: the real SmolLM2 on the CPU, random Llama-3.1-8B shapes on a GPU). The spec is the
  deployment's current system; the round runs everything itself.
* **an SGLang deployment file** (``specpilot.deployment/1``, YAML or JSON; see
  :mod:`.deployment_file`): the target, drafter, GPU and SGLang version, the files the user captured
  (a rows probe or traces, lattices, outputs), and how to start stock and candidate servers.

:class:`Facts` is what proposals check: device, GPU, weight dtype, drafter family, target kind
(dense or hybrid), SGLang version, serving batch.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpilot.errors import InputError

CPU_DEFAULT = "engine:model=smollm2,mode=ar,threads=1,ctx=1024"
GPU_DEFAULT = "engine:model=llama-3.1-8b,random=1,device=cuda,mode=ar,ctx=1024"
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Facts:
    kind: str                     # "engine" | "sglang"
    model: str                    # display name of the target
    device: str                   # "cpu" | "cuda"
    gpu: str | None               # GPU name, None on the CPU
    gpu_key: str | None           # GPU catalog key (floors), None when not in the catalog
    dtype: str                    # weights: bf16 | fp32 | fp16 | fp8 ...
    drafter: str                  # engine: ngram | self | model; SGLang: eagle | eagle3 | dflash | dflash2 | dspark
    target: str                   # dense | hybrid
    batch: int = 1
    sglang: str | None = None     # SGLang version (SGLang deployments)
    cpu: str | None = None

    def identity(self) -> str:
        """A file-name key of the deployment (what does not change when a round applies changes)."""
        where = self.gpu or self.cpu or self.device
        text = "_".join(str(x) for x in (self.kind, self.model, where, self.dtype, self.drafter, self.target,
                                         f"b{self.batch}", self.sglang or ""))
        return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Deployment:
    text: str                     # as the user gave it (resolved default included)
    kind: str                     # "engine" | "sglang"
    facts: Facts
    engine_spec: object | None = None          # EngineSpec for engine deployments
    sglang: object | None = None               # SGLangDeployment for SGLang deployments
    notes: list[str] = field(default_factory=list)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency
        return False


def default_engine_text() -> str:
    """The default deployment: random Llama-3.1-8B shapes on a GPU when one is visible, else the
    real SmolLM2 on the CPU (one thread: on a small shared CPU, more threads contend)."""
    return GPU_DEFAULT if _cuda_available() else CPU_DEFAULT


def engine_facts(spec) -> Facts:
    from specpilot.engine.api import resolve_model
    from specpilot.machine import cpu_name

    model_spec, _, display = resolve_model(spec.model, spec.random)
    cuda = spec.device.startswith("cuda")
    gpu = gpu_key = None
    if cuda:
        if not _cuda_available():
            from specpilot.errors import EnvironmentMissing

            raise EnvironmentMissing(f"{spec}: device={spec.device} but no CUDA GPU is visible; use device=cpu")
        import torch

        from specpilot.gpus import match_gpu_name

        gpu = torch.cuda.get_device_name(torch.device(spec.device))
        match = match_gpu_name(gpu)
        gpu_key = match.key if match else None
    return Facts(kind="engine", model=display, device="cuda" if cuda else "cpu", gpu=gpu, gpu_key=gpu_key,
                 dtype=DTYPE_SHORT.get(spec.torch_dtype_name, spec.torch_dtype_name),
                 drafter=spec.drafter, target="hybrid" if model_spec.is_hybrid else "dense", batch=spec.batch,
                 cpu=None if cuda else cpu_name())


def parse_deployment(text: str | None, strict: bool = True) -> Deployment:
    """An engine spec (or ``engine``/None for the default) or an SGLang deployment file;
    ``strict``: the user typed it (a round's state file: not, see :meth:`EngineSpec.parse`)."""
    raw = (text or "engine").strip()
    if raw == "engine" or raw.startswith("engine:"):
        from specpilot.engine.spec import EngineSpec

        resolved = default_engine_text() if raw == "engine" else raw
        spec = EngineSpec.parse(resolved, strict=strict)
        return Deployment(text=str(spec), kind="engine", facts=engine_facts(spec), engine_spec=spec)
    path = Path(raw).expanduser()
    if path.is_file():
        from .deployment_file import read_deployment

        dep = read_deployment(path)
        return Deployment(text=str(path), kind="sglang", facts=dep.facts, sglang=dep)
    if path.suffix.lower() in (".yaml", ".yml") or "/" in raw or path.exists():   # meant as a deployment file
        what = "a folder, not a file" if path.is_dir() else "not a file" if path.exists() else "no such file"
        raise InputError(f"{raw}: {what} (a DEPLOYMENT file is an SGLang deployment, specpilot.deployment/1 YAML)")
    raise InputError(f"{raw}: a DEPLOYMENT is an engine spec (engine:model=smollm2,mode=ar), 'engine' for the "
                     "default, or an SGLang deployment file (specpilot.deployment/1 YAML)")
