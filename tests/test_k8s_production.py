"""Production on Kubernetes (issue 40): what a user outgrowing one machine relies on in
ops/k8s, checked on the files. KEDA's scaling formula is modelled on the shipped values, every
pod against the "restricted" Pod Security Standard, storage against the JetStream volume.
Manifests' schema, ports and command lines: tests/test_deploy_files.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from agentarium.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "ops" / "k8s"
DOCS = [
    (p.name, d)
    for p in sorted(K8S.glob("*.yaml"))
    if p.name not in ("nats-values.yaml", "kustomization.yaml")
    for d in yaml.safe_load_all(p.read_text())
    if d
]
NATS_VALUES = yaml.safe_load((K8S / "nats-values.yaml").read_text())
GiB = 1024**3


def find(kind: str, name: str) -> dict:
    [doc] = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def pods() -> list[tuple[str, dict]]:
    return [
        (f"{f}:{d['metadata']['name']}", d["spec"]["template"]["spec"])
        for f, d in DOCS
        if d["kind"] in ("Deployment", "Job", "StatefulSet")
    ]


def broker_init() -> dict:
    """The container that runs `agentarium broker init`."""
    pod = find("Deployment", "agentarium-broker-init")["spec"]["template"]["spec"]
    [init] = [c for c in pod["initContainers"] if c["name"] == "broker-init"]
    return init


CONSUMER = find("Deployment", "agentarium-consumer")
CONSUMER_ARGS = CONSUMER["spec"]["template"]["spec"]["containers"][0]["args"]
SCALED = find("ScaledObject", "agentarium-consumer")["spec"]
TRIGGER = SCALED["triggers"][0]["metadata"]


# ---- KEDA: the nats-jetstream scaler and the HPA it drives ----------------------------------------


class KedaModel:
    """KEDA's nats-jetstream scaler (metric = the consumer's num_pending + num_ack_pending,
    active while metric > activationLagThreshold) and the HPA's AverageValue rule
    (desired = ceil(metric / target), unchanged within 10 % of the current ratio), with the
    ScaledObject's min/max, scale-down stabilisation window and rate policy."""

    TOLERANCE = 0.1

    def __init__(self, spec: dict, period_s: float) -> None:
        meta = spec["triggers"][0]["metadata"]
        self.target = float(meta["lagThreshold"])
        self.activation = float(meta.get("activationLagThreshold", 0))
        self.min = int(spec.get("minReplicaCount", 0))
        self.max = int(spec.get("maxReplicaCount", 100))
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        self.window_s = float(down["stabilizationWindowSeconds"])
        [policy] = down["policies"]
        assert policy["type"] == "Pods"
        self.down_pods, self.down_period_s = int(policy["value"]), float(policy["periodSeconds"])
        self.period_s = period_s
        self.recommendations: list[tuple[float, int]] = []
        self.scale_downs: list[tuple[float, int]] = []

    def step(self, now: float, current: int, pending: int, ack_pending: int) -> int:
        metric = pending + ack_pending
        if not self.recommendations:  # the HPA's history: the fleet was sized for its work
            self.recommendations.append((now, current))
        if metric <= self.activation:
            return self.min if current else current  # to minReplicaCount (after cooldown)
        raw = max(current, 1)
        ratio = metric / (self.target * raw) if current else math.inf
        if current == 0 or abs(ratio - 1) > self.TOLERANCE:
            raw = math.ceil(metric / self.target)
        raw = min(self.max, max(self.min, 1, raw))
        self.recommendations.append((now, raw))
        window = [r for t, r in self.recommendations if t > now - self.window_s]
        desired = max(window) if raw < current else raw
        if desired < current:  # the rate policy: at most down_pods per period
            removed = sum(n for t, n in self.scale_downs if t > now - self.down_period_s)
            desired = max(desired, current - max(0, self.down_pods - removed))
            if desired < current:
                self.scale_downs.append((now, current - desired))
        return desired


