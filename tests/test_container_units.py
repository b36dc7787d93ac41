"""Container mode's pure parts: a worker's OCI config, its environment, the rootfs's Python,
the runtime's binary (no root, no runc needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from xmig.agent.containers import job_binds, job_prefix
from xmig.container import runc
from xmig.container.bundle import (
    CRIU_CONFIG_ANNOTATION,
    Bind,
    ContainerSpec,
    container_env,
    oci_config,
    ordered_binds,
    write_bundle,
)
from xmig.container.process import inner_pid
from xmig.container.rootfs import VENV_PYTHON, RootfsError, find_python, resolve_inside
from xmig.jobspec import JobSpec, JobSpecError


def spec(**fields) -> ContainerSpec:
    base = dict(rootfs="/srv/rootfs", args=("/opt/xmig/venv/bin/python", "train.py"),
                env={"RANK": "1"}, cwd="/work/project", netns="/proc/42/ns/net")  # fmt: skip
    return ContainerSpec(**{**base, **fields})


def test_the_container_joins_its_nodes_network_and_has_its_own_pids():
    config = oci_config(spec())
    namespaces = {ns["type"]: ns.get("path") for ns in config["linux"]["namespaces"]}
    assert namespaces == {"pid": None, "ipc": None, "uts": None, "mount": None,
                          "network": "/proc/42/ns/net"}  # fmt: skip
    assert config["root"] == {"path": "/srv/rootfs", "readonly": True}
    assert config["process"]["args"] == ["/opt/xmig/venv/bin/python", "train.py"]
    assert config["process"]["cwd"] == "/work/project"
    assert config["process"]["terminal"] is False  # CRIU takes no terminal along
    assert "RANK=1" in config["process"]["env"]


def test_the_hosts_shared_memory_and_a_private_tmp():
    mounts = {m["destination"]: m for m in oci_config(spec())["mounts"]}
    assert mounts["/dev/shm"]["source"] == "/dev/shm" and mounts["/dev/shm"]["type"] == "bind"
    assert mounts["/tmp"]["type"] == "tmpfs"


def test_binds_keep_their_path_parents_first_and_writable_wins():
    binds = [Bind("/work/project/out", writable=True), Bind("/work/project"),
             Bind("/work/project/"), Bind("/srv/ckpt"),
             Bind("/srv/ckpt", writable=True)]  # fmt: skip
    assert ordered_binds(binds) == [Bind("/srv/ckpt", True), Bind("/work/project", False),
                                    Bind("/work/project/out", True)]  # fmt: skip
    mounts = [m for m in oci_config(spec(binds=tuple(binds)))["mounts"]
              if m["destination"].startswith(("/work", "/srv"))]  # fmt: skip
    assert [(m["destination"], m["source"], m["options"][1]) for m in mounts] == [
        ("/srv/ckpt", "/srv/ckpt", "rw"), ("/work/project", "/work/project", "ro"),
        ("/work/project/out", "/work/project/out", "rw")]  # fmt: skip
    with pytest.raises(ValueError, match="root"):
        ordered_binds([Bind("/")])


def test_the_environment_inside_leaves_the_hosts_python_out():
    base = {"PATH": "/root/.pyenv/bin:/usr/bin", "VIRTUAL_ENV": "/work/.venv",
            "PYTHONHOME": "/x", "PYTHONPATH": "/work/project/lib:/opt/src",
            "RANK": "3"}  # fmt: skip
    env = container_env(base, "/opt/src")
    assert "VIRTUAL_ENV" not in env and "PYTHONHOME" not in env
    assert env["PATH"].startswith("/opt/xmig/venv/bin:") and "pyenv" not in env["PATH"]
    assert env["PYTHONPATH"] == "/opt/src:/work/project/lib"  # xmig's code first, once
    assert env["RANK"] == "3"
    assert container_env(env, "/opt/src") == env  # applied twice, the same


def test_a_bundle_names_its_criu_settings(tmp_path):
    bundle = write_bundle(tmp_path / "b", spec())
    config = json.loads((bundle / "config.json").read_text())
    criu_config = config["annotations"][CRIU_CONFIG_ANNOTATION]
    options = Path(criu_config).read_text().split()
    # the connections close at a move (the worker reconnects), and nothing locks the
    # network namespace the node's other ranks share
    assert options == ["tcp-close", "network-lock", "skip"]


def _rootfs(tmp_path, python_at: str = VENV_PYTHON):
    root = tmp_path / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").mkdir()
    real = root / "usr" / "bin" / "python3.11"
    real.write_text("")
    real.chmod(0o755)
    link = root / python_at.lstrip("/")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to("/usr/bin/python3.11")  # absolute: inside the rootfs, not the host's
    return root


def test_the_rootfs_python_is_found_through_links_inside_it(tmp_path):
    root = _rootfs(tmp_path)
    assert find_python(root) == VENV_PYTHON
    assert resolve_inside(root, VENV_PYTHON) == root / "usr" / "bin" / "python3.11"
    # a link that climbs out of the rootfs stays inside it, as the container sees it
    (root / "escape").symlink_to("../../../../../../usr")
    assert resolve_inside(root, "/escape/bin/python3.11") == root / "usr/bin/python3.11"
    (root / "loop").symlink_to("/loop")
    assert resolve_inside(root, "/loop") is None


def test_a_rootfs_without_python_or_not_a_rootfs_is_said_so(tmp_path):
    root = _rootfs(tmp_path, python_at="/opt/other/python")
    with pytest.raises(RootfsError, match="has no Python"):
        find_python(root)
    assert find_python(root, "/opt/other/python") == "/opt/other/python"
    with pytest.raises(RootfsError, match="no such folder"):
        find_python(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(RootfsError, match="not a root filesystem"):
        find_python(tmp_path / "plain")


def test_runc_named_by_the_environment_is_the_only_one_looked_at(tmp_path, monkeypatch):
    monkeypatch.setenv(runc.ENV_VAR, str(tmp_path / "missing"))
    assert runc.find_runc() is None
    with pytest.raises(runc.RuncError, match="--container needs runc"):
        runc.require_runc()


def test_a_process_outside_any_container_has_one_pid():
    assert inner_pid(os.getpid()) == os.getpid()


def test_a_jobs_containers_see_its_folders_at_their_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("XMIG_JOBS_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("XMIG_PARK_DIR", str(tmp_path / "park"))
    monkeypatch.setenv("XMIG_IMAGES_DIR", str(tmp_path / "images"))
    job = JobSpec(job_id="run 7/a", script=str(tmp_path / "p" / "train.py"), args=(),
                  cwd=str(tmp_path / "p"), checkpoint_dir=str(tmp_path / "ckpt"),
                  container="/srv/rootfs", container_mounts=["/data:ro", "/out"])  # fmt: skip
    binds = {b.path: b.writable for b in job_binds(job)}
    assert (binds["/data"], binds["/out"]) == (False, True)  # the user's own mounts
    assert binds[str(tmp_path / "p")] is False  # the project: read-only
    assert binds[str(tmp_path / "ckpt")] is True
    assert binds[str(tmp_path / "jobs" / "run 7/a")] is True
    assert binds[str(tmp_path / "park")] is True
    assert binds[str(tmp_path / "images" / "xmig-migrate" / "run 7/a")] is True  # a move's
    assert (tmp_path / "ckpt").is_dir()  # made, so that it can be mounted
    assert job_prefix("run 7/a") == "xmig-run_7_a-"


@pytest.mark.parametrize("mounts, container, needle", [
    (["data"], "/srv/rootfs", "an absolute path"),
    (["/"], "/srv/rootfs", "an absolute path"),
    (["/data"], None, "goes with --container"),
])  # fmt: skip
def test_container_mounts_are_checked_with_the_spec(mounts, container, needle):
    with pytest.raises(JobSpecError, match=needle):
        JobSpec(job_id="j", script="/t.py", args=(), cwd="/", container=container,
                container_mounts=mounts)  # fmt: skip


def test_containers_on_a_gpu_machine_say_they_run_on_cpu(monkeypatch, capsys):
    """No GPU is passed into a container yet: on a machine with GPUs the job says so before
    it starts, instead of training on its CPUs unannounced."""
    from xmig.agent import containers
    from xmig.launch import cli

    monkeypatch.setattr(containers, "check_can_run", lambda spec: "/opt/xmig/venv/bin/python")
    job = JobSpec(job_id="j", script="/t.py", args=(), cwd="/", container="/srv/rootfs")
    for gpus, warned in ((0, False), (8, True)):
        monkeypatch.setattr(cli, "gpu_count", lambda gpus=gpus: gpus)
        cli._check_container(job)
        err = capsys.readouterr().err
        assert ("8 GPU(s)" in err and "the workers run on CPU" in err) is warned, err


def test_ci_makes_the_test_rootfs_where_the_container_tests_look_for_it(tmp_path, monkeypatch):
    # .ci/run makes it while it installs the rest; named otherwise, the tests would make it
    # again (80 s)
    import subprocess

    import container_harness

    monkeypatch.setenv("XMIG_TEST_ROOTFS_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_SPEC", "torch==2.13.0")
    monkeypatch.setattr(container_harness, "CACHE", tmp_path)
    script = Path(__file__).resolve().parent.parent / "scripts" / "test-rootfs.sh"
    said = subprocess.run(["bash", str(script), "--path"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()  # fmt: skip
    assert said == str(tmp_path / f"xmig-test-rootfs-{container_harness._key()}")
    monkeypatch.setenv("TORCH_SPEC", "torch==2.12.0")  # another torch: another rootfs
    other = subprocess.run(["bash", str(script), "--path"], capture_output=True, text=True,
                           check=True, timeout=30).stdout.strip()  # fmt: skip
    assert other != said and other == str(tmp_path / f"xmig-test-rootfs-{container_harness._key()}")
