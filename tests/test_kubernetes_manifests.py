"""The manifests of examples/kubernetes/, checked against the schemas a cluster would check them with.

Every YAML document of every ``examples/kubernetes/*.yaml`` is validated:

* Kubernetes' own kinds (Secret, Service, Job, StatefulSet, ...) with ``kubernetes-validate``, which
  bundles Kubernetes' OpenAPI schemas, in strict mode (an unknown field fails), for Kubernetes 1.30
  and for the newest version the installed package bundles;
* the operators' kinds (PyTorchJob, MPIJob, TrainJob) with ``jsonschema`` against the
  ``openAPIV3Schema`` of the operator's own CRD, kept in examples/kubernetes/schemas/ (SOURCES.md
  there says where each came from). A CRD schema does not forbid unknown fields (the API server
  prunes them silently), so each field of the manifest is also looked up in the schema's
  ``properties``, except where the schema keeps unknown fields or is a map (``additionalProperties``).

A document of any other kind fails: nothing goes unvalidated. The checks are shown to bite on
broken copies of the manifests (a misspelled field, a wrong type), and the values that must agree
across documents (the Indexed Job's size, its rendezvous name and Service) are checked to agree.
CEL rules (``x-kubernetes-validations``) and list-map uniqueness are not evaluated.
"""

import copy
import json
import re
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "examples" / "kubernetes"
SCHEMAS = HERE / "schemas"
MANIFESTS = sorted(HERE.glob("*.yaml"))
EXPECTED = {"pytorchjob.yaml", "trainjob.yaml", "mpijob.yaml", "indexed-job.yaml", "ssh-pods.yaml"}

# The oldest Kubernetes these manifests are meant for, and the newest the installed package knows.
KUBERNETES_VERSIONS = sorted({"1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])},
                             key=lambda v: tuple(int(part) for part in v.split(".")))

# (apiVersion, kind) -> the CRD's openAPIV3Schema for that version, in SCHEMAS.
CRD_SCHEMAS = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-kubeflow.org-v1.json",
    ("kubeflow.org/v2beta1", "MPIJob"): "mpijob-kubeflow.org-v2beta1.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-trainer.kubeflow.org-v1alpha1.json",
}

# The top-level metadata of a custom resource is the API server's ObjectMeta (the CRD schema says
# only `type: object`): the fields a manifest may set there.
OBJECT_META_FIELDS = {"name", "generateName", "namespace", "labels", "annotations"}


def documents(path):
    return list(yaml.safe_load_all(path.read_text()))


def all_documents():
    return [(path, index, doc) for path in MANIFESTS for index, doc in enumerate(documents(path))]


def doc_id(item):
    path, index, doc = item
    if isinstance(doc, dict):
        return f"{path.name}#{index}:{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    return f"{path.name}#{index}"


def first(path, kind):
    (doc,) = [d for d in documents(path) if d["kind"] == kind]
    return doc


@lru_cache(maxsize=None)
def crd_schema(filename):
    return json.loads((SCHEMAS / filename).read_text())


def _where(path):
    return ".".join(str(part) for part in path) or "(top)"


