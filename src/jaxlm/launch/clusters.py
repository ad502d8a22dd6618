"""`jaxlm launch --scheduler slurm|kubernetes|tpu-vm`: what a cluster's scheduler needs to run one jaxlm command
on many hosts as one JAX job (docs/scaling.md has a worked example of each).

- slurm: an sbatch script (`slurm_script`) whose `srun` starts one process per task, each told the coordinator in
  JAXLM_COORDINATOR (distributed.py); the job is requeued, within a budget, when a task fails or the run stopped
  for Slurm's preemption signal, and the rerun resumes from the run directory's last complete checkpoint.
- kubernetes: an indexed Job with a headless Service, so that pod 0 is reachable as NAME-0.NAME
  (`kubernetes_manifest`); a failed container restarts in its pod and the job resumes.
- tpu-vm: the `gcloud compute tpus tpu-vm` command lines that create a slice, copy this tree to every worker,
  install it and run the command on all (`tpu_vm_commands`); JAX finds the coordinator from the TPU metadata.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from jaxlm.config import ConfigError
from jaxlm.launch.topology import tpu_slice

SCHEDULERS = ("local", "slurm", "kubernetes", "tpu-vm")
COORDINATOR_PORT = 8476  # the coordinator's port in a pod or on TPU worker 0 (JAX's default on Cloud TPU)


def _command(command: list[str], python: str | None = None) -> str:
    return shlex.join([python or sys.executable, "-m", "jaxlm.cli", *command])


# ---- Slurm -----------------------------------------------------------------------------------------------------

def slurm_script(command: list[str], nodes: int, tasks_per_node: int = 1, gpus_per_task: int | None = None,
                 devices_per_process: int | None = None, time: str | None = None, partition: str | None = None,
                 account: str | None = None, job_name: str = "jaxlm", requeues: int = 3, signal_seconds: int = 300,
                 output_dir: str | Path = "slurm", workdir: str | Path | None = None,
                 extra: list[str] | None = None) -> str:
    """The sbatch script that runs `jaxlm <command>` in nodes x tasks_per_node processes.

    The interpreter is this one (sys.executable): the same path must work on every node (a shared filesystem,
    as the run directory needs one too, or the same image). The submitting shell's environment goes with the
    job (sbatch's default), so settings such as XLA_FLAGS reach the tasks."""
    if nodes < 1 or tasks_per_node < 1:
        raise ConfigError(f"--nodes {nodes} and --tasks-per-node {tasks_per_node} must be >= 1")
    if requeues < 0 or signal_seconds < 0:
        raise ConfigError("--requeues and --signal-seconds must be >= 0")
    out = Path(output_dir).absolute()
    lines = ["#!/bin/bash", f"# Written by `jaxlm launch --scheduler slurm` for: jaxlm {shlex.join(command)}",
             f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={tasks_per_node}"]
    if gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={gpus_per_task}")
    for flag, value in (("time", time), ("partition", partition), ("account", account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    # --requeue: Slurm itself requeues the job when a node fails; --signal: SIGTERM to every task this long before
    # the time limit, which saves a checkpoint at one agreed step (distributed.Preemption).
    lines += ["#SBATCH --requeue", f"#SBATCH --signal=TERM@{signal_seconds}",
              f"#SBATCH --output={out}/%x-%j.out", "#SBATCH --open-mode=append",
              f"#SBATCH --chdir={Path(workdir or os.getcwd()).absolute()}"]
    lines += [f"#SBATCH {e}" for e in extra or []]
    lines += ["", "export PYTHONUNBUFFERED=1"]
    if devices_per_process:  # fake CPU devices, for testing multi-node runs on CPUs
        lines += ["export JAX_PLATFORMS=cpu",
                  "flags=$(echo \"${XLA_FLAGS:-}\" | sed 's/--xla_force_host_platform_device_count=[0-9]*//')",
                  f'export XLA_FLAGS="$flags --xla_force_host_platform_device_count={devices_per_process}"']
    python = shlex.quote(sys.executable)
    lines += [
        "# The coordinator: the first node, as Slurm reaches it, on a port free there (this script runs on it).",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'addr=$(scontrol show node "$head" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
        f"port=$({python} -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])')",
        'export JAXLM_COORDINATOR="${addr:-$head}:$port"',
        f'export JAXLM_PREEMPTED_FILE="{out}/.preempted-$SLURM_JOB_ID"',
        'rm -f "$JAXLM_PREEMPTED_FILE"',
        'echo "jaxlm: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, coordinator '
        '$JAXLM_COORDINATOR"',
        "",
        "# --kill-on-bad-exit: a task that fails ends the others (they would wait for it in a collective).",
        f"srun --kill-on-bad-exit=1 {_command(command, sys.executable)}",
        "status=$?",
        'if [ -e "$JAXLM_PREEMPTED_FILE" ]; then',
        '  why="stopped for preemption after step $(cat "$JAXLM_PREEMPTED_FILE") (its checkpoint is saved)"',
        'elif [ "$status" -ne 0 ]; then',
        '  why="failed with status $status"',
        "else",
        '  echo "jaxlm: finished"; exit 0',
        "fi",
        'rm -f "$JAXLM_PREEMPTED_FILE"',
        f'if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {requeues} ]; then',
        f'  echo "jaxlm: $why; requeueing job $SLURM_JOB_ID (restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of '
        f'{requeues}); the rerun resumes from the last checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID" && exec sleep 600  # Slurm ends this script as it requeues the job',
        "fi",
        f'echo "jaxlm: $why; no requeue left ({requeues} allowed): sbatch this script again to resume"',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def submit_slurm(script: str, output_dir: str | Path, job_name: str = "jaxlm") -> tuple[Path, str]:
    """Write the script beside the job's output and sbatch it: (script path, job id)."""
    out = Path(output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{job_name}.sbatch"
    path.write_text(script)
    try:
        p = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError(f"sbatch is not on PATH; submit {path} from a Slurm login node, or run "
                          "`jaxlm launch --scheduler slurm --dry-run` there") from None
    if p.returncode != 0:
        reason = (p.stderr.strip() or p.stdout.strip() or f"exit status {p.returncode}").splitlines()[-1]
        raise ConfigError(f"sbatch {path} failed: {reason}")
    return path, p.stdout.strip().split(";")[0]


# ---- Kubernetes ------------------------------------------------------------------------------------------------

def kubernetes_manifest(command: list[str], name: str, image: str, hosts: int, gpus_per_host: int | None = None,
                        topology: str | None = None, requeues: int = 3, port: int = COORDINATOR_PORT,
                        jaxlm: str = "jaxlm") -> list[dict]:
    """A headless Service and an indexed Job of `hosts` pods, pod i running process i of the job.

    Pod i's hostname is NAME-i in the Service's subdomain, so the coordinator is NAME-0.NAME:port; the process id
    is the pod's completion index (an annotation the Job controller sets). A container that fails restarts in its
    pod (restartPolicy OnFailure); the others then stop on the lost peer and restart too, and the job resumes from
    its last checkpoint, up to `requeues` times each (backoffLimit counts every pod's restarts). With `topology`
    (a TPU slice such as v5e-256) it asks GKE for a TPU node pool of that slice, one pod per worker."""
    if hosts < 1:
        raise ConfigError(f"--nodes {hosts} must be >= 1")
    resources: dict = {}
    node_selector: dict = {}
    if topology:
        s = tpu_slice(topology)
        if hosts != s.workers:
            raise ConfigError(f"{s.name} has {s.workers} workers (jaxlm describe {s.name}); use --nodes {s.workers}")
        resources = {"limits": {"google.com/tpu": s.chips_per_worker}}
        accelerator = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice", "v5e": "tpu-v5-lite-podslice",
                       "v6e": "tpu-v6e-slice"}[s.generation]
        node_selector = {"cloud.google.com/gke-tpu-accelerator": accelerator,
                         "cloud.google.com/gke-tpu-topology": "x".join(map(str, s.grid))}
    elif gpus_per_host:
        resources = {"limits": {"nvidia.com/gpu": gpus_per_host}}
    labels = {"app.kubernetes.io/name": "jaxlm", "jaxlm.job": name}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "selector": {"jaxlm.job": name},
                        "ports": [{"name": "coordinator", "port": port, "targetPort": port}]}}
    env = [{"name": "JAXLM_COORDINATOR", "value": f"{name}-0.{name}:{port}"},
           {"name": "JAXLM_NUM_PROCESSES", "value": str(hosts)},
           {"name": "JAXLM_PROCESS_ID", "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    container = {"name": "jaxlm", "image": image, "command": [jaxlm, *command], "env": env,
                 "ports": [{"name": "coordinator", "containerPort": port}]}
    if resources:
        container["resources"] = resources
    pod = {"subdomain": name, "restartPolicy": "OnFailure", "containers": [container]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
           "spec": {"completionMode": "Indexed", "completions": hosts, "parallelism": hosts,
                    "backoffLimit": requeues * hosts,
                    "template": {"metadata": {"labels": labels}, "spec": pod}}}
    return [service, job]


def apply_kubernetes(manifest: str) -> int:
    try:
        return subprocess.run(["kubectl", "apply", "-f", "-"], input=manifest, text=True).returncode
    except FileNotFoundError:
        raise ConfigError("kubectl is not on PATH; save the manifest (`--dry-run > job.yaml`) and apply it where "
                          "kubectl reaches the cluster") from None


# ---- TPU VMs ---------------------------------------------------------------------------------------------------

def source_tree() -> Path:
    """The folder of this jaxlm checkout (pyproject.toml beside src/), copied to every TPU worker."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(f"jaxlm is installed from a package, not a source tree ({root}); run `jaxlm launch "
                          "--scheduler tpu-vm` from a checkout of jaxlm")
    return root


def tpu_vm_commands(command: list[str], tpu: str, topology: str, zone: str, project: str | None = None,
                    source: Path | None = None) -> dict[str, list[list[str]]]:
    """{'create': [...], 'setup': [...], 'run': [...]}: the gcloud command lines (each a list of arguments) for a
    run on the TPU VM slice `tpu`; `run` reaches every worker (--worker=all), one process each, and JAX reads the
    coordinator, process count and index from the TPU metadata (distributed.auto=true)."""
    s = tpu_slice(topology)
    where = [f"--zone={zone}"] + ([f"--project={project}"] if project else [])
    tpu_vm = ["gcloud", "compute", "tpus", "tpu-vm"]
    source = source or source_tree()
    train = ["cd", "jaxlm", "&&", ".venv/bin/jaxlm", *command]
    if command[:1] == ["train"] and not any(a.startswith("distributed.") for a in command):
        train.append("distributed.auto=true")
    return {
        "create": [[*tpu_vm, "create", tpu, *where, f"--accelerator-type={s.accelerator_type}",
                    f"--version={s.runtime_version}"]],
        "setup": [[*tpu_vm, "scp", "--recurse", str(source), f"{tpu}:~/jaxlm", "--worker=all", *where],
                  [*tpu_vm, "ssh", tpu, "--worker=all", *where,
                   "--command=cd jaxlm && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"]],
        "run": [[*tpu_vm, "ssh", tpu, "--worker=all", *where,
                 "--command=" + " ".join(a if a == "&&" else shlex.quote(a) for a in train)]],
    }


def tpu_vm_text(commands: dict[str, list[list[str]]], topology: str) -> str:
    """The command lines as a shell script, headed by the slice they are for."""
    s = tpu_slice(topology)
    lines = [f"# {s.name} ({s.accelerator_type}): {s.workers} workers x {s.chips_per_worker} chips = {s.chips} chips "
             f"(jaxlm describe {s.name}); one process per worker. The run directory must be one every worker sees "
             "(gs://bucket/..., or a mounted filesystem)."]
    for step, command_lines in commands.items():
        lines.append(f"# {step}")
        lines += [shlex.join(args) for args in command_lines]
    return "\n".join(lines) + "\n"
