"""`jaxlm launch --scheduler kubernetes|tpu-vm` and `jaxlm describe`: the Kubernetes manifest validates offline
against Kubernetes' own schemas (kubernetes-validate ships them) and gives each pod the process settings of its
index; the TPU VM command lines for a slice agree with what `jaxlm describe` says of it. (Slurm: test_slurm.py.)"""

import contextlib
import io
import re
import shlex
import subprocess

import pytest
import yaml

from jaxlm import cli
from jaxlm.launch import distributed, topology
from jaxlm.config import ConfigError, DistributedConfig

KUBERNETES = "1.33.0"  # the API version validated against (GKE's regular channel in 2026)


def jaxlm(*args: str) -> subprocess.CompletedProcess:
    """`jaxlm ARGS` in this process (the commands here only print): its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def pod_environment(container: dict, pod: dict, index: int) -> dict:
    """A container's environment as Kubernetes gives it to the pod of one completion index: the Job controller
    annotates the pod with its index (and sets JOB_COMPLETION_INDEX); fieldRefs read the pod's metadata."""
    meta = {"metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
            "metadata.name": f"{pod['name']}-{index}-x7k2p"}
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{pod['name']}-{index}"}
    for e in container["env"]:
        env[e["name"]] = e["value"] if "value" in e else meta[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_kubernetes_manifest_validates_and_gives_each_pod_its_process(tmp_path):
    import kubernetes_validate

    p = jaxlm("launch", "--scheduler", "kubernetes", "--nodes", "4", "--gpus-per-process", "8", "--name", "owt",
              "--image", "ghcr.io/me/jaxlm:1", "--", "train", "openwebtext", "run_dir=gs://bucket/owt")
    assert p.returncode == 0, p.stderr
    docs = list(yaml.safe_load_all(p.stdout))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for d in docs:  # strict: an unknown or misspelt field fails too
        kubernetes_validate.validate(d, KUBERNETES, strict=True)
    service, job = docs
    assert service["spec"]["clusterIP"] == "None"  # headless: each pod gets a DNS name
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    pod = spec["template"]["spec"]
    # The Service selects the Job's pods, and names the pods' subdomain: pod i is owt-i.owt.
    assert all(spec["template"]["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
    assert pod["subdomain"] == service["metadata"]["name"] == "owt"
    (container,) = pod["containers"]
    assert container["command"] == ["jaxlm", "train", "openwebtext", "run_dir=gs://bucket/owt"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    port = service["spec"]["ports"][0]["port"]
    assert container["ports"][0]["containerPort"] == port
    seen = set()
    for i in range(4):
        env = pod_environment(container, {"name": job["metadata"]["name"]}, i)
        args = distributed.settings(DistributedConfig(), env)
        assert args == {"coordinator_address": f"owt-0.owt:{port}", "num_processes": 4, "process_id": i}
        seen.add(args["process_id"])
    assert seen == {0, 1, 2, 3}

    # A mistake in what the manifest would hold is caught by the same validation.
    for broken in (dict(spec, completions="4"), dict(spec, completion=4),
                   dict(spec, template={"spec": dict(pod, containers=[dict(container, env={"A": "1"})])})):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(dict(job, spec=broken), KUBERNETES, strict=True)


def test_kubernetes_manifest_for_a_tpu_slice_on_gke():
    import kubernetes_validate

    p = jaxlm("launch", "--scheduler", "kubernetes", "--topology", "v5e-256", "--image", "img", "--", "train",
              "openwebtext")
    assert p.returncode == 0, p.stderr
    service, job = yaml.safe_load_all(p.stdout)
    kubernetes_validate.validate(job, KUBERNETES, strict=True)
    s = topology.tpu_slice("v5e-256")
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completions"] == s.workers == 64
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": s.chips_per_worker} == {"google.com/tpu": 4}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "16x16"}
    p = jaxlm("launch", "--scheduler", "kubernetes", "--topology", "v5e-256", "--nodes", "8", "--image", "img", "--",
              "train", "openwebtext")
    assert p.returncode == 2 and p.stderr.strip() == "error: v5e-256 has 64 workers (jaxlm describe v5e-256); use --nodes 64"


def describe(name: str) -> dict:
    p = jaxlm("describe", name)
    assert p.returncode == 0, p.stderr
    return dict(line.split(" ", 1) for line in p.stdout.splitlines())


def test_describe_slices():
    # Cloud TPU's published shapes: v5e-256 is 64 VMs of 4 chips (16x16); v5litepod-8 and v6e-8 are one 8-chip VM;
    # v4 and v5p names count TensorCores (2 per chip), their VMs hold 4 chips.
    expected = {"v5e-256": (256, "16x16", 64, 4, "v5litepod-256"), "v5e-8": (8, "2x4", 1, 8, "v5litepod-8"),
                "v5e-16": (16, "4x4", 4, 4, "v5litepod-16"), "v6e-8": (8, "2x4", 1, 8, "v6e-8"),
                "v4-8": (4, "2x2x1", 1, 4, "v4-8"), "v4-32": (16, "2x2x4", 4, 4, "v4-32"),
                "v5p-128": (64, "4x4x4", 16, 4, "v5p-128")}
    for name, (chips, grid, workers, per_worker, accelerator) in expected.items():
        d = describe(name)
        assert d["slice"].startswith(f"{name}: {chips} chips ({grid})"), d
        assert (int(d["workers"]), int(d["chips_per_worker"]), d["accelerator_type"]) == (workers, per_worker,
                                                                                            accelerator)
    p = jaxlm("describe", "v5e-24")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "a power of two" in p.stderr
    with pytest.raises(ConfigError, match="not a TPU slice jaxlm knows"):
        topology.tpu_slice("v9x-8")


def test_tpu_vm_command_lines_match_describe(tmp_path):
    d = describe("v5e-256")
    p = jaxlm("launch", "--scheduler", "tpu-vm", "--topology", "v5e-256", "--name", "my-tpu", "--zone", "us-west4-a",
              "--project", "proj", "--", "train", "openwebtext", "run_dir=gs://bucket/owt", "mesh.ici_fsdp=-1")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert re.match(rf"# v5e-256 \(v5litepod-256\): {d['workers']} workers x {d['chips_per_worker']} chips = 256 chips",
                    lines[0])
    commands = [shlex.split(line) for line in lines if not line.startswith("#")]
    create, scp, install, run = commands
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"] and create[5] == "my-tpu"
    assert f"--accelerator-type={d['accelerator_type']}" in create
    assert f"--version={d['runtime_version']}" in create
    for c in (create, scp, install, run):
        assert "--zone=us-west4-a" in c and "--project=proj" in c
    for c in (scp, install, run):  # every one of the 64 workers
        assert "--worker=all" in c
    assert scp[4] == "scp" and scp[scp.index("--recurse") + 2] == "my-tpu:~/jaxlm"
    (remote,) = [a[len("--command="):] for a in run if a.startswith("--command=")]
    assert remote == ("cd jaxlm && .venv/bin/jaxlm train openwebtext run_dir=gs://bucket/owt mesh.ici_fsdp=-1 "
                      "distributed.auto=true")
    # One process per worker, all of whose chips it drives: what the run will see (jax.process_count() = 64,
    # 4 local devices each, 256 in all).
    assert d["processes"] == "64 (one per worker, each with 4 local devices)"
    p = jaxlm("launch", "--scheduler", "tpu-vm", "--topology", "v5e-256", "--", "train", "openwebtext")
    assert p.returncode == 2 and "--zone ZONE" in p.stderr