def run_model(spec: dict, replicas: int, per_pod: int, pending: int, seconds: int) -> int:
    model = KedaModel(spec, period_s=float(spec.get("pollingInterval", 30)))
    for t in range(0, seconds, int(model.period_s)):
        replicas = model.step(t, replicas, pending, replicas * per_pod)
    return replicas


def test_the_scaling_target_is_what_one_consumer_holds():
    assert int(TRIGGER["lagThreshold"]) == int(flag(CONSUMER_ARGS, "--concurrency"))
    assert float(TRIGGER["activationLagThreshold"]) == 0  # active while anything runs


@pytest.mark.parametrize("replicas", [1, 2, 5, 16, 32])
def test_a_busy_fleet_with_an_empty_queue_is_not_scaled_down(replicas):
    concurrency = int(flag(CONSUMER_ARGS, "--concurrency"))
    assert run_model(SCALED, replicas, concurrency, pending=0, seconds=3600) == replicas


def test_the_old_threshold_halved_a_busy_fleet():
    """The model catches what issue 40 found: lagThreshold 64 with --concurrency 32."""
    old = {**SCALED, "triggers": [{"metadata": {**TRIGGER, "lagThreshold": "64"}}]}
    assert run_model(old, 16, 32, pending=0, seconds=3600) <= 8  # halved, and on


def test_a_queue_scales_up_within_a_minute_and_an_idle_fleet_goes_to_its_minimum():
    assert run_model(SCALED, 1, 32, pending=320, seconds=60) >= 8
    assert run_model(SCALED, 8, 0, pending=0, seconds=60) == SCALED["minReplicaCount"]


def test_a_shrinking_fleet_loses_one_draining_pod_at_a_time():
    model = KedaModel(SCALED, period_s=float(SCALED["pollingInterval"]))
    replicas, history = 32, []
    for t in range(0, 3 * 3600, int(model.period_s)):
        new = model.step(t, replicas, 0, 10 * replicas)  # every pod a third busy
        history.append((t, replicas - new))
        replicas = new
    drops = [(t, n) for t, n in history if n > 0]
    assert all(n == 1 for _, n in drops)
    assert all(
        b - a >= model.down_period_s for (a, _), (b, _) in zip(drops, drops[1:], strict=False)
    )
    assert drops[0][0] >= model.window_s - model.period_s  # after the stabilisation window


def test_the_hpa_managed_deployment_sets_no_replicas():
    assert "replicas" not in CONSUMER["spec"], "kubectl apply would reset KEDA's count"


def test_termination_grace_covers_the_drain_and_the_requeue():
    from agentarium.consumers.worker.handler import RELEASE_S

    pod = CONSUMER["spec"]["template"]["spec"]
    grace = float(flag(CONSUMER_ARGS, "--drain-grace"))
    assert pod["terminationGracePeriodSeconds"] >= grace + RELEASE_S + 20
    # the scale-down rate lets one pod drain fully before the next goes
    assert (
        SCALED["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"][0][
            "periodSeconds"
        ]
        >= grace
    )


def test_max_ack_pending_covers_the_largest_fleet():
    init = broker_init()
    concurrency = int(flag(CONSUMER_ARGS, "--concurrency"))
    assert (
        int(flag(init["args"], "--max-ack-pending")) > SCALED["maxReplicaCount"] * concurrency * 1.5
    )


# ---- storage: byte bounds within one node's volume --------------------------------------------------


def _size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", text).groups()
    return int(number) * {"Gi": GiB, "Mi": 1024**2}[unit]


def test_every_stream_and_store_is_bounded_within_the_jetstream_volume():
    from agentarium.broker import Limits

    args = broker_init()["args"]
    parsed = build_parser().parse_args(args)
    bounds = {
        k: int(getattr(parsed, k))
        for k in (
            "tasks_max_bytes",
            "trajectories_max_bytes",
            "dead_max_bytes",
            "weights_max_bytes",
        )
    }
    assert all(v > 0 for v in bounds.values()), bounds
    store = NATS_VALUES["config"]["jetstream"]["fileStore"]
    max_store, pvc = _size(store["maxSize"]), _size(store["pvc"]["size"])
    total = sum(bounds.values()) + Limits().metrics_max_bytes
    assert total <= max_store < pvc, (total / GiB, max_store / GiB)
    # a 7B policy in bf16 is about 15 GiB: three kept versions and the one being written
    assert bounds["weights_max_bytes"] >= 4 * 15 * GiB


