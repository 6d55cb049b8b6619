"""Writes the multi-rank patches of the single-node-tp8 and multi-node overlays from the base's
rank container (base/workers.yaml) and coordinator (base/coordinator.yaml):

    python3 deploy/k8s/tools/generate_rank_patches.py [OUTPUT_ROOT]

Rank container i of a pod listens on gRPC 50061 + i, health 8082 + i and metrics 9401 + i (the
coordinator, in the multi-node leader pod, keeps 50051, 8081 and 9400). tests/deploy checks the
committed files are what this writes. Needs PyYAML.
"""
import copy
import os
import sys

import yaml

K8S = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RANKS_PER_POD = 8


def load(name):
    return [d for d in yaml.safe_load_all(open(os.path.join(K8S, "base", name))) if d]


def dump(obj):
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=100)


def rank_container(worker, i, rank, coordinator, shell):
    c = copy.deepcopy(worker)
    c["name"] = f"worker-{i}"
    replaced = {"--rank": rank, "--coordinator": coordinator,
                "--listen": f"$(POD_IP):{50061 + i}",
                "--health-listen": f"0.0.0.0:{8082 + i}",
                "--metrics-listen": f"0.0.0.0:{9401 + i}"}
    args = []
    for arg in worker["args"]:
        name = arg.split("=", 1)[0]
        args.append(f"{name}={replaced[name]}" if name in replaced else arg)
    c["ports"] = [{"name": f"grpc-{i}", "containerPort": 50061 + i},
                  {"name": f"health-{i}", "containerPort": 8082 + i},
                  {"name": f"metrics-{i}", "containerPort": 9401 + i}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        c[probe]["grpc"]["port"] = 8082 + i
    c["env"] = [e for e in c["env"] if e["name"] != "RANK"]
    if shell:
        # The rank depends on the pod's index in the group: the shell computes it ($$ escapes the
        # kubelet's $(VAR) expansion, which fills in the other variables first).
        c["command"] = ["/bin/sh", "-c"]
        c["args"] = ["exec treeverify-worker " + " ".join(args)]
    else:
        c["args"] = args
    return c


def main(out):
    statefulset = load("workers.yaml")[0]
    pod_spec = statefulset["spec"]["template"]["spec"]
    worker = pod_spec["containers"][0]
    coordinator = load("coordinator.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    files = {}

    ranks = [rank_container(worker, i, str(i), "treeverify-rendezvous:50051", False)
             for i in range(RANKS_PER_POD)]
    files["overlays/single-node-tp8/ranks.yaml"] = (
        "# The eight rank containers of the one worker pod (deploy/k8s/tools/"
        "generate_rank_patches.py).\n" + dump(
            [{"op": "replace", "path": "/spec/replicas", "value": 1},
             {"op": "replace", "path": "/spec/template/spec/containers", "value": ranks}]))
    monitor = [{"op": "replace", "path": "/spec/podMetricsEndpoints",
                "value": [{"port": f"metrics-{i}", "path": "/metrics", "interval": "15s"}
                          for i in range(RANKS_PER_POD)]}]
    service = [{"op": "replace", "path": "/spec/ports",
                "value": [{"name": f"grpc-{i}", "port": 50061 + i, "targetPort": f"grpc-{i}"}
                          for i in range(RANKS_PER_POD)]}]
    for overlay in ("single-node-tp8", "multi-node"):
        files[f"overlays/{overlay}/pod-monitor.yaml"] = (
            "# Each rank container is a target of its own.\n" + dump(monitor))
        files[f"overlays/{overlay}/worker-service.yaml"] = (
            "# The rank containers' gRPC ports.\n" + dump(service))

    ranks = [rank_container(worker, i, f"$$((LWS_WORKER_INDEX * {RANKS_PER_POD} + {i}))",
                            "$(LWS_LEADER_ADDRESS):50051", True)
             for i in range(RANKS_PER_POD)]
    leader = copy.deepcopy(pod_spec)
    leader["containers"] = [coordinator] + copy.deepcopy(ranks)
    workers = copy.deepcopy(pod_spec)
    workers["containers"] = copy.deepcopy(ranks)
    labels = {"app.kubernetes.io/name": "treeverify", "treeverify.io/ranks": "true"}
    group = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        # Not "treeverify": the controller makes a headless Service named after the set (the
        # leader's DNS name, LWS_LEADER_ADDRESS), and skips it if a Service of that name exists.
        "metadata": {"name": "treeverify-group",
                     "labels": {"app.kubernetes.io/name": "treeverify"}},
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": 2,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": {**labels,
                                            "app.kubernetes.io/component": "coordinator"}},
                    "spec": leader},
                "workerTemplate": {
                    "metadata": {"labels": {**labels, "app.kubernetes.io/component": "worker"}},
                    "spec": workers},
            },
        },
    }
    files["overlays/multi-node/leader-worker-set.yaml"] = (
        "# One replica across nodes: a LeaderWorkerSet group of `size` pods of 8 GPUs (size 2:\n"
        "# TP16). The leader pod runs the coordinator and ranks 0-7; worker pod k\n"
        "# (LWS_WORKER_INDEX) ranks 8k..8k+7. A rank that dies takes its whole group down and up\n"
        "# again (RecreateGroupOnPodRestart): a fresh coordinator, a fresh group. WORLD_SIZE =\n"
        "# 8 x size. (deploy/k8s/tools/generate_rank_patches.py)\n" + dump(group))
    for path, text in files.items():
        target = os.path.join(out, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(text)
    return sorted(files)


if __name__ == "__main__":
    for written in main(sys.argv[1] if len(sys.argv) > 1 else K8S):
        print(written)
