"""GPU specs: a catalog of vendor figures, NVML detection, and measured overrides.

Peak figures come from vendor datasheets (``gpu_catalog.yaml``, dense FLOP/s, not sparsity
figures). ``detect_gpu`` reads the local GPU through nvidia-ml-py: name, memory bus width and
maximum memory clock give the peak bandwidth (clock x 2 (DDR) x bus width / 8). ``--bandwidth`` /
``--flops`` replace datasheet values with measured ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

from .errors import EnvironmentMissing, InputError


@dataclass(frozen=True)
class GPUSpec:
    key: str
    name: str
    bandwidth_tbs: float  # peak memory bandwidth, TB/s (1e12 bytes/s)
    bf16_tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    fp8_tflops: float | None = None  # dense fp8 peak; None where unsupported
    memory_gb: float | None = None
    sm_count: int | None = None
    source: str = ""
    measured: tuple[str, ...] = ()  # which figures were overridden by measurement

    def peak_flops(self, dtype: str = "bf16") -> float:
        """FLOP/s for the tensor-core dtype a kernel class computes in."""
        if dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_tbs * 1e12

    def summary(self) -> dict:
        return {"key": self.key, "name": self.name, "bandwidth_tbs": self.bandwidth_tbs,
                "bf16_tflops": self.bf16_tflops, "fp8_tflops": self.fp8_tflops,
                "measured": list(self.measured), "source": self.source}


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", s.lower())


@lru_cache(maxsize=1)
def catalog() -> dict[str, tuple[GPUSpec, tuple[str, ...]]]:
    import yaml

    text = (resources.files("specpilot") / "gpu_catalog.yaml").read_text()
    doc = yaml.safe_load(text) or {}
    entries = doc.get("gpus", doc) if isinstance(doc, dict) else doc
    out: dict[str, tuple[GPUSpec, tuple[str, ...]]] = {}
    items = entries.items() if isinstance(entries, dict) else ((e.get("key"), e) for e in entries)
    for key, e in items:
        key = key or e.get("key")
        spec = GPUSpec(
            key=key, name=e["name"], bandwidth_tbs=float(e["bandwidth_tbs"]), bf16_tflops=float(e["bf16_tflops"]),
            fp8_tflops=float(e["fp8_tflops"]) if e.get("fp8_tflops") else None,
            memory_gb=e.get("memory_gb"), sm_count=e.get("sm_count"), source=str(e.get("source", "")),
        )
        aliases = tuple(_norm(a) for a in [key, e["name"], *(e.get("aliases") or [])])
        out[key] = (spec, aliases)
    return out


def gpu_keys() -> list[str]:
    return sorted(catalog())


def match_gpu_name(name: str) -> GPUSpec | None:
    """Best catalog match for a name as NVML, Nsight or torch report it ("NVIDIA H200", ...)."""
    n = _norm(name)
    if not n:
        return None
    cat = catalog()
    for spec, aliases in cat.values():
        if n in aliases:
            return spec
    # a short name that begins exactly one entry's key or alias ("h100" -> h100-sxm)
    prefixed = {spec.key for spec, aliases in cat.values() if any(a.startswith(n) for a in aliases)}
    if len(prefixed) == 1:
        return cat[prefixed.pop()][0]
    # longest alias contained in the reported name wins ("nvidiah10080gbhbm3" contains "h100")
    # (a different SKU of the same chip - H200 NVL, H100 PCIe - is not the catalog's SXM part)
    variant = [v for v in ("nvl", "pcie") if v in n]
    best, best_len = None, 0
    for spec, aliases in cat.values():
        for a in aliases:
            if any(v not in a for v in variant):
                continue
            if len(a) >= 4 and a in n and len(a) > best_len:
                best, best_len = spec, len(a)
    return best


def get_gpu(name: str) -> GPUSpec:
    if name.lower() in ("auto", "local"):
        found = detect_gpu()
        if found is None:
            raise EnvironmentMissing("no NVIDIA GPU detected through NVML; name one with --gpu "
                                     f"({', '.join(gpu_keys())})")
        return found
    spec = match_gpu_name(name)
    if spec is None:
        n = _norm(name)
        several = sorted({s.key for s, aliases in catalog().values() if n and any(a.startswith(n) for a in aliases)})
        if len(several) > 1:
            raise InputError(f"GPU {name!r} is the start of several: {', '.join(several)}; give one of them")
        raise InputError(f"unknown GPU {name!r}; known: {', '.join(gpu_keys())} "
                         "(or give --bandwidth and --flops for another GPU)")
    return spec


def custom_gpu(bandwidth_tbs: float, bf16_tflops: float, fp8_tflops: float | None = None) -> GPUSpec:
    return GPUSpec(key="custom", name="custom", bandwidth_tbs=bandwidth_tbs, bf16_tflops=bf16_tflops,
                   fp8_tflops=fp8_tflops, source="command line", measured=("bandwidth", "flops"))


def with_overrides(gpu: GPUSpec, bandwidth_tbs: float | None = None, bf16_tflops: float | None = None,
                   fp8_tflops: float | None = None) -> GPUSpec:
    measured = list(gpu.measured)
    kw = {}
    for field_, value, label in (("bandwidth_tbs", bandwidth_tbs, "bandwidth"), ("bf16_tflops", bf16_tflops, "flops"),
                                 ("fp8_tflops", fp8_tflops, "fp8_flops")):
        if value is not None:
            if value <= 0:
                raise InputError(f"--{label.replace('_', '-')} must be positive, got {value}")
            kw[field_] = value
            measured.append(label)
    return replace(gpu, measured=tuple(dict.fromkeys(measured)), **kw) if kw else gpu


def nvml_bandwidth_tbs(bus_width_bits: int, mem_clock_mhz: int) -> float:
    """Peak DRAM bandwidth from NVML's bus width and max memory clock (double data rate)."""
    return mem_clock_mhz * 1e6 * 2 * bus_width_bits / 8 / 1e12


def detect_gpu(index: int = 0) -> GPUSpec | None:
    """The local GPU through nvidia-ml-py, or None when there is no NVIDIA driver/GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        bw = None
        try:
            bus = pynvml.nvmlDeviceGetMemoryBusWidth(h)
            clk = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            bw = nvml_bandwidth_tbs(bus, clk)
        except Exception:
            pass
        mem_gb = pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    base = match_gpu_name(name)
    if base is None:
        if bw is None:
            return None
        return GPUSpec(key="detected", name=name, bandwidth_tbs=bw, bf16_tflops=float("nan"), memory_gb=mem_gb,
                       source="NVML (no catalog entry: give --flops)")
    return replace(base, name=name, bandwidth_tbs=bw or base.bandwidth_tbs, memory_gb=round(mem_gb, 1),
                   source=f"NVML bandwidth; {base.source}")
