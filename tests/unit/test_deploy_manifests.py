"""deploy/kubernetes/ without a cluster: every built-in object validates against the Kubernetes API's schemas
(kubernetes-validate, strict: no unknown fields) on the oldest Kubernetes the Inference Extension supports and the
newest the validator knows; the InferencePool against its CRD's schema (vendored in deploy/kubernetes/schemas/,
with jsonschema, and its two CEL rules checked here); and the pieces fit together: `vlora serve`'s own flag
parser takes the container's arguments, the volumes and the Secret are where the flags point, the pool selects
the pods and targets their OpenAI port, the route and the pool name the EPP and the gateway, and the EPP's
metric flags name the gauges vlora exports (tests/gie_protocol.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gie_protocol import EPP_FLAGS
from vlora.server.metrics import TritonModelMetrics
from vlora.server.openai.metrics import QUEUED
from vlora.server.options import add_arguments

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
BUILT_IN = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}
POOL_API = "inference.networking.k8s.io/v1"
GATEWAY_API = "gateway.networking.k8s.io/v1"
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())  # 1.29: sidecars, the Extension's minimum


def manifests() -> list[tuple[str, dict]]:
    """(file name, object) of every object in the folder's manifests (not the Helm values)."""
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name.endswith("-values.yaml"):
            continue
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def the(kind: str, name: str) -> dict:
    (obj,) = [o for _, o in manifests() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` arguments as {name: value}."""
    out = {}
    for arg in args:
        assert arg.startswith("--") and "=" in arg, f"{arg!r}: write flags as --name=value"
        name, _, value = arg[2:].partition("=")
        out[name] = value
    return out


def test_every_object_is_of_a_validated_kind():
    apis = {(o["apiVersion"], o["kind"]) for _, o in manifests()}
    assert {a for a, _ in apis} <= BUILT_IN | {POOL_API, GATEWAY_API}, apis
    assert (POOL_API, "InferencePool") in apis and ("apps/v1", "Deployment") in apis


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_objects_validate_against_the_kubernetes_schemas(version):
    checked = 0
    for name, obj in manifests():
        if obj["apiVersion"] in BUILT_IN:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {e.message} at {list(e.path)}")
            checked += 1
    assert checked >= 8


def pool_schema() -> dict:
    crd = yaml.safe_load((DEPLOY / "schemas" / "inferencepools.inference.networking.k8s.io.yaml").read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io" and crd["spec"]["names"]["kind"] == "InferencePool"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def pool_errors(pool: dict) -> list[str]:
    """What the API server would refuse in ``pool``: the schema's errors, then its CEL rules'."""
    validator = jsonschema.Draft7Validator(pool_schema())
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(pool)]
    spec = pool.get("spec", {})
    ports = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(set(ports)) != len(ports):
        errors.append("targetPorts: port number must be unique")
    ref = spec.get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("endpointPickerRef: port is required when kind is 'Service' or unspecified")
    return errors


def test_the_inference_pool_validates_against_its_crd_schema():
    pool = the("InferencePool", "vlora")
    assert pool_errors(pool) == []


@pytest.mark.parametrize("break_it", [
    lambda s: s.pop("endpointPickerRef"),
    lambda s: s.update(targetPorts=[]),
    lambda s: s.update(targetPorts=[{"number": 9000}, {"number": 9000}]),
    lambda s: s["targetPorts"][0].update(number=70000),
    lambda s: s["endpointPickerRef"].pop("port"),
    lambda s: s["endpointPickerRef"].update(failureMode="FailSoft"),
    lambda s: s["selector"].update(matchLabels={}),
    lambda s: s.update(targetPortNumber=9000) or s.pop("targetPorts"),  # the v1alpha2 field
], ids=["no-picker", "no-port", "same-port-twice", "port-out-of-range", "picker-without-port", "bad-failure-mode",
        "empty-selector", "alpha-field"])
def test_the_pool_schema_refuses_broken_pools(break_it):
    pool = the("InferencePool", "vlora")
    break_it(pool["spec"])
    assert pool_errors(pool), pool["spec"]


def test_the_pool_selects_the_pods_and_targets_their_openai_port():
    pool, deployment = the("InferencePool", "vlora"), the("Deployment", "vlora")
    template = deployment["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    c = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (target,) = pool["spec"]["targetPorts"]
    assert target["number"] == ports["openai"] == int(flags(c["args"])["openai-port"])
    ref = pool["spec"]["endpointPickerRef"]
    service = the("Service", ref["name"])
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = container(the("Deployment", ref["name"]))
    assert grpc["targetPort"] in {p["name"] for p in epp["ports"]}
    epp_labels = the("Deployment", ref["name"])["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= epp_labels.items()
    assert flags(epp["args"])["pool-name"] == pool["metadata"]["name"]


def test_vlora_serve_takes_the_arguments_and_its_volumes_are_where_they_point():
    deployment = the("Deployment", "vlora")
    c = container(deployment)
    assert c["command"] == ["vlora", "serve"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(c["args"])  # vlora serve's own parser: an unknown or mistyped flag fails here
    assert args.host == "0.0.0.0" and args.device == "cuda" and args.openai_port == 9000

    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}

    def volume_at(path: str) -> tuple[dict, dict]:
        (m,) = [m for m in mounts.values() if Path(m["mountPath"]) in (Path(path), *Path(path).parents)]
        return m, volumes[m["name"]]

    mount, volume = volume_at(args.adapters)
    assert mount["readOnly"] and volume["persistentVolumeClaim"]["claimName"] == "vlora-adapters"
    mount, volume = volume_at(args.model)
    assert mount["readOnly"] and volume["persistentVolumeClaim"]["claimName"] == "vlora-models"
    mount, volume = volume_at(args.admin_token_file)  # the token file is the Secret's item
    items = {i["path"]: i["key"] for i in volume["secret"]["items"]}
    assert items[Path(args.admin_token_file).name] == "token" and mount["readOnly"]
    assert volume["secret"]["defaultMode"] == 0o400
    assert "emptyDir" in volume_at(args.workspace)[1] and volume_at("/dev/shm")[1]["emptyDir"]["medium"] == "Memory"
    claims = {o["metadata"]["name"] for _, o in manifests() if o["kind"] == "PersistentVolumeClaim"}
    assert {"vlora-models", "vlora-adapters"} <= claims

    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == args.http_port and ports["grpc"] == args.grpc_port and ports["metrics"] == args.metrics_port
    for probe in ("startupProbe", "readinessProbe"):  # Triton's readiness: the server and the model
        assert c[probe]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # The pod's grace period outlasts vlora serve's stop (its exit timeout, 30 s).
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30


def test_the_epp_reads_vlora_metrics_under_the_protocols_names(pb):
    epp = flags(container(the("Deployment", "vlora-epp"))["args"])
    values = yaml.safe_load((DEPLOY / "epp-values.yaml").read_text())
    for name, metric in EPP_FLAGS.items():
        assert epp[name] == metric, name
        assert values["inferenceExtension"]["flags"][name] == metric, name
    # Every metric they name is a gauge vlora exports (the model's, or the front end's queue sum), named without
    # labels (the EPP reads the first series).
    TritonModelMetrics(pb, "vlora", "1", max_lora=8).close()
    exported = {name: f.kind for name, f in pb.families.items()} | {QUEUED.decode(): "gauge"}
    for metric in filter(None, EPP_FLAGS.values()):
        assert exported[metric] == "gauge", metric
        assert "{" not in metric
    # Both ways of deploying the EPP schedule alike, LoRA affinity included; the raw EPP reads the ConfigMap's file.
    config = the("ConfigMap", "vlora-epp")["data"]
    config_file = Path(epp["config-file"])
    (mount,) = container(the("Deployment", "vlora-epp"))["volumeMounts"]
    assert Path(mount["mountPath"]) == config_file.parent and config_file.name in config
    assert values["inferenceExtension"]["pluginsConfigFile"] in config
    assert values["inferenceExtension"]["pluginsCustomConfig"] == config
    (text,) = config.values()
    plugins = yaml.safe_load(text)
    assert plugins["kind"] == "EndpointPickerConfig"
    assert {"lora-affinity-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= {p["type"] for p in plugins["plugins"]}
    pool = the("InferencePool", "vlora")["spec"]
    assert values["inferencePool"]["targetPorts"] == pool["targetPorts"]
    assert values["inferencePool"]["modelServers"]["matchLabels"] == pool["selector"]["matchLabels"]


def test_the_route_sends_the_openai_api_to_the_pool():
    gateway, route = the("Gateway", "inference-gateway"), the("HTTPRoute", "vlora")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vlora"}]
