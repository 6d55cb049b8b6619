#!/usr/bin/env python3
"""Tables of an A/B run of mla_verify_bench (scripts/gpu-check.sh ab).

    scripts/bench-compare.py OUTDIR [--base NAME] [--field us|overlap_us|...]

OUTDIR holds NAME-PASS.json for every bundle and pass. Prints, as markdown, the ceilings each
run measured and per shape the time of every pass of every build, and for each build but the
base the difference and ratio of its best pass to the base's best pass (bench/NOTES.md compares
builds this way: both in one call, alternated, the best of two passes each). --field picks the
time compared (default `us`, the plain launches; `overlap_us` the overlapped ones).
"""

import argparse
import json
import pathlib
import re
import sys


def shape_key(row):
    return (row["heads"], row["rows"], row["context"], row["batch"])


def load_runs(out_dir):
    """{name: {pass: json}} from OUTDIR/NAME-PASS.json."""
    runs = {}
    for path in sorted(pathlib.Path(out_dir).glob("*-*.json")):
        match = re.fullmatch(r"(.+)-(\d+)\.json", path.name)
        if match:
            runs.setdefault(match.group(1), {})[int(match.group(2))] = json.loads(path.read_text())
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--base", help="the build the others are compared with (default: first)")
    parser.add_argument("--field", default="us", help="the time compared (default: us)")
    args = parser.parse_args()
    runs = load_runs(args.out_dir)
    if not runs:
        sys.exit(f"bench-compare: no NAME-PASS.json in {args.out_dir}")
    names = sorted(runs)
    base = args.base or names[0]
    if base not in runs:
        sys.exit(f"bench-compare: no runs of {base} (have {', '.join(names)})")
    names = [base] + [n for n in names if n != base]
    passes = sorted({p for n in names for p in runs[n]})

    for name in names:
        for p in passes:
            run = runs[name].get(p)
            if run:
                print(f"- {name} pass {p}: copy {run['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
                      f"bf16 GEMM {run['tensor_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print()

    times = {}  # (name, pass) -> {shape: us}
    order = []
    for name in names:
        for p in passes:
            rows = runs[name].get(p, {}).get("rows", [])
            times[(name, p)] = {shape_key(r): r[args.field] for r in rows if r[args.field] > 0}
            for r in rows:
                if shape_key(r) not in order:
                    order.append(shape_key(r))

    header = ["H", "Q", "L", "B"] + [f"{n} {p}" for n in names for p in passes]
    for name in names[1:]:
        header += [f"{name} - {base} us", f"{name} / {base}"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for shape in order:
        cells = [str(v) for v in shape]
        best = {}
        for name in names:
            values = [times[(name, p)].get(shape) for p in passes]
            cells += ["" if v is None else f"{v:.2f}" for v in values]
            present = [v for v in values if v is not None]
            best[name] = min(present) if present else None
        for name in names[1:]:
            if best[name] is None or best[base] is None:
                cells += ["", ""]
            else:
                cells += [f"{best[name] - best[base]:+.2f}", f"{best[name] / best[base]:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
