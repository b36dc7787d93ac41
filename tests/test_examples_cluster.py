"""The cluster examples run as written, on simulated hosts (``hosts_harness``): the Slurm batch
script with a fake ``srun`` and ``scontrol`` (``fake_slurm.py``) that start its per-node command
in every host's namespace, and the Kubernetes Job's pods rendered from its manifests, each
pod's command run in a host of its own. Both end bit for bit where one launcher's run ends."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import yaml

from xmig.launch.hosts import NETNS_DIR

from helpers import DEMO, REPO, assert_all_gone, fault_free_sha256
from hosts_harness import (
    SECRET,
    Hosts,
    hosts_fixture,  # noqa: F401 - the fixture `hosts`
    needs_root,
)

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
KUBE = REPO / "examples" / "kubernetes"
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm.py"
STEPS = 4
# the training command a user gives (relative to the repository, as from its folder)
TRAIN = ["examples/train_gpt.py", "--steps", str(STEPS), "--quiet"]
# the same job from one launcher: 2 nodes of 1 rank
REFERENCE = ["--nnodes", "2", "--hot-spares", "0", str(DEMO), "--steps", str(STEPS), "--quiet"]
# the smaller cluster the tests run on (2 training hosts + 1 spare, 1 rank each, no hot spare:
# 2 cores); what a user would change for theirs
SMALL = {"train": 2, "spare": 1, "nproc": 1, "extra": "--hot-spares 0"}


def host_env(home: Path) -> dict[str, str]:
    """A simulated host's environment: this one's, without xmig's own variables, with its
    ``HOME`` and the venv's ``xmig`` on the PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XMIG_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["HOME"] = str(home)
    return env


def check_outcome(net: Hosts, names: list[str], summary_path: Path, reference: str) -> dict:
    """The job completed bit for bit as ``reference``, every host said its role and the
    outcome, and nothing of it is left."""
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS, summary["message"]
    assert summary["final_params_sha256"] == reference, "not bit-identical"
    for index, name in enumerate(names):
        role = "spare node" if index >= SMALL["train"] else "node"
        assert f"this host is {role} rank {index}" in net.output(name), net.output(name)
        assert f"completed: {STEPS} steps" in net.output(name), net.output(name)
    assert_all_gone(summary)
    for node in range(net.net.count):
        assert net.namespace_pids(node) == [], f"processes left on host {node}"
    return summary


# --- Slurm ---


def sbatch_options(text: str) -> dict[str, str | None]:
    """The ``#SBATCH`` options of a batch script (those before its first command, as sbatch
    reads them)."""
    options: dict[str, str | None] = {}
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            name, sep, value = line.split()[1].partition("=")
            options[name] = value if sep else None
    late = len(re.findall(r"^#SBATCH ", text, re.M)) - len(options)
    assert not late, f"{late} #SBATCH line(s) after the first command: sbatch ignores them"
    return options


def test_slurm_script_asks_one_task_per_node_with_spares_and_survives_a_lost_node():
    """4 + 1 nodes of one task, and no option of sbatch or srun left to end every node's task
    when one node is lost."""
    text = SBATCH.read_text()
    options = sbatch_options(text)
    spares = int(re.search(r"^SPARE_NODES=\$\{SPARE_NODES:-(\d+)\}", text, re.M)[1])
    assert int(options["--nodes"]) - spares == 4 and spares == 1, options
    assert options["--ntasks-per-node"] == "1" and "--no-kill" in options
    gpus = re.search(r"NPROC_PER_NODE:-\$\{SLURM_GPUS_ON_NODE:-(\d+)\}", text)[1]
    assert options["--gpus-per-node"] == gpus
    srun = re.search(r"^srun (.*?)bash -c", text, re.M | re.S)[1]
    assert "--kill-on-bad-exit=0" in srun and "--no-kill" in srun and "--wait=0" in srun
    command = text.split("NODE_COMMAND='", 1)[1].split("'", 1)[0]
    for needed in ('--node-rank "$SLURM_NODEID"', '--rdzv-id "$SLURM_JOB_ID"',
                   '--token-file "$SECRET_FILE"', '"$@"'):  # fmt: skip
        assert needed in command, needed
    assert "umask 077" in text and "openssl rand -hex 32" in text