def unknown_fields(value, schema, path=()):
    """Paths in ``value`` that ``schema`` does not name: the fields the API server would prune."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                yield from unknown_fields(item, properties[key], path + (key,))
            elif isinstance(extra, dict):
                yield from unknown_fields(item, extra, path + (key,))
            elif extra is not True:
                yield path + (key,)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], path + (index,))


def crd_problems(doc, schema):
    out = [f"{_where(error.absolute_path)}: {error.message}"
           for error in jsonschema.Draft4Validator(schema).iter_errors(doc)]
    body = {key: value for key, value in doc.items() if key != "metadata"}
    out += [f"{_where(path)}: unknown field (not in the CRD's schema)" for path in unknown_fields(body, schema)]
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name"):
        out.append("metadata.name: missing")
    else:
        out += [f"metadata.{key}: unknown field" for key in metadata if key not in OBJECT_META_FIELDS]
        for key in ("labels", "annotations"):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.get(key, {}).items()):
                out.append(f"metadata.{key}: values must be strings")
    return out


def problems(doc):
    """What is wrong with one YAML document; [] when it validates."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return [f"not a Kubernetes object (no apiVersion and kind): {doc!r:.80}"]
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        return crd_problems(doc, crd_schema(CRD_SCHEMAS[key]))
    out = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            out.append(f"Kubernetes {version}: {_where(error.path)}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            out.append(f"no schema for {doc['kind']} ({doc['apiVersion']}): {error.message}")
    return out


def mappings(node, wanted):
    """Every mapping anywhere in ``node`` (depth first) for which ``wanted(mapping)`` holds."""
    if isinstance(node, dict):
        if wanted(node):
            yield node
        for value in node.values():
            yield from mappings(value, wanted)
    elif isinstance(node, list):
        for value in node:
            yield from mappings(value, wanted)


def containers(node):
    """Every container (a mapping with name and image) anywhere in ``node``."""
    return mappings(node, lambda found: "name" in found and "image" in found)


def env_of(container):
    return {item["name"]: item for item in container.get("env", [])}


# ---- every document validates ----------------------------------------------------------------------


def test_the_manifests_are_all_there():
    assert EXPECTED <= {path.name for path in MANIFESTS}
    for path in MANIFESTS:
        assert documents(path), f"{path.name} has no document"


@pytest.mark.parametrize("item", all_documents(), ids=doc_id)
def test_document_validates(item):
    path, _, doc = item
    assert problems(doc) == [], f"{path.name}: {doc_id(item)}"


def test_the_kinds_are_the_expected_ones():
    kinds = {path.name: [(d["apiVersion"], d["kind"]) for d in documents(path)] for path in MANIFESTS}
    assert kinds["pytorchjob.yaml"] == [("kubeflow.org/v1", "PyTorchJob")]
    assert kinds["trainjob.yaml"] == [("trainer.kubeflow.org/v1alpha1", "TrainJob")]
    assert kinds["mpijob.yaml"] == [("kubeflow.org/v2beta1", "MPIJob")]
    assert kinds["indexed-job.yaml"] == [("v1", "Secret"), ("v1", "Service"), ("batch/v1", "Job")]
    assert kinds["ssh-pods.yaml"] == [("v1", "Service"), ("apps/v1", "StatefulSet")]


# ---- the checks bite -------------------------------------------------------------------------------


def _rename(mapping, old, new):
    mapping[new] = mapping.pop(old)


BROKEN = [
    # (file, kind, what is broken, how)
    ("indexed-job.yaml", "Job", "misspelled completionsMode",
     lambda d: _rename(d["spec"], "completionMode", "completionsMode")),
    ("indexed-job.yaml", "Job", "parallelism as a string", lambda d: d["spec"].__setitem__("parallelism", "three")),
    ("indexed-job.yaml", "Job", "env value as a number",
     lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"][0].__setitem__("value", 3)),
    ("indexed-job.yaml", "Secret", "misspelled strinData", lambda d: _rename(d, "stringData", "strinData")),
    ("indexed-job.yaml", "Service", "misspelled clusterIp", lambda d: _rename(d["spec"], "clusterIP", "clusterIp")),
    ("indexed-job.yaml", "Service", "port as a string",
     lambda d: d["spec"]["ports"][0].__setitem__("port", "rendezvous")),
    ("ssh-pods.yaml", "StatefulSet", "misspelled serviceNames",
     lambda d: _rename(d["spec"], "serviceName", "serviceNames")),
    ("ssh-pods.yaml", "StatefulSet", "replicas as a string", lambda d: d["spec"].__setitem__("replicas", "3")),
    ("pytorchjob.yaml", "PyTorchJob", "misspelled pytorchReplicaSpec",
     lambda d: _rename(d["spec"], "pytorchReplicaSpecs", "pytorchReplicaSpec")),
    ("pytorchjob.yaml", "PyTorchJob", "misspelled cleanPodPolicy",
     lambda d: _rename(d["spec"]["runPolicy"], "cleanPodPolicy", "cleanPodPolicies")),
    ("pytorchjob.yaml", "PyTorchJob", "replicas as a string",
     lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].__setitem__("replicas", "two")),
    ("mpijob.yaml", "MPIJob", "misspelled slotPerWorker",
     lambda d: _rename(d["spec"], "slotsPerWorker", "slotPerWorker")),
    ("mpijob.yaml", "MPIJob", "slotsPerWorker as a string", lambda d: d["spec"].__setitem__("slotsPerWorker", "1")),
    ("mpijob.yaml", "MPIJob", "mpiImplementation not one of the choices",
     lambda d: d["spec"].__setitem__("mpiImplementation", "LAM")),
    ("trainjob.yaml", "TrainJob", "misspelled numNode", lambda d: _rename(d["spec"]["trainer"], "numNodes", "numNode")),
    ("trainjob.yaml", "TrainJob", "numNodes as a string", lambda d: d["spec"]["trainer"].__setitem__("numNodes", "3")),
    ("trainjob.yaml", "TrainJob", "runtimeRef without its name", lambda d: d["spec"]["runtimeRef"].pop("name")),
]


@pytest.mark.parametrize("filename,kind,what,breaks", BROKEN, ids=[f"{b[0]}:{b[1]}:{b[2]}" for b in BROKEN])
def test_a_broken_copy_fails(filename, kind, what, breaks):
    doc = copy.deepcopy(first(HERE / filename, kind))
    assert problems(doc) == []
    breaks(doc)
    assert problems(doc), f"{filename} {kind} with {what} passed validation"


WITH_CONTAINERS = [item for item in all_documents() if isinstance(item[2], dict) and list(containers(item[2]))]


@pytest.mark.parametrize("item", WITH_CONTAINERS, ids=doc_id)
def test_a_misspelled_field_deep_in_a_pod_template_fails(item):
    """A typo in every container, deep inside each kind's pod template, is caught."""
    for found in range(len(list(containers(item[2])))):
        doc = copy.deepcopy(item[2])
        container = list(containers(doc))[found]
        container["imagePullPolicyy"] = "IfNotPresent"
        assert any("imagePullPolicyy" in problem for problem in problems(doc)), doc_id(item)
        doc = copy.deepcopy(item[2])
        list(containers(doc))[found]["image"] = ["not", "a", "string"]
        assert problems(doc), doc_id(item)


@pytest.mark.parametrize("item", [i for i in all_documents() if isinstance(i[2], dict)], ids=doc_id)
def test_a_misspelled_metadata_field_fails(item):
    doc = copy.deepcopy(item[2])
    doc["metadata"]["lables"] = {"app": "x"}
    assert problems(doc), doc_id(item)


@pytest.mark.parametrize("doc", [
    {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "x"}, "spec": {}},
    {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"}},
    {"apiVersion": "kubeflow.org/v1", "kind": "MPIJob", "metadata": {"name": "x"}, "spec": {}},
    {"kind": "Job", "metadata": {"name": "x"}},
    None,
    "just a string",
], ids=["TFJob", "Widget", "MPIJob-v1", "no-apiVersion", "empty-document", "string"])
def test_a_document_of_an_unknown_kind_fails(doc):
    assert problems(doc)


# ---- what must agree ------------------------------------------------------------------------------


def test_the_indexed_job_agrees_with_itself_and_its_service():
    path = HERE / "indexed-job.yaml"
    job, service, secret = first(path, "Job"), first(path, "Service"), first(path, "Secret")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    env = env_of(container)
    assert int(env["ROUNDEL_NUM_PROC"]["value"]) == spec["completions"] == spec["parallelism"]
    assert env["ROUNDEL_RENDEZVOUS_ADDR"]["value"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    # the pods' subdomain is the headless Service, which selects exactly this Job's pods
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    port = int(env["ROUNDEL_RENDEZVOUS_PORT"]["value"])
    assert port in [p["port"] for p in service["spec"]["ports"]]
    assert port in [p["containerPort"] for p in container.get("ports", [])]
    # the secret comes from the Secret of this file, 32 bytes in hex
    ref = env["ROUNDEL_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] == "roundel-secret"
    assert re.fullmatch(r"[0-9a-f]{64}", secret["stringData"][ref["key"]])
    assert "JOB_COMPLETION_INDEX" not in env  # the Job controller sets it


def test_the_operator_jobs_are_consistent():
    pytorchjob = first(HERE / "pytorchjob.yaml", "PyTorchJob")
    for replica in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        # the operator sets RANK, WORLD_SIZE, MASTER_* in the container named "pytorch"
        assert [c["name"] for c in replica["template"]["spec"]["containers"]] == ["pytorch"]
    assert pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    trainjob = first(HERE / "trainjob.yaml", "TrainJob")
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainjob["spec"]["trainer"]["command"][0] == "torchrun"  # the runtime sets only torchrun's PET_*
    mpijob = first(HERE / "mpijob.yaml", "MPIJob")
    replicas = mpijob["spec"]["mpiReplicaSpecs"]
    (launcher,) = replicas["Launcher"]["template"]["spec"]["containers"]
    command = launcher["command"]
    assert command[0] == "mpirun"
    assert int(command[command.index("-np") + 1]) == replicas["Worker"]["replicas"] * mpijob["spec"]["slotsPerWorker"]
    assert command[command.index("--hostfile") + 1] == "/etc/mpi/hostfile"  # Open MPI 5 ignores the operator's variable


def test_the_ssh_pods_and_the_roundelrun_line_agree():
    path = HERE / "ssh-pods.yaml"
    service, sts = first(path, "Service"), first(path, "StatefulSet")
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (line,) = [line for line in path.read_text().splitlines() if "roundelrun -np" in line]
    np, hosts = re.search(r"roundelrun -np (\d+) -H (\S+)", line).groups()
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    assert int(np) == replicas
    assert hosts.split(",") == [f"{name}-{i}.{service['metadata']['name']}:1" for i in range(replicas)]
    assert f"kubectl exec {name}-0 " in line
    volume = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    keys = {item["key"] for item in volume["secret"]["items"]}
    assert keys == {"id_ed25519", "id_ed25519.pub", "authorized_keys"}
    assert volume["secret"]["secretName"] == "roundel-ssh-keys"


def test_every_secret_used_is_defined_or_created_as_the_comments_say():
    for path in MANIFESTS:
        text = path.read_text()
        defined = {d["metadata"]["name"] for d in documents(path) if d["kind"] == "Secret"}
        created = set(re.findall(r"kubectl create secret generic ([a-z0-9-]+)", text))
        used = set()
        for doc in documents(path):
            for container in containers(doc):
                used |= {item["valueFrom"]["secretKeyRef"]["name"] for item in container.get("env", [])
                         if "secretKeyRef" in item.get("valueFrom", {})}
            for spec in _pod_specs(doc):
                used |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        assert used <= defined | created, f"{path.name}: {used - defined - created} neither defined nor created"


def _pod_specs(node):
    return mappings(node, lambda found: "containers" in found)


def test_the_commands_run_files_the_image_has():
    """Every /workspace/... path a manifest runs is in this checkout, which the Dockerfile copies there."""
    paths = set()
    for path in MANIFESTS:
        paths |= set(re.findall(r"/workspace/[\w./-]+\.py", path.read_text()))
    assert paths
    for found in paths:
        assert (REPO / found.removeprefix("/workspace/")).is_file(), found


def test_the_dockerfile_installs_with_the_constraints():
    text = (HERE / "Dockerfile").read_text()
    instructions = [line for line in text.splitlines() if line and not line.lstrip().startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim"
    body = "\n".join(instructions)
    assert "-c /workspace/constraints.txt" in body
    assert '"/workspace[examples,mpi]"' in body
    assert re.search(r"^COPY .*\bconstraints\.txt\b.* /workspace/$", body, re.M)
    assert re.search(r"^COPY examples /workspace/examples$", body, re.M)
    assert "WORKDIR /workspace" in body
    assert (REPO / "constraints.txt").is_file()
    assert "docker build -f examples/kubernetes/Dockerfile -t roundel-example ." in text
    # every file or directory the Dockerfile copies exists
    for line in instructions:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source


def test_the_schemas_and_their_sources():
    sources = (SCHEMAS / "SOURCES.md").read_text()
    files = {path.name for path in SCHEMAS.glob("*.json")}
    assert files == set(CRD_SCHEMAS.values())
    for (api_version, kind), filename in CRD_SCHEMAS.items():
        schema = crd_schema(filename)
        assert {"apiVersion", "kind", "metadata", "spec"} <= set(schema["properties"]), filename
        # SOURCES.md names the file, with the upstream commit it was taken from and the license
        (section,) = [part for part in sources.split("\n## ") if part.startswith(f"`{filename}`")]
        assert re.search(r"\b[0-9a-f]{40}\b", section), filename
        assert "Apache-2.0" in section and kind in section and api_version in section, filename
