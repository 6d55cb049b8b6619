#!/usr/bin/env python3
"""Groups compute-sanitizer racecheck reports by kind and source lines.

Reads a racecheck log (either report mode) and prints one line per distinct (kind, accesses)
with its count, most frequent first, so that a GPU check shows which lines race without the
thousands of repeated reports (bench/NOTES.md, step 40).

    scripts/racecheck-summary.py LOG [--top N]
"""
import argparse
import collections
import re
import sys

LOCATION = re.compile(r"([\w.-]+\.(?:cuh|cu|h|cc)):(\d+)")
REPORT = re.compile(r"=+ (Error|Warning): (.*)")
# Parts of a report header that differ between repeats of the same race.
VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\(\d+,\d+,\d+\)|\[\d+ hazards?\]|\d+ bytes?")


def summarize(lines):
    """Counts reports by (severity, normalized header, source locations of its lines)."""
    counts = collections.Counter()
    report = None  # [severity, header, locations]

    def close():
        if report is not None:
            where = " <-> ".join(dict.fromkeys(report[2])) or "?"
            counts[(report[0], report[1], where)] += 1

    for line in lines:
        match = REPORT.search(line)
        if match:
            close()
            header = VOLATILE.sub("_", match.group(2)).split(" at __shared__")[0].strip()
            report = [match.group(1), header[:60], []]
            report[2].extend(":".join(m) for m in LOCATION.findall(line))
        elif report is not None:
            if re.match(r"^=+\s*$", line) or "Saved host backtrace" in line:
                close()
                report = None
            else:
                kind = "Read " if " Read " in line else "Write " if " Write " in line else ""
                report[2].extend(kind + ":".join(m) for m in LOCATION.findall(line))
    close()
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        counts = summarize(f)
    if not counts:
        print("racecheck summary: no hazard reports")
        return 0
    print(f"racecheck summary: {sum(counts.values())} reports, {len(counts)} distinct")
    for (severity, header, where), n in counts.most_common(args.top):
        print(f"  {n:8d}  {severity:7s}  {header}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
