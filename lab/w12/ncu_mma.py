"""Run the tensor-core W12 kernels (``mma.sync``, Hopper ``wgmma``, few-row ``warpk``) or the one-row Gluon GEMV on one layer, for Nsight
Compute: a few warm-up calls, then the call to profile.

    ncu --clock-control none -k regex:'_w12_(wg)?mma_kernel' --launch-skip 3 --launch-count 1 \
        --set full -o wg python3 lab/w12/ncu_mma.py --kernel wgmma --k 4096 --n 4096 --m 32 \
        --config 64,8,4,2,0
    ncu --import wg.ncu-rep --page source --csv --print-source sass > wg_sass.csv   # stalls per instruction

``--config`` is the kernel's config dataclass fields, comma separated (default: its default config);
0 for a field that defaults to None (``maxnreg``) means None, e.g. ``--kernel mma --config
64,3,4,4,0,0,0,0,0,1,2`` is ``MmaConfig(64, 3, 4, 4, tma=2)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

from lab.w12.variants import gemv_gluon, mma, warpk, wgmma  # noqa: E402
from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=["mma", "wgmma", "gemv-gluon", "warpk"], default="wgmma")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    mod, cls, run = {"mma": (mma, mma.MmaConfig, mma.w12_mma),
                     "wgmma": (wgmma, wgmma.WgmmaConfig, wgmma.w12_wgmma),
                     "gemv-gluon": (gemv_gluon, gemv_gluon.GluonGemvConfig, gemv_gluon.w12_gemv_gluon),
                     "warpk": (warpk, warpk.WarpKConfig, warpk.w12_warpk)}[args.kernel]
    cfg = None
    if args.config:
        vals = [int(v) for v in args.config.split(",")]
        fields = list(cls.__dataclass_fields__)
        dflt = cls()   # bools from 0/1; 0 for a field whose default is None (a register cap) is None
        cfg = cls(**{f: (bool(v) if isinstance(getattr(dflt, f), bool) else None if getattr(dflt, f) is None and v == 0
                         else v) for f, v in zip(fields, vals)})
    w = (torch.randn(args.n, args.k, device="cuda") * 0.02).bfloat16()
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(args.m, args.k, device="cuda").bfloat16()
    if cfg is None:
        cfg = mod.default_config(args.n, args.k) if args.kernel == "gemv-gluon" else mod.default_config(
            args.m, args.n, args.k)
    print(args.kernel, cfg.key(), flush=True)
    for _ in range(4):
        run(x, kp, config=cfg)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