def test_nats_resources_follow_the_charts_advice_and_spread_over_zones():
    container = NATS_VALUES["container"]
    res = container["resources"]
    assert res["requests"] == res["limits"]
    limit = _size(res["limits"]["memory"])
    assert limit >= 8 * GiB and float(res["limits"]["cpu"]) >= 2
    gomemlimit = _size(container["env"]["GOMEMLIMIT"].replace("GiB", "Gi"))
    assert 0.7 * limit <= gomemlimit <= 0.9 * limit
    spread = NATS_VALUES["podTemplate"]["topologySpreadConstraints"]
    assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= set(spread)
    assert NATS_VALUES["promExporter"]["enabled"] is True


def test_prometheus_alerts_watch_the_store_and_the_lag():
    rules = yaml.safe_load((ROOT / "ops" / "prometheus" / "alerts.yml").read_text())
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    assert "nats_varz_jetstream_stats_storage" in exprs and "nats_consumer_num_pending" in exprs


def test_the_chart_version_is_pinned_wherever_it_is_installed():
    for path in (
        K8S / "kustomization.yaml",
        K8S / "nats-values.yaml",
        ROOT / "docs" / "operations.md",
    ):
        for line in re.findall(r"helm install nats nats/nats[^\n`]*", path.read_text()):
            assert "--version 1." in line, f"{path.name}: {line}"


# ---- hardened pods ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "pod"), pods(), ids=[w for w, _ in pods()])
def test_every_pod_meets_the_restricted_pod_security_standard(where, pod):
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, where
    assert sc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost"), where
    for c in pod.get("initContainers", []) + pod["containers"]:
        csc = c["securityContext"]
        name = f"{where}:{c['name']}"
        assert csc["allowPrivilegeEscalation"] is False, name
        assert csc["capabilities"]["drop"] == ["ALL"], name
        assert csc["readOnlyRootFilesystem"] is True, name
        assert c["resources"]["requests"] and c["resources"]["limits"], name
        assert ":latest" not in c["image"], name
    assert not pod.get("hostNetwork") and not pod.get("hostPID"), where


def test_sglang_has_requests_liveness_a_pdb_and_a_shared_read_only_model():
    deploy = find("Deployment", "sglang")
    pod = deploy["spec"]["template"]["spec"]
    sglang = next(c for c in pod["containers"] if c["name"] == "sglang")
    assert re.search(r":v\d+\.\d+", sglang["image"]), sglang["image"]
    assert {"cpu", "memory"} <= set(sglang["resources"]["requests"])
    assert sglang["livenessProbe"]["httpGet"]["path"] == "/health"
    pdb = find("PodDisruptionBudget", "sglang")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= deploy["spec"]["selector"]["matchLabels"].items()
    )
    assert deploy["spec"]["replicas"] >= 2  # a drain keeps one engine serving
    claim = find("PersistentVolumeClaim", "agentarium-models")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
    assert volumes["weights"]["emptyDir"]["sizeLimit"]


def test_the_sync_sidecar_never_gates_the_engines_readiness():
    for name in ("agentarium-engine", "sglang"):
        pod = find("Deployment", name)["spec"]["template"]["spec"]
        sync = next(c for c in pod["containers"] if c["name"] == "sync")
        assert "readinessProbe" not in sync and sync["livenessProbe"], name


