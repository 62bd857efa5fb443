"""Compare two snapshots of :mod:`routing_snapshot` (and their PTX): a reorganization must leave
every launch (kernel, constexprs, specialization, options, grid) and its PTX unchanged.

    python lab/tools/routing_compare.py BEFORE.json AFTER.json [--ptx BEFORE_DIR AFTER_DIR]

Constexprs of unrouted variants that a kernel no longer has are accepted when the earlier
snapshot had them at their "off" value (:data:`REMOVED`), and renamed ones are mapped
(:data:`RENAMED`); nothing else may differ. Exit 0 when identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# kernel -> {constexpr: the value it had in every routed launch}: variants moved to lab/
REMOVED = {
    "_w12_gemv_gl_kernel": {"PLAIN": False, "XF32": False, "L_XF": None},
    "_w12_mma_kernel": {"PLAIN": False, "XC": 1},
    "_w12_mma_tma_kernel": {"PLAIN": False, "A_SMEM": False, "STREAM": False},
    "_w12_warpk_kernel": {"TAIL_EPI": False},
}
RENAMED = {"_w12_gemm_kernel": {"MODE": "PRODUCT"}}


def normalize(rec: dict) -> dict:
    """A launch record of the earlier snapshot as the later code spells it."""
    kernel = rec["kernel"]
    out = json.loads(json.dumps(rec))
    for part in ("constexprs", "signature", "attrs"):
        d = out.get(part, {})
        for name, off in REMOVED.get(kernel, {}).items():
            if name in d:
                if part == "constexprs" and d[name] != off:
                    raise ValueError(f"{kernel}: {name}={d[name]!r}, a routed launch of a removed variant")
                del d[name]
        for old, new in RENAMED.get(kernel, {}).items():
            if old in d:
                d[new] = d.pop(old)
    return out


def compare(before: dict, after: dict) -> tuple[list[str], dict]:
    """Differences, and the map from earlier launch keys to later ones."""
    diffs, keymap = [], {}
    if before.get("lm_head") != after.get("lm_head"):
        diffs.append("lm_head tiles differ")
    archs = sorted(k for k in before if k.startswith("sm"))
    for arch in archs:
        for part in ("linear", "decode"):
            b, a = before[arch][part], after.get(arch, {}).get(part, {})
            if set(b) != set(a):
                diffs.append(f"{arch} {part}: keys differ: {sorted(set(b) ^ set(a))[:5]}")
            for key in sorted(set(b) & set(a)):
                lb, la = b[key], a[key]
                if isinstance(lb, dict) or isinstance(la, dict):
                    if lb != la:
                        diffs.append(f"{arch} {part} {key}: {lb} vs {la}")
                    continue
                if len(lb) != len(la):
                    diffs.append(f"{arch} {part} {key}: {len(lb)} vs {len(la)} launches")
                    continue
                for x, y in zip(lb, la):
                    rb = normalize(before["launches"][x["launch"]])
                    ra = after["launches"][y["launch"]]
                    if rb != ra or x["grid"] != y["grid"]:
                        what = [f for f in ("kernel", "constexprs", "signature", "attrs", "options")
                                if rb.get(f) != ra.get(f)] + (["grid"] if x["grid"] != y["grid"] else [])
                        diffs.append(f"{arch} {part} {key}: {x['kernel']} differs in {what}")
                    elif keymap.setdefault(x["launch"], y["launch"]) != y["launch"]:
                        diffs.append(f"{arch} {part} {key}: launch {x['launch']} maps to two later launches")
    return diffs, keymap


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--ptx", nargs=2, metavar=("BEFORE_DIR", "AFTER_DIR"))
    ap.add_argument("--keymap", default=None, help="write the later launch keys of BEFORE_DIR's PTX files here "
                    "(a JSON list for routing_snapshot.py --ptx-keys)")
    args = ap.parse_args()
    before, after = json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text())
    diffs, keymap = compare(before, after)
    n = sum(len(v) for k in before if k.startswith("sm") for p in ("linear", "decode")
            for v in before[k][p].values() if isinstance(v, list))
    print(f"launches compared: {n} ({len(keymap)} distinct); differences: {len(diffs)}")
    for d in diffs[:50]:
        print("  " + d)
    if args.ptx and args.keymap:
        keys = sorted({keymap[f.stem] for f in Path(args.ptx[0]).iterdir() if f.stem in keymap})
        Path(args.keymap).write_text(json.dumps(keys))
        print(f"{len(keys)} later launch keys written to {args.keymap}")
    if args.ptx:
        bdir, adir = Path(args.ptx[0]), Path(args.ptx[1])
        same = missing = 0
        for f in sorted(bdir.glob("*.ptx")):
            other = adir / (keymap.get(f.stem, "?") + ".ptx")
            if not other.exists():
                missing += 1
                diffs.append(f"no later PTX for {f.stem}")
                continue
            if f.read_text() == other.read_text():
                same += 1
            else:
                diffs.append(f"PTX differs: {f.stem} vs {other.stem}")
        errors_b = {f.stem: f.read_text() for f in bdir.glob("*.error")}
        errors_a = {f.stem: f.read_text() for f in adir.glob("*.error")}
        for k in errors_b:
            if keymap.get(k) not in errors_a:
                diffs.append(f"{k} failed to compile before but not after")
        print(f"PTX files identical: {same}; missing: {missing}; compile errors before/after: "
              f"{len(errors_b)}/{len(errors_a)}")
        for d in diffs[-20:]:
            if d.startswith(("PTX", "no later", "failed")) or "failed" in d:
                print("  " + d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