@needs_root
def test_slurm_script_runs_a_launcher_per_node_on_simulated_hosts(
    hosts, tmp_path, tmp_path_factory
):
    """``bash train.sbatch SCRIPT ARGS`` in a faked allocation of 3 nodes (SPARE_NODES=1 by
    default): its srun line starts the per-node command on each host, as srun would."""
    reference = fault_free_sha256(REFERENCE, tmp_path_factory)
    net = hosts(3)
    bin_dir, logs, home = tmp_path / "bin", tmp_path / "slurm", tmp_path / "home"
    for folder in (bin_dir, logs, home):
        folder.mkdir()
    for tool in ("srun", "scontrol"):
        shim = bin_dir / tool
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                        f"{shlex.quote(str(FAKE_SLURM))} {tool} \"$@\"\n")  # fmt: skip
        shim.chmod(0o755)
    # the nodes are named by their addresses: the first one is the endpoint's host
    names = [net.net.address(node) for node in range(3)]
    nodes = [{"name": name, "netns": str(NETNS_DIR / net.net.namespace(node)),
              "env": net.net.environment(node)} for node, name in enumerate(names)]  # fmt: skip
    (tmp_path / "slurm.json").write_text(json.dumps({"nodes": nodes, "log_dir": str(logs)}))
    job_id = str(uuid.uuid4().int % 10**6)
    env = host_env(home)  # the $HOME every node shares
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "FAKE_SLURM": str(tmp_path / "slurm.json"),
                "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": "3",
                "SLURM_JOB_NODELIST": ",".join(names), "SLURM_SUBMIT_DIR": str(REPO),
                "SLURM_GPUS_ON_NODE": str(SMALL["nproc"]),
                "EXTRA_XMIG_ARGS": str(SMALL["extra"])})  # fmt: skip
    # the batch script runs on the allocation's first node
    net.spawn("sbatch", ["bash", str(SBATCH), *TRAIN], env, namespace=0)
    try:
        code = net.procs["sbatch"].wait(timeout=100)
    except subprocess.TimeoutExpired:
        code = "did not end in 100 s"
    for node in range(3):  # each node's output where the harness reads a host's
        found = logs / f"node{node}.log"
        (tmp_path / f"node{node}.log").write_text(found.read_text() if found.exists() else "")
    outputs = {n: net.output(n) for n in ("sbatch", "node0", "node1", "node2")}
    assert code == 0, outputs
    assert json.loads((logs / "codes.json").read_text()) == [0, 0, 0], outputs
    asked = json.loads((logs / "srun.json").read_text())
    assert asked["options"]["--kill-on-bad-exit"] == "0"
    assert asked["command"][:2] == ["bash", "-c"] and asked["command"][4:] == TRAIN

    run_dir = home / ".xmig" / "runs" / job_id
    summary = check_outcome(net, ["node0", "node1", "node2"], run_dir / "summary.json",
                            reference)  # fmt: skip
    assert summary["job_id"] == job_id
    # node 0's coordinator kept its event log in node 0's own jobs folder
    assert Path(summary["event_log"]) == run_dir / "node0" / job_id / "events.jsonl"
    secret = home / ".xmig" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", secret.read_text().strip())


# --- Kubernetes ---


