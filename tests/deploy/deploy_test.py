"""Offline checks of deploy/: the Dockerfiles and the Kubernetes manifests (tests/deploy/run.sh).

    python3 tests/deploy/deploy_test.py BUILD_DIR

- hadolint on the Dockerfiles; every path they copy exists; every binary they build, collect or
  start is one the build produces (in BUILD_DIR).
- Every overlay, and the GPU generations composed with the layouts, renders with `kubectl
  kustomize`; every core object validates against the Kubernetes schemas (kubernetes-validate);
  the ServiceMonitor, PodMonitor and LeaderWorkerSet are checked here for their apiVersion, kind
  and the fields we rely on; yamllint is clean.
- The flags the manifests pass are ones the binaries accept (their --help); listen ports are
  container ports; probes and Services name ports that exist; the probes' gRPC services are the
  ones the processes report; WORLD_SIZE matches the ranks the layout runs; the Grafana dashboard
  ConfigMap carries monitoring/dashboards/treeverify.json.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import kubernetes_validate
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = None  # set from argv
K8S = os.path.join(ROOT, "deploy", "k8s")
OVERLAYS = ["hopper", "blackwell", "cpu-demo", "single-node-tp8", "multi-node"]
# Layouts composed with a GPU generation (kustomize components), as docs/deploy.md shows.
COMPOSED = [("single-node-tp8", "hopper"), ("multi-node", "blackwell")]
KUBERNETES_VERSION = "1.32.0"
BINARIES = {
    "treeverify-coordinator": "services/treeverify-coordinator",
    "treeverify-worker": "services/treeverify-worker",
    "treeverify-cli": "tools/treeverify-cli",
}
LISTEN_FLAGS = ("listen", "health_listen", "metrics_listen")


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def render(kustomization_dir):
    result = run(["kubectl", "kustomize", kustomization_dir])
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {kustomization_dir}: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def rendered_layouts():
    """name -> rendered objects: every overlay, and the compositions."""
    layouts = {"base": render(os.path.join(K8S, "base"))}
    for overlay in OVERLAYS:
        layouts[overlay] = render(os.path.join(K8S, "overlays", overlay))
    for layout, generation in COMPOSED:
        scratch = tempfile.mkdtemp(prefix=".compose-", dir=K8S)
        try:
            with open(os.path.join(scratch, "kustomization.yaml"), "w") as f:
                yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                "kind": "Kustomization",
                                "resources": [f"../overlays/{layout}"],
                                "components": [f"../components/{generation}"]}, f)
            layouts[f"{layout}+{generation}"] = render(scratch)
        finally:
            shutil.rmtree(scratch)
    return layouts


def pod_templates(obj):
    """The pod templates of a workload: (name, template)."""
    kind = obj["kind"]
    if kind in ("Deployment", "StatefulSet"):
        return [(obj["metadata"]["name"], obj["spec"]["template"])]
    if kind == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        return [(obj["metadata"]["name"] + "/leader", group["leaderTemplate"]),
                (obj["metadata"]["name"] + "/worker", group["workerTemplate"])]
    return []


def container_command(container):
    """(binary, [args]) of a container that starts a treeverify binary, else None. A shell
    command line (`sh -c "exec treeverify-worker ..."`) is split on spaces."""
    command = list(container.get("command", [])) + list(container.get("args", []))
    if command[:2] == ["/bin/sh", "-c"]:
        command = command[2].split()
        if command and command[0] == "exec":
            command = command[1:]
    if command and command[0] in BINARIES:
        return command[0], command[1:]
    return None


def flags(args):
    """--name=value / --name value -> {name with underscores: value}."""
    parsed, i = {}, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            parsed[name.replace("-", "_")] = value
        i += 1
    return parsed


def helped_flags(binary):
    result = run([os.path.join(BUILD, BINARIES[binary]), "--helpfull"])
    return set(re.findall(r"--([a-z0-9_]+)", result.stdout + result.stderr))


class DockerfileTest(unittest.TestCase):
    DOCKERFILES = ["deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cpu"]

    def test_hadolint(self):
        result = run(["hadolint", "--config", os.path.join(ROOT, "deploy/docker/.hadolint.yaml"),
                      "--failure-threshold", "info"] +
                     [os.path.join(ROOT, d) for d in self.DOCKERFILES])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_copied_paths_exist_and_binaries_are_built(self):
        for dockerfile in self.DOCKERFILES:
            text = open(os.path.join(ROOT, dockerfile)).read().replace("\\\n", " ")
            copies = 0
            for line in text.splitlines():
                words = line.split()
                if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
                    continue
                for source in words[1:-1]:
                    copies += 1
                    self.assertTrue(os.path.exists(os.path.join(ROOT, source)),
                                    f"{dockerfile}: COPY {source}: no such path")
            self.assertGreater(copies, 5, dockerfile)
            # Targets built, binaries collected, the entry point: all produced by the build.
            targets = re.findall(r"--target ([a-z0-9_ -]+?)(?:\n|$| &&)", text)
            self.assertTrue(targets, dockerfile)
            for target in " ".join(targets).split():
                self.assertIn(target, BINARIES, f"{dockerfile}: target {target}")
            for path in re.findall(r"build/(services/[a-z-]+|tools/[a-z-]+)", text):
                self.assertTrue(os.path.exists(os.path.join(BUILD, path)),
                                f"{dockerfile}: {path} is not something the build produces")
            entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])", text, re.M).group(1))
            self.assertIn(entry[0], BINARIES, dockerfile)


class ManifestTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.layouts = rendered_layouts()

    def test_core_objects_validate(self):
        for layout, objects in self.layouts.items():
            for obj in objects:
                if obj["apiVersion"].split("/")[0].endswith((".coreos.com", ".x-k8s.io")):
                    continue  # custom resources: CustomResourceTest
                try:
                    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
                except kubernetes_validate.ValidationError as error:
                    self.fail(f"{layout}: {obj['kind']} {obj['metadata']['name']}: {error}")

    def test_every_layout_has_a_coordinator_and_ranks(self):
        for layout, objects in self.layouts.items():
            kinds = {o["kind"] for o in objects}
            self.assertTrue({"Service", "ConfigMap", "NetworkPolicy",
                             "PodDisruptionBudget"} <= kinds, layout)
            binaries = [container_command(c)[0]
                        for o in objects for _, t in pod_templates(o)
                        for c in t["spec"]["containers"] if container_command(c)]
            self.assertIn("treeverify-coordinator", binaries, layout)
            self.assertIn("treeverify-worker", binaries, layout)

    def test_world_size_matches_the_ranks(self):
        for layout, objects in self.layouts.items():
            config = next(o for o in objects if o["kind"] == "ConfigMap"
                          and o["metadata"]["name"].startswith("treeverify-flags"))
            world = int(config["data"]["WORLD_SIZE"])
            ranks = 0
            for obj in objects:
                for name, template in pod_templates(obj):
                    workers = [c for c in template["spec"]["containers"]
                               if (container_command(c) or [None])[0] == "treeverify-worker"]
                    if obj["kind"] == "StatefulSet":
                        ranks += obj["spec"]["replicas"] * len(workers)
                    elif obj["kind"] == "LeaderWorkerSet":
                        size = obj["spec"]["leaderWorkerTemplate"]["size"]
                        ranks += len(workers) * (1 if name.endswith("/leader") else size - 1)
            self.assertEqual(ranks, world, f"{layout}: {ranks} ranks, WORLD_SIZE {world}")

    def test_flags_ports_and_probes(self):
        accepted = {binary: helped_flags(binary) for binary in BINARIES}
        for binary in ("treeverify-coordinator", "treeverify-worker"):
            self.assertIn("metrics_listen", accepted[binary], f"{binary} --helpfull")
        self.assertIn("preset", accepted["treeverify-cli"], "treeverify-cli --helpfull")
        liveness = re.search(r'kLivenessService\[\] = "([^"]+)"',
                             open(os.path.join(ROOT, "services/include/treeverify/services/"
                                               "server_bootstrap.h")).read()).group(1)
        readiness = {"treeverify-coordinator": "treeverify.v1.Verifier",
                     "treeverify-worker": "treeverify.v1.Worker"}
        for service in readiness.values():
            package, name = service.rsplit(".", 1)
            protos = " ".join(open(os.path.join(ROOT, "proto/treeverify/v1", f)).read()
                              for f in os.listdir(os.path.join(ROOT, "proto/treeverify/v1")))
            self.assertIn(f"service {name} ", protos)
        for layout, objects in self.layouts.items():
            for obj in objects:
                for template_name, template in pod_templates(obj):
                    spec = template["spec"]
                    for container in spec.get("initContainers", []) + spec["containers"]:
                        where = f"{layout}: {template_name}/{container['name']}"
                        started = container_command(container)
                        self.assertIsNotNone(started, where)
                        binary, args = started
                        given = flags(args if binary != "treeverify-cli" else args[1:])
                        for name in given:
                            self.assertIn(name, accepted[binary], f"{where}: --{name}")
                        ports = {p["containerPort"]: p["name"] for p in container.get("ports", [])}
                        for flag in LISTEN_FLAGS:
                            if flag in given:
                                port = int(given[flag].rsplit(":", 1)[1])
                                self.assertIn(port, ports, f"{where}: --{flag} {given[flag]}")
                        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                            if probe not in container:
                                continue
                            grpc = container[probe]["grpc"]
                            self.assertIn(grpc["port"], ports, f"{where}: {probe}")
                            self.assertEqual(ports[grpc["port"]].split("-")[0], "health", where)
                            self.assertEqual(int(given["health_listen"].rsplit(":", 1)[1]),
                                             grpc["port"], where)
                            # Alive while the process runs; started and ready once it serves
                            # (a rank: its model loaded; the coordinator: every rank joined).
                            expected = liveness if probe == "livenessProbe" else readiness[binary]
                            self.assertEqual(grpc["service"], expected, f"{where}: {probe}")

    def test_references_resolve_and_images_are_set(self):
        # ConfigMaps and claims a pod names exist (generated names carry a hash, which Kustomize
        # writes into the workloads it knows: a custom one needs its configuration), and every
        # image is a full reference (the images transformer reached it).
        for layout, objects in self.layouts.items():
            names = {(o["kind"], o["metadata"]["name"]) for o in objects}
            for obj in objects:
                for name, template in pod_templates(obj):
                    spec = template["spec"]
                    where = f"{layout}: {name}"
                    for container in spec.get("initContainers", []) + spec["containers"]:
                        self.assertRegex(container["image"], r"^[a-z0-9.-]+/.+:.+$", where)
                        for source in container.get("envFrom", []):
                            ref = source["configMapRef"]["name"]
                            self.assertIn(("ConfigMap", ref), names, f"{where}: envFrom {ref}")
                    for volume in spec.get("volumes", []):
                        claim = volume.get("persistentVolumeClaim")
                        if claim:
                            self.assertIn(("PersistentVolumeClaim", claim["claimName"]), names,
                                          where)

    def test_ports_are_unique_within_a_pod(self):
        # The containers of a pod share its network namespace.
        for layout, objects in self.layouts.items():
            for obj in objects:
                for name, template in pod_templates(obj):
                    ports = [p["containerPort"] for c in template["spec"]["containers"]
                             for p in c.get("ports", [])]
                    names = [p["name"] for c in template["spec"]["containers"]
                             for p in c.get("ports", [])]
                    self.assertEqual(len(ports), len(set(ports)), f"{layout}: {name}: {ports}")
                    self.assertEqual(len(names), len(set(names)), f"{layout}: {name}: {names}")

    def test_rank_patches_are_generated_from_the_base(self):
        generator = os.path.join(K8S, "tools", "generate_rank_patches.py")
        with tempfile.TemporaryDirectory() as out:
            result = run([sys.executable, generator, out])
            self.assertEqual(result.returncode, 0, result.stderr)
            for written in result.stdout.split():
                with open(os.path.join(out, written)) as fresh, \
                        open(os.path.join(K8S, written)) as committed:
                    self.assertEqual(fresh.read(), committed.read(),
                                     f"{written}: run deploy/k8s/tools/generate_rank_patches.py")

    def test_ranks_reach_the_coordinator_before_it_is_ready(self):
        # The coordinator is ready only once every rank joined: the ranks must reach it through a
        # Service that lists it before that (publishNotReadyAddresses), or the leader's own name.
        for layout, objects in self.layouts.items():
            services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
            for obj in objects:
                for name, template in pod_templates(obj):
                    for container in template["spec"]["containers"]:
                        started = container_command(container)
                        if not started or started[0] != "treeverify-worker":
                            continue
                        host = flags(started[1])["coordinator"].rsplit(":", 1)[0]
                        if host == "$(LWS_LEADER_ADDRESS)":
                            continue
                        where = f"{layout}: {name}/{container['name']}: --coordinator {host}"
                        self.assertIn(host, services, where)
                        spec = services[host]["spec"]
                        self.assertTrue(spec.get("publishNotReadyAddresses"), where)
                        self.assertEqual(spec["selector"].get("app.kubernetes.io/component"),
                                         "coordinator", where)

    def test_services_target_ports_that_exist(self):
        for layout, objects in self.layouts.items():
            pods = [t for o in objects for _, t in pod_templates(o)]
            for service in (o for o in objects if o["kind"] == "Service"):
                selector = service["spec"]["selector"]
                selected = [t for t in pods
                            if selector.items() <= t["metadata"]["labels"].items()]
                self.assertTrue(selected, f"{layout}: Service {service['metadata']['name']}")
                names = {p["name"] for t in selected for c in t["spec"]["containers"]
                         for p in c.get("ports", [])}
                for port in service["spec"]["ports"]:
                    self.assertIn(port["targetPort"], names,
                                  f"{layout}: Service {service['metadata']['name']}")

    def test_dashboard_configmap(self):
        dashboard = open(os.path.join(ROOT, "monitoring/dashboards/treeverify.json")).read()
        for layout, objects in self.layouts.items():
            config = next(o for o in objects if o["kind"] == "ConfigMap"
                          and o["metadata"]["name"] == "treeverify-grafana-dashboard")
            self.assertEqual(config["metadata"]["labels"]["grafana_dashboard"], "1")
            self.assertEqual(config["data"]["treeverify.json"], dashboard, layout)


class CustomResourceTest(unittest.TestCase):
    """The Prometheus Operator's monitors and the LeaderWorkerSet: the fields we rely on."""

    @classmethod
    def setUpClass(cls):
        cls.layouts = rendered_layouts()

    def test_monitors(self):
        for layout, objects in self.layouts.items():
            pods = [t for o in objects for _, t in pod_templates(o)]
            services = [o for o in objects if o["kind"] == "Service"]
            for monitor in (o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")):
                where = f"{layout}: {monitor['kind']} {monitor['metadata']['name']}"
                self.assertEqual(monitor["apiVersion"], "monitoring.coreos.com/v1", where)
                selector = monitor["spec"]["selector"]["matchLabels"]
                if monitor["kind"] == "ServiceMonitor":
                    endpoints = monitor["spec"]["endpoints"]
                    selected = [s for s in services
                                if selector.items() <= s["metadata"]["labels"].items()]
                    names = {p["name"] for s in selected for p in s["spec"]["ports"]}
                else:
                    endpoints = monitor["spec"]["podMetricsEndpoints"]
                    selected = [t for t in pods
                                if selector.items() <= t["metadata"]["labels"].items()]
                    names = {p["name"] for t in selected for c in t["spec"]["containers"]
                             for p in c.get("ports", [])}
                self.assertTrue(selected, f"{where} selects nothing")
                for endpoint in endpoints:
                    self.assertIn(endpoint["port"], names, where)
                    self.assertEqual(endpoint["path"], "/metrics", where)
        demo = {o["kind"] for o in self.layouts["cpu-demo"]}
        self.assertFalse(demo & {"ServiceMonitor", "PodMonitor", "PersistentVolumeClaim"},
                         "cpu-demo must apply on a bare kind/minikube cluster")

    def test_leader_worker_set(self):
        sets = [o for o in self.layouts["multi-node"] if o["kind"] == "LeaderWorkerSet"]
        self.assertEqual(len(sets), 1)
        group = sets[0]
        self.assertEqual(group["apiVersion"], "leaderworkerset.x-k8s.io/v1")
        template = group["spec"]["leaderWorkerTemplate"]
        self.assertGreaterEqual(template["size"], 2)
        self.assertEqual(template["restartPolicy"], "RecreateGroupOnPodRestart")
        for part in ("leaderTemplate", "workerTemplate"):
            self.assertTrue(template[part]["spec"]["containers"], part)
        kinds = {o["kind"] for o in self.layouts["multi-node"]}
        self.assertFalse(kinds & {"Deployment", "StatefulSet"}, "the group replaces them")
        # The controller names the leader's headless Service (LWS_LEADER_ADDRESS) after the set
        # and makes none if a Service of that name exists already.
        services = {o["metadata"]["name"] for o in self.layouts["multi-node"]
                    if o["kind"] == "Service"}
        self.assertNotIn(group["metadata"]["name"], services)
        for layout in ("multi-node+blackwell",):
            group = next(o for o in self.layouts[layout] if o["kind"] == "LeaderWorkerSet")
            for part in ("leaderTemplate", "workerTemplate"):
                terms = group["spec"]["leaderWorkerTemplate"][part]["spec"]["affinity"]
                self.assertIn('"12"', json.dumps(terms), f"{layout} {part}")


class YamlLintTest(unittest.TestCase):
    def test_yamllint(self):
        result = run(["yamllint", "--strict", "-c", os.path.join(ROOT, ".yamllint.yaml"),
                      os.path.join(ROOT, "deploy"), os.path.join(ROOT, "monitoring")])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: deploy_test.py BUILD_DIR [unittest args]")
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
