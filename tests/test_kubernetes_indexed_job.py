"""The plain Indexed Job of examples/kubernetes/indexed-job.yaml, run the way Kubernetes would run it.

Each pod is a network-namespace host (tests/netns_network.py) named as the Job
controller names an Indexed Job's pods (``<job>-<index>``), with the
``/etc/hosts`` a pod gets and the names the headless Service gives
(``<job>-<index>.<service>`` and the full cluster name), running the
container's command with the container's environment (the Secret's value
for ``secretKeyRef``) plus the ``JOB_COMPLETION_INDEX`` the Job controller
sets. The image's ``/workspace`` is this checkout, its ``python`` this
interpreter. No ssh, no operator, no launcher: the pods find each other.
"""

import base64
import fcntl
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from netns_network import NamespaceNetwork, missing_tools, require

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "examples" / "kubernetes" / "indexed-job.yaml"
LOCK = "/tmp/roundel-pods-tests.lock"
CLUSTER_DOMAIN = "cluster.local"


def documents(kind):
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc and doc["kind"] == kind]


def secret_value(name, key):
    for secret in documents("Secret"):
        if secret["metadata"]["name"] == name:
            if key in secret.get("stringData", {}):
                return secret["stringData"][key]
            return base64.b64decode(secret["data"][key]).decode()
    raise AssertionError(f"the manifest has no Secret {name} with key {key}")


def container_env(container):
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secret_value(ref["name"], ref["key"])
    return env


def in_image(argument):
    """A path of the image as it lies in this checkout; its ``python`` as this interpreter."""
    if argument == "python":
        return sys.executable
    return argument.replace("/workspace", str(REPO))


@pytest.fixture()
def pods_network():
    require(missing_tools(("ip", "nsenter", "unshare")), "the Indexed Job test", "iproute2 and util-linux")
    (job,) = documents("Job")
    count = job["spec"]["completions"]
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        net = NamespaceNetwork("k", "10.233.0", count)
        net.build()
        try:
            yield net
        finally:
            net.remove()


def test_indexed_job_trains_across_pods_with_no_ssh_and_no_operator(pods_network, tmp_path):
    (job,) = documents("Job")
    (service,) = documents("Service")
    namespace = job["metadata"].get("namespace", "default")
    name, pod_spec = job["metadata"]["name"], job["spec"]["template"]["spec"]
    assert pod_spec["subdomain"] == service["metadata"]["name"]
    (container,) = pod_spec["containers"]
    env = container_env(container)
    command = [in_image(arg) for arg in container.get("command", []) + container.get("args", [])]
    names = [f"{name}-{index}" for index in range(len(pods_network.addrs))]
    procs = []
    for index, (pod, addr) in enumerate(zip(names, pods_network.addrs)):
        hosts = ["127.0.0.1\tlocalhost"]
        hosts += [f"{other_addr}\t{other}.{service['metadata']['name']}.{namespace}.svc.{CLUSTER_DOMAIN}\t"
                  f"{other}.{service['metadata']['name']}\t{other}"
                  for other, other_addr in zip(names, pods_network.addrs)]
        hosts_file = tmp_path / f"hosts-{pod}"
        hosts_file.write_text("\n".join(hosts) + "\n")
        pod_env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path / pod),
                   "HOSTNAME": pod, **env, "JOB_COMPLETION_INDEX": str(index)}
        procs.append(subprocess.Popen([*pods_network.enter(index, pod, hosts_file), *command], env=pod_env,
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    deadline = time.monotonic() + 240
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("the pods did not finish within 240 s (hang?)\n" +
                        "\n".join(f"--- pod {i}\n{p.communicate()[0]}" for i, p in enumerate(procs)))
    report = "\n".join(f"--- pod {i} (exit {p.returncode})\n{out[-4000:]}"
                       for i, (p, out) in enumerate(zip(procs, outputs)))
    assert all(p.returncode == 0 for p in procs), report
    assert f"{len(names)} rank(s)" in outputs[0], report
    accuracy = re.search(r"final test accuracy: ([\d.]+)", outputs[0])
    assert accuracy and float(accuracy.group(1)) > 0.5, report