def test_network_policies_admit_only_the_projects_pods_to_nats_and_the_engines():
    policies = {d["metadata"]["name"]: d["spec"] for _, d in DOCS if d["kind"] == "NetworkPolicy"}
    nats = policies["nats-clients-from-agentarium-only"]
    assert nats["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
    clients = next(r for r in nats["ingress"] if {"protocol": "TCP", "port": 4222} in r["ports"])
    assert clients["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "agentarium"}}}
    ]
    engines = policies["engines-from-agentarium-only"]
    [expr] = engines["podSelector"]["matchExpressions"]
    assert set(expr["values"]) == {"agentarium-engine", "sglang"}
    for _, d in DOCS:  # every pod the policies admit carries the label
        if d["kind"] == "Deployment":
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/part-of"] == "agentarium", d["metadata"]["name"]


# ---- NATS: auth and TLS in the Helm values ---------------------------------------------------------

CONFIG = find("ConfigMap", "agentarium-config")["data"]
HELM_USERS = NATS_VALUES["config"]["merge"]["authorization"]["users"]
VARIABLE = re.compile(r"<< \$([A-Z_]+) >>")


def auth_conf_users() -> dict[str, tuple[str, dict]]:
    """auth.conf's users: name -> (password variable, the role's permissions)."""
    from natsconf import parse

    auth = parse((ROOT / "ops" / "nats" / "auth.conf").read_text())["authorization"]
    return {
        u["user"]: (u["password"].removeprefix("$"), auth[u["permissions"].removeprefix("$")])
        for u in auth["users"]
    }


def _normal(permissions: dict) -> dict:
    """Both files' permissions alike: YAML's booleans as the text nats-server reads."""
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in permissions.items()}


def test_every_role_of_auth_conf_is_a_helm_user_with_the_same_permissions():
    conf = auth_conf_users()
    helm = {u["user"]: u for u in HELM_USERS}
    assert set(helm) == set(conf), "the Helm values and ops/nats/auth.conf name other users"
    for name, (variable, permissions) in conf.items():
        assert _normal(helm[name]["permissions"]) == _normal(permissions), name
        assert VARIABLE.fullmatch(helm[name]["password"]).group(1) == variable, name
    # the consumer's requeue of a released job (a release spends no delivery)
    assert "agentarium.tasks.>" in helm["consumer"]["permissions"]["publish"]["allow"]


def test_no_secret_in_the_helm_values_each_password_comes_from_a_required_secret():
    env = NATS_VALUES["container"]["env"]
    for user in HELM_USERS:
        variable = VARIABLE.fullmatch(user["password"]).group(1)  # a variable, never a value
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"agentarium-nats-{user['user']}", "key": "password"}, variable
        assert not ref.get("optional", False)

    def secrets(node, path=""):  # every value under a key that names a credential
        if isinstance(node, dict):
            for key, value in node.items():
                where = f"{path}.{key}"
                if re.search(r"password|token|secret|nkey|creds", key, re.IGNORECASE) and not (
                    isinstance(value, dict) or key == "secretName"
                ):
                    yield where, value
                yield from secrets(value, where)
        elif isinstance(node, list):
            for i, item in enumerate(node):
                yield from secrets(item, f"{path}[{i}]")

    found = list(secrets(NATS_VALUES))
    assert len(found) >= len(HELM_USERS)
    for where, value in found:
        assert isinstance(value, str) and VARIABLE.fullmatch(value), f"{where}: not a variable"
    for variable, value in env.items():  # from Secrets, or no credential at all
        assert "valueFrom" in value or not re.search("PASSWORD|TOKEN", variable), variable
    # the Agentarium pods log in with the same Secrets (test_deploy_files checks each role)
    assert "PASSWORD" not in "".join(CONFIG)


