"""The product's choice for a layer and row count (its tuned table entry, else its default config),
as the config class of the lab's variant kernels (:mod:`lab.w12.variants`), whose fields are a
superset of the launch choices: the sweeps let the committed choice compete with the variants.
The lab's kernels run one layer at a time, launched plainly, so the product's ``pdl`` (programmatic
dependent launch, which only matters between the kernels of a step) has no field there."""

from __future__ import annotations

import dataclasses

from specpilot.kernels.w12 import gemv, gemv_gluon, mma, mma_tma, warpk


def _as(cls, cfg):
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in fields or k != "pdl"})


def gemv_config(m: int, n: int, k: int):
    from lab.w12.variants.gemv import GemvConfig

    cfg = gemv.tuned_config(m, n, k)
    return None if cfg is None else _as(GemvConfig, cfg)


def gluon_gemv_config(n: int, k: int, sms: int = 132):
    from lab.w12.variants.gemv_gluon import GluonGemvConfig

    return _as(GluonGemvConfig, gemv_gluon.default_config(n, k, sms))


def warpk_config(m: int, n: int, k: int, sms: int = 132):
    from lab.w12.variants.warpk import WarpKConfig

    return _as(WarpKConfig, warpk.default_config(m, n, k, sms))


def mma_config(m: int, n: int, k: int, sms: int = 132, tma: bool = True, wgmma: bool = True):
    from lab.w12.variants.mma import MmaConfig

    return _as(MmaConfig, mma.default_config(m, n, k, sms, tma, wgmma))


__all__ = ["gemv_config", "gluon_gemv_config", "mma_config", "mma_tma", "warpk_config"]
