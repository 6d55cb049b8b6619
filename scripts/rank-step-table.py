#!/usr/bin/env python3
"""Renders rank_step_bench's JSON as markdown tables: per phase time, floor, utilization.

  scripts/rank-step-table.py RESULT.json
"""
import json
import sys

PHASES = ["embed", "attention", "moe", "allreduce", "lm_head", "kv_commit"]


def main(path):
    data = json.load(open(path))
    rows = data["rows"]
    print(f"device {data['device']}, copy bandwidth {rows[0]['copy_tb_s']:.2f} TB/s, "
          f"{rows[0]['layers']} layers\n")
    print("| sharding | context | tree | active experts / layer | "
          + " | ".join(f"{p} us (floor, %)" for p in PHASES)
          + " | total us (floor, %) | per layer us |")
    print("|" + "---|" * (5 + len(PHASES) + 1))
    for r in rows:
        cells = [r["sharding"], str(r["context"]), str(r["tree"]),
                 f"{r['active_experts_per_layer']:.0f}"]
        for p in PHASES:
            ph = r["phases"][p]
            if ph["us"] == 0:
                cells.append("-")
            elif ph["bytes"] == 0:
                cells.append(f"{ph['us']:.0f}")
            else:
                cells.append(f"{ph['us']:.0f} ({ph['floor_us']:.0f}, "
                             f"{100 * ph['dram_utilization']:.0f} %)")
        t = r["total"]
        cells.append(f"{t['us']:.0f} ({t['floor_us']:.0f}, {100 * t['dram_utilization']:.0f} %)")
        cells.append(f"{t['per_layer_us']:.0f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