def test_tls_on_the_client_and_route_listeners_with_the_ca_the_pods_trust():
    config = NATS_VALUES["config"]
    clients, routes = config["nats"]["tls"], config["cluster"]["tls"]
    assert clients["enabled"] is True and routes["enabled"] is True
    assert clients["secretName"] == routes["secretName"] == "nats-server-tls"
    assert routes["merge"]["verify"] is True  # routes authenticate each other (mutual TLS)
    ca = NATS_VALUES["tlsCA"]
    assert ca["enabled"] is True and ca["secretName"] == "nats-server-tls" and ca["key"] == "ca.crt"
    # cert-manager makes that Secret, for the names clients and routes dial
    cert = find("Certificate", "nats-server-tls")["spec"]
    assert cert["secretName"] == "nats-server-tls"
    assert {"server auth", "client auth"} <= set(cert["usages"])
    url = CONFIG["AGENTARIUM_NATS_URL"]
    assert url.startswith("tls://")
    assert url.removeprefix("tls://").split(":")[0] in cert["dnsNames"]
    assert "*.nats-headless" in cert["dnsNames"]  # the chart's route URLs: nats-<i>.nats-headless
    issuer = find("Issuer", cert["issuerRef"]["name"])["spec"]
    assert find("Certificate", issuer["ca"]["secretName"])["spec"]["isCA"] is True
    # every Agentarium container mounts the CA file the config names, and only that file
    ca_file = Path(CONFIG["AGENTARIUM_NATS_TLS_CA"])
    for where, pod in pods():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c["image"] != "agentarium":
                continue
            [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == str(ca_file.parent)]
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == "nats-server-tls", where
            assert secret["items"] == [{"key": "ca.crt", "path": ca_file.name}], where


def test_tls_settings_are_what_the_cli_reads():
    from agentarium.broker import NatsSettings

    settings = NatsSettings.from_env(
        {k: v for k, v in CONFIG.items() if k.startswith("AGENTARIUM_NATS_")}
    )
    assert settings.tls_ca == CONFIG["AGENTARIUM_NATS_TLS_CA"]


# ---- broker init: re-run by `kubectl apply` --------------------------------------------------------


def test_broker_init_is_rerun_by_apply_and_holds_the_only_admin_credential():
    kinds = {d["kind"] for _, d in DOCS}
    assert "Job" not in kinds, "a Job's template is immutable: apply cannot change its flags"
    deploy = find("Deployment", "agentarium-broker-init")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    init = broker_init()
    assert init["args"][:2] == ["broker", "init"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in init["env"] if "valueFrom" in e}
    assert refs == {"agentarium-nats-admin"}
    [hold] = deploy["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"registry\.k8s\.io/pause:\d+\.\d+", hold["image"])
    assert "ttlSecondsAfterFinished" not in str(deploy)
    # no service pod holds the admin role
    for where, pod in pods():
        if where.endswith(":agentarium-broker-init"):
            continue
        assert "agentarium-nats-admin" not in str(pod), where
    assert (
        "broker-init.yaml" in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    )


# ---- pinned images ---------------------------------------------------------------------------------


def _project_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _tag(image: str) -> str | None:
    if "@sha256:" in image:
        return "digest"
    name = image.rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else None


def test_no_image_floats_in_compose_or_kubernetes():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    images = {}
    for name, service in compose["services"].items():
        image = service["image"]
        # ${VAR:-default}: the default is what runs unless the user names another
        m = re.fullmatch(r"\$\{[A-Z_]+:-([^}]+)\}", image)
        images[f"docker-compose.yml:{name}"] = m.group(1) if m else image
    kustomize = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    retag = {i["name"]: i["newTag"] for i in kustomize["images"]}
    for where, pod in pods():
        for c in pod.get("initContainers", []) + pod["containers"]:
            image = c["image"]
            if image in retag:  # kustomize writes the tag
                image = f"{image}:{retag[image]}"
            images[f"{where}:{c['name']}"] = image
    for where, image in images.items():
        assert "$" not in image, f"{where}: {image}"
        tag = _tag(image)
        assert tag not in (None, "latest"), f"{where}: {image} floats"
    version = _project_version()
    assert retag["agentarium"] == version
    assert images["docker-compose.yml:consumer"] == f"agentarium:{version}"
    sglang = next(
        c["image"]
        for c in find("Deployment", "sglang")["spec"]["template"]["spec"]["containers"]
        if c["name"] == "sglang"
    )
    assert images["docker-compose.yml:sglang"] == sglang.split()[0]
