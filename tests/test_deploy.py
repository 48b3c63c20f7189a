"""deploy/ is validated by the tools that run here (no Docker engine does): hadolint for the
Dockerfile, the Compose Specification schema for compose.yaml, kubernetes-validate (Kubernetes
1.37 schemas) for every manifest, systemd-analyze for the unit, plistlib for the launchd agent,
promtool for the alert rules, and the Grafana dashboard's queries against the metrics the
server really exports. Each check also rejects a broken copy, so it can fail."""

from __future__ import annotations

import json
import plistlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from .conftest import ROOT

DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def _run(*args, cwd=ROOT):
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True)


def test_dockerfile_passes_hadolint(tmp_path):
    hadolint = BIN / "hadolint"
    out = _run(hadolint, "--config", DEPLOY / ".hadolint.yaml", DEPLOY / "Dockerfile")
    assert out.returncode == 0, out.stdout + out.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text((DEPLOY / "Dockerfile").read_text().replace("USER 10001:10001", "USER root"))
    assert _run(hadolint, "--config", DEPLOY / ".hadolint.yaml", broken).returncode != 0
    text = (DEPLOY / "Dockerfile").read_text()
    assert "HEALTHCHECK" in text and "/health" in text and text.count("FROM ") >= 2
    assert "VOLUME [\"/cache\"]" in text and "MLX_EXTRA" in text
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):  # what the image copies exists
        assert (ROOT / src).exists(), src


def test_compose_file_is_valid_and_complete():
    schema = json.loads((ROOT / "tests" / "fixtures" / "compose_spec.json").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    validator.validate(compose)
    services = compose["services"]
    assert {"quantize", "mixbit", "prometheus", "grafana"} <= set(services)
    assert services["mixbit"]["depends_on"]["quantize"]["condition"] == "service_completed_successfully"
    assert services["quantize"]["command"][0] == "quantize"
    for svc in services.values():  # every file mounted from the repository exists
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), src
    broken = dict(compose, services={"mixbit": {"image": "x", "ports": {"not": "a list"}}})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def test_kubernetes_manifests_validate(tmp_path):
    kv = BIN / "kubernetes-validate"
    kustom = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = [DEPLOY / "k8s" / f for f in kustom["resources"]] + [DEPLOY / "k8s" / "prometheus-adapter-rules.yaml"]
    kinds = set()
    for f in files:
        out = _run(kv, "--strict", f)
        assert out.returncode == 0, out.stdout + out.stderr
        kinds |= {d["kind"] for d in yaml.safe_load_all(f.read_text()) if d}
    assert {"Job", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "PersistentVolumeClaim", "Secret"} <= kinds
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["enableServiceLinks"] is False  # no MIXBIT_SERVICE_* variables injected
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert any(m["mountPath"] == "/cache" and m.get("readOnly") for m in c["volumeMounts"])
    config = (DEPLOY / "k8s" / "configmap.yaml").read_text()
    grace = float(re.search(r"shutdown_grace_s = (\d+)", config).group(1))
    assert pod["terminationGracePeriodSeconds"] > grace  # the drain fits in the pod's grace
    broken = tmp_path / "deployment.yaml"
    broken.write_text((DEPLOY / "k8s" / "deployment.yaml").read_text().replace("replicas: 2", "replicas: two"))
    assert _run(kv, "--strict", broken).returncode != 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "mixbit.service").read_text()
    # verify checks that ExecStart exists: point it at this checkout's mixbit, run as root here
    local = unit.replace("/opt/mixbit/bin/mixbit", str(BIN / "mixbit"))
    local = re.sub(r"^(User|Group)=.*$", r"\1=root", local, flags=re.M)
    (tmp_path / "mixbit.service").write_text(local)
    out = _run("systemd-analyze", "verify", tmp_path / "mixbit.service")
    assert out.returncode == 0, out.stdout + out.stderr
    (tmp_path / "broken.service").write_text(local.replace("ExecStart=/", "ExecStart=relative/"))
    assert _run("systemd-analyze", "verify", tmp_path / "broken.service").returncode != 0


def test_launchd_plist_parses():
    plist = plistlib.loads((DEPLOY / "launchd" / "ai.mixbit.serve.plist").read_bytes())
    assert plist["Label"] == "ai.mixbit.serve"
    assert plist["ProgramArguments"][1:3] == ["serve", "--config"]
    assert plist["KeepAlive"] == {"SuccessfulExit": False}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool: `make test` installs prometheus")
def test_alert_rules_pass_promtool(tmp_path):
    out = _run("promtool", "check", "rules", DEPLOY / "prometheus" / "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    broken = tmp_path / "alerts.yml"
    broken.write_text((DEPLOY / "prometheus" / "alerts.yml").read_text().replace("> 0.05", "> > 0.05"))
    assert _run("promtool", "check", "rules", broken).returncode != 0


def _exported_names() -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    from mixbit.server.app import ServerState
    from mixbit.server.metrics import Metrics, spec_families
    from mixbit.server.settings import Settings

    m = Metrics(ServerState(settings=Settings()))
    m.requests.labels("/v1/chat/completions", "200").inc()  # make labelled families visible
    names = set()
    for fam in text_string_to_metric_families(m.render().decode()):
        names.add(fam.name)
        names |= {s.name for s in fam.samples}
    for counter in ("mixbit_tool_call_outcomes", "mixbit_constrained_output_invalid", "mixbit_fidelity_checks",
                    "mixbit_fidelity_tokens", "mixbit_fidelity_flips", "mixbit_fidelity_dropped",
                    "mixbit_grammar_requests", "mixbit_generation_tokens", "mixbit_prompt_tokens",
                    "mixbit_cached_prompt_tokens"):
        names.add(counter + "_total")
    for hist in ("mixbit_fidelity_kld", "mixbit_fidelity_top1_agreement", "mixbit_fidelity_first_divergence_position",
                 "mixbit_time_to_first_token_seconds", "mixbit_inter_token_latency_seconds",
                 "mixbit_request_duration_seconds", "mixbit_grammar_compile_seconds"):
        names |= {hist + s for s in ("_bucket", "_sum", "_count")}
    names |= {"mixbit_fidelity_queue_depth", "mixbit_variant_info"}
    # the MTP counters come per served variant (tests/test_speculative.py scrapes them from a server)
    names |= {fam.name + "_total" for fam in spec_families([])}
    return names


def test_dashboard_and_alerts_only_query_metrics_the_server_exports():
    exported = _exported_names()
    dashboard = json.loads((DEPLOY / "grafana" / "mixbit-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {name for e in exprs for name in re.findall(r"\bmixbit_[a-z0-9_]+", e)}
    assert used and used <= exported, used - exported
    assert len(dashboard["panels"]) >= 10