def manifests() -> dict[str, dict]:
    """The example's manifests by kind."""
    found = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[doc["kind"]] = doc
    return found


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of an env value, command or argument: a defined VAR is
    replaced, ``$$`` is ``$``, anything else stays as it is."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            name = text[i + 2 : end]
            out.append(env.get(name, text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def field_ref(path: str, meta: dict) -> str:
    """A pod's field as the downward API gives it."""
    found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if found:
        return meta[found[1]][found[2]]
    assert path in ("metadata.name", "metadata.namespace", "metadata.uid"), path
    return meta[path.split(".", 1)[1]]


def container(job: dict) -> dict:
    (only,) = job["spec"]["template"]["spec"]["containers"]
    return only


def env_values(job: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(job)["env"] if "value" in e}


def sized(job: dict, train: int, spare: int, nproc: int, extra: str) -> dict:
    """The Job for ``train`` + ``spare`` pods of ``nproc`` ranks: what a user changes."""
    job = json.loads(json.dumps(job))
    job["spec"]["completions"] = job["spec"]["parallelism"] = train + spare
    values = {"TRAIN_PODS": train, "SPARE_PODS": spare, "NPROC_PER_NODE": nproc,
              "EXTRA_XMIG_ARGS": extra}  # fmt: skip
    for item in container(job)["env"]:
        if item["name"] in values:
            item["value"] = str(values.pop(item["name"]))
    assert not values, f"not in the Job's env: {values}"
    return job


def test_kubernetes_manifests_make_an_indexed_job_of_spare_pods_behind_a_headless_service():
    """The manifests fit together: index as node rank, pod 0 by name, the Secret as an
    owner-only file, no restart of a lost pod or of the Job."""
    kinds = manifests()
    job, service, secret = kinds["Job"], kinds["Service"], kinds["Secret"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    box, env = container(job), env_values(job)
    script = box["args"][0]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 5
    assert int(env["TRAIN_PODS"]) + int(env["SPARE_PODS"]) == 5 and env["SPARE_PODS"] == "1"
    # pod 0 reachable as <job>-0.<service>
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert env["RDZV_HOST"] == f"$(JOB_NAME)-0.{service['metadata']['name']}"
    port = service["spec"]["ports"][0]["port"]
    assert f'--rdzv-endpoint "$RDZV_HOST:{port}"' in script
    # no restart of a lost pod, none of the Job as a whole
    assert pod["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] == 0
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]
    assert rule["onExitCodes"]["containerName"] == box["name"]
    # the node rank, the job's id and the secret
    assert '--node-rank "$JOB_COMPLETION_INDEX"' in script and '--rdzv-id "$RDZV_ID"' in script
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in box["env"]
            if "valueFrom" in e}  # fmt: skip
    assert refs["RDZV_ID"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in box["volumeMounts"]}
    token_dir, key = env["TOKEN_FILE"].rsplit("/", 1)
    assert mounts[token_dir]["secret"]["defaultMode"] == 0o400
    assert mounts[token_dir]["secret"]["secretName"] == secret["metadata"]["name"]
    assert key in secret["stringData"] and '--token-file "$TOKEN_FILE"' in script
    assert len(secret["stringData"][key]) < 16, "a placeholder xmig would take"
    assert "kubectl create secret generic" in (KUBE / "secret.yaml").read_text()
    # a GPU per rank, a large /dev/shm, a shared checkpoint folder
    assert box["resources"]["limits"]["nvidia.com/gpu"] == int(env["NPROC_PER_NODE"])
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert env["RUN_DIR"].startswith("/checkpoints/")
    assert "persistentVolumeClaim" in mounts["/checkpoints"]
    assert '--checkpoint-dir "$RUN_DIR' in script
    # the script names no path of a volume itself: the test maps them through the env
    assert not [p for p in mounts if re.search(rf"(^|[\s\"'=]){re.escape(p)}", script)]


def render_pods(job: dict, secret: dict, address0: str, tmp_path: Path) -> list[dict]:
    """Every pod's command, environment and folder as Kubernetes would give them: the Job
    controller's index, labels and annotations; the env's ``$(VAR)`` and downward-API values;
    the volumes as folders (the Secret's keys as files of its ``defaultMode``, a claim shared by
    every pod); pod 0's DNS name as the address of host 0; the image's ``/workspace`` as this
    repository. The training command is the test's (``TRAIN``)."""
    name, uid = job["metadata"]["name"], str(uuid.uuid4())
    pod, box = job["spec"]["template"]["spec"], container(job)
    volumes = {v["name"]: v for v in pod["volumes"]}
    pod0 = f"{name}-0.{pod['subdomain']}"
    rendered = []
    for index in range(job["spec"]["completions"]):
        marks = {"batch.kubernetes.io/job-completion-index": str(index)}
        labels = {**job["spec"]["template"]["metadata"]["labels"], **marks,
                  "batch.kubernetes.io/job-name": name, "job-name": name,
                  "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid}  # fmt: skip
        meta = {"name": f"{name}-{index}-x{index}", "namespace": "default",
                "uid": str(uuid.uuid4()), "labels": labels, "annotations": marks}  # fmt: skip
        env = {"JOB_COMPLETION_INDEX": str(index)}  # the Job controller's, in Indexed mode
        for item in box["env"]:
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            else:
                env[item["name"]] = field_ref(item["valueFrom"]["fieldRef"]["fieldPath"], meta)
        folders = {}
        for mount in box["volumeMounts"]:
            volume = volumes[mount["name"]]
            folder = tmp_path / f"pod{index}" / "volumes" / mount["name"]
            if "persistentVolumeClaim" in volume:
                folder = tmp_path / "claims" / volume["persistentVolumeClaim"]["claimName"]
            folder.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                assert volume["secret"]["secretName"] == secret["metadata"]["name"]
                for key in secret["stringData"]:  # the test's secret, not the placeholder
                    (folder / key).write_text(SECRET)
                    (folder / key).chmod(volume["secret"]["defaultMode"])
            folders[mount["mountPath"]] = folder
        for var, value in env.items():
            assert "$(" not in value, f"{var}={value}: a reference Kubernetes leaves as it is"
            if value == pod0:
                env[var] = address0
            for path, folder in folders.items():
                if value == path or value.startswith(path + "/"):
                    env[var] = str(folder) + value[len(path) :]
        assert address0 in env.values(), f"no env value names pod 0 ({pod0})"
        args = [expand(arg, env) for arg in box["args"]]
        argv = [expand(word, env) for word in box["command"]] + args[:2] + TRAIN
        assert box["workingDir"] == "/workspace"
        home = tmp_path / f"pod{index}" / "home"  # the pod's own file system
        home.mkdir()
        rendered.append({"argv": argv, "env": {**host_env(home), "HOSTNAME": f"{name}-{index}",
                                               **env}, "uid": uid})  # fmt: skip
    return rendered


@needs_root
def test_kubernetes_pods_run_their_rendered_commands_on_simulated_hosts(
    hosts, tmp_path, tmp_path_factory
):
    """The Job resized to 2 + 1 pods; each pod's command, rendered from the manifests, runs
    in a host of its own, the spare and pod 1 before pod 0 (pods start in any order)."""
    reference = fault_free_sha256(REFERENCE, tmp_path_factory)
    kinds = manifests()
    job = sized(kinds["Job"], **SMALL)
    net = hosts(3)
    pods = render_pods(job, kinds["Secret"], net.net.address(0), tmp_path)
    for index in (2, 1, 0):
        env = {**pods[index]["env"], **net.net.environment(index)}
        net.spawn(f"pod{index}", pods[index]["argv"], env, namespace=index, cwd=REPO)
    codes = {f"pod{i}": net.wait(f"pod{i}", 100) for i in range(3)}
    assert codes == {"pod0": 0, "pod1": 0, "pod2": 0}, {n: net.output(n) for n in codes}
    run_dir = tmp_path / "claims" / "xmig-checkpoints" / job["metadata"]["name"] / pods[0]["uid"]
    summary = check_outcome(net, ["pod0", "pod1", "pod2"], run_dir / "summary.json", reference)
    assert summary["job_id"] == pods[0]["uid"]
