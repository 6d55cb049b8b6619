#!/usr/bin/env python3
"""Per-kernel times of rank_step_bench's last verify step, from a CUPTI trace (bench/cupti_trace.cc).

On the GPU machine:
  CUDA_INJECTION64_PATH=$PWD/.gpu-bundle/lib/libcupti_trace.so TREEVERIFY_TRACE=trace.tsv \\
    .gpu-bundle/bin/rank_step_bench --layers 4 --sharding split --contexts 46080 --trees 16 --iters 3
Here:
  scripts/kernel-timeline.py trace.tsv [--layers 4] [--order]

The last step starts at the last embedding launch and runs to the end of the trace (the bench's
last measured step, replayed from its CUDA graph). Kernels are grouped by a short name (the
demangled template name without its arguments, or cuBLASLt's kernel name); per group: launches,
total, median and range of one launch, and the total per layer when --layers is given. The
median over launches is the figure bench/NOTES.md quotes for a kernel's time. --order also lists
the step's kernels by start time: the offset from the step's first, the duration, and the gap
since the latest end before it (negative where kernels overlap: the side stream, programmatic
dependents), which is how the critical path of a layer is read.
"""
import argparse
import re
import statistics
import sys


def short_name(mangled):
    """A readable name: the innermost identifier of a mangled C++ kernel name, or the name itself
    (cuBLASLt's nvjet kernels, already plain)."""
    if not mangled.startswith("_Z"):
        return mangled
    # The identifiers of the mangled name (length-prefixed); the kernel is the last one before
    # the template arguments ("I...E") or the parameter list.
    names = []
    i = 2
    while i < len(mangled):
        m = re.match(r"\d+", mangled[i:])
        if not m:
            if mangled[i] == "I" and names:
                break
            i += 1
            continue
        length = int(m.group(0))
        start = i + len(m.group(0))
        names.append(mangled[start:start + length])
        i = start + length
        if i < len(mangled) and mangled[i] in "IE":
            break
    kernel = names[-1] if names else mangled
    template = re.search(r"ILb([01])E", mangled)
    return kernel + (f"<{template.group(1)}>" if template else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--order", action="store_true",
                        help="also list the step's kernels by start time")
    args = parser.parse_args()
    kernels = []
    with open(args.trace) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "kernel":
                kernels.append((int(fields[1]), int(fields[2]), fields[3]))
    starts = [i for i, k in enumerate(kernels) if "Embedding" in k[2]]
    if not starts:
        sys.exit(f"{args.trace}: no embedding launch, so no step to show")
    step = kernels[starts[-1]:]
    groups = {}
    for begin, end, name in step:
        groups.setdefault(short_name(name), []).append((end - begin) / 1e3)
    span = (step[-1][1] - step[0][0]) / 1e3
    print(f"last step: {len(step)} kernels over {span:.1f} us (first start to last end)\n")
    per_layer = f" | per layer us" if args.layers else ""
    print(f"| kernel | launches | total us | median us (range){per_layer} |")
    print("|---|---|---|---|" + ("---|" if args.layers else ""))
    for name, times in sorted(groups.items(), key=lambda g: -sum(g[1])):
        total = sum(times)
        row = (f"| `{name}` | {len(times)} | {total:.1f} | {statistics.median(times):.1f} "
               f"({min(times):.1f}-{max(times):.1f})")
        if args.layers:
            row += f" | {total / args.layers:.1f}"
        print(row + " |")
    if args.order:
        ordered = sorted(step)
        first = latest = ordered[0][0]
        print("\n| # | start us | us | gap us | kernel |\n|---|---|---|---|---|")
        for i, (begin, end, name) in enumerate(ordered):
            print(f"| {i} | {(begin - first) / 1e3:.1f} | {(end - begin) / 1e3:.1f} | "
                  f"{(begin - latest) / 1e3:.1f} | `{short_name(name)}` |")
            latest = max(latest, end)


if __name__ == "__main__":
    main()
