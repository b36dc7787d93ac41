"""Bad input: one clear line on stderr and exit code 2, before anything starts."""

import socket

import pytest

from helpers import DEMO, run, xmig


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("xmig: error: ")
    for needle in needles:
        assert needle in lines[0]
    print(lines[0])


def test_missing_script():
    _one_line_error(
        xmig("run", "--nproc-per-node", "2", "no/such/script.py"),
        "script not found",
        "no/such/script.py",
    )


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nnodes"])
def test_zero_processes(flag):
    _one_line_error(xmig("run", flag, "0", str(DEMO)), flag, "at least 1")


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("kill:rank=1", "missing step"),
        ("explode:rank=0:step=1", "unknown fault kind"),
        ("kill:rank=0:step=1:at=nowhere", "unknown point"),
        ("kill:rank=7:step=1", "rank 7 does not exist"),
    ],
)
def test_malformed_inject(spec, needle):
    _one_line_error(
        xmig("run", "--nproc-per-node", "2", "--inject", spec, str(DEMO)), "bad --inject", needle
    )


def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = xmig("run", "--nproc-per-node", "1", "--master-port", str(port), str(DEMO))
    _one_line_error(proc, f"port {port}", "already in use")


def test_an_unknown_log_route_is_refused():
    _one_line_error(
        xmig("run", "--nproc-per-node", "1", str(DEMO), env={"XMIG_LOG_ROUTE": "disk"}),
        "XMIG_LOG_ROUTE='disk'",
        "expected auto, inline, host",
    )


def test_inject_without_a_job(tmp_path):
    _one_line_error(
        xmig("inject", "kill:rank=0", env={"XMIG_JOBS_DIR": str(tmp_path)}), "no running xmig job"
    )


def test_bad_heartbeat_settings():
    _one_line_error(
        xmig("run", "--heartbeat-interval", "2", "--heartbeat-timeout", "1", str(DEMO)), "heartbeat"
    )


def test_version_and_help():
    assert xmig("--version").stdout.startswith("xmig ")
    proc = xmig("run", "--help")
    assert proc.returncode == 0 and "--nproc-per-node" in proc.stdout and "--inject" in proc.stdout


def test_migrate_without_a_job(tmp_path):
    _one_line_error(
        xmig("migrate", "--rank", "1", env={"XMIG_JOBS_DIR": str(tmp_path)}), "no running xmig job"
    )


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("migrate:rank=1:step=2:to=5", "node 5 does not exist"),
        ("kill:rank=1:step=2:to=1", "to= applies only to migrate"),
        ("migrate:rank=1:step=2:at=forward", "at a step boundary"),
    ],
)
def test_bad_migrate_injections(spec, needle):
    _one_line_error(
        xmig("run", "--nnodes", "2", "--spare-nodes", "1", "--inject", spec, str(DEMO)), needle
    )


def test_spare_nodes_must_not_be_negative():
    _one_line_error(xmig("run", "--spare-nodes", "-1", str(DEMO)), "--spare-nodes")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["run", "--nproc-per-node", "abc", str(DEMO)], ["--nproc-per-node", "integer"]),
        (["run", "--heartbeat-timeout", "x", str(DEMO)], ["--heartbeat-timeout", "number"]),
        (["run", "--no-such-option", str(DEMO)], ["no such option", "--no-such-option"]),
        (["status", "--no-such-option"], ["--no-such-option"]),
        (["--no-such-option"], ["--no-such-option"]),
        (["no-such-command"], ["no-such-command"]),
        (["run"], ["script"]),
    ],
)
def test_what_the_parser_refuses_is_one_line(args, needles):
    """Whichever click raised it (typer's own or click), a parse error is one line, code 2."""
    _one_line_error(xmig(*args), *needles)


@pytest.mark.parametrize(
    ("nnodes", "needles"),
    [
        ("1:2", ["--nnodes 1:2", "needs one launcher per host (--rdzv-endpoint)"]),
        ("a:b", ["--nnodes", "'a:b'"]),
        ("2:1", ["--nnodes", "'2:1'"]),
        ("1:1:1", ["--nnodes", "'1:1:1'"]),
        ("0:0", ["--nnodes", "at least 1"]),
    ],
)
def test_bad_nnodes_ranges(nnodes, needles):
    _one_line_error(xmig("run", "--nnodes", nnodes, str(DEMO)), *needles)


@pytest.mark.parametrize("spelling", [["--nnodes", "2:2"], ["--nnodes=2:2"], ["--nnodes", "2"]])
def test_nnodes_min_equal_max_means_n(spelling):
    # the error names the nodes the job would have: 0..1, so N:N gave two nodes
    proc = xmig("run", *spelling, "--inject", "migrate:rank=0:step=1:to=5", str(DEMO))
    _one_line_error(proc, "node 5 does not exist", "nodes 0..1")


def test_standalone_is_one_node():
    _one_line_error(
        xmig("run", "--standalone", "--nnodes", "2", str(DEMO)), "--standalone", "--nnodes 2"
    )


def test_torchrun_spellings_are_accepted(tmp_path):
    """torchrun's own option names run the job as xmig's do."""
    script = tmp_path / "env.py"
    script.write_text(
        "import os, sys\n"
        "names = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')\n"
        "with open(os.path.join(sys.argv[1], 'env-' + os.environ['RANK']), 'w') as out:\n"
        "    out.write(' '.join(os.environ[n] for n in names))\n"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run(
        ["--standalone", "--nnodes=1:1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), "--hot-spares", "0", str(script), str(tmp_path)],
        tmp_path,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.output
    seen = sorted(f.read_text() for f in tmp_path.glob("env-*"))
    assert seen == [f"{rank} 2 127.0.0.1 {port}" for rank in range(2)]


def test_the_cli_does_not_load_torch():
    # every CLI call pays its imports; commands that talk to a running job (inject, migrate, stop)
    # race the job's end, and torch would add over a second to each
    import subprocess
    import sys

    code = "import sys, xmig.launch.cli; print(sorted(m for m in sys.modules if 'torch' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_job_that_ends_mid_request_is_named():
    # a coordinator that closes the connection without answering: the job ended meanwhile
    from xmig.wire import Server

    server = Server("127.0.0.1", 0, "tok", lambda peer, msg: peer.conn.close())
    server.start()
    try:
        host, port = server.address
        proc = xmig("stop", "--coord", f"{host}:{port}", "--token", "tok")
        _one_line_error(proc, "closed the connection before answering 'stop'", "job ended")
    finally:
        server.close()


MULTI = ["run", "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "job1"]


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["run", "--rdzv-endpoint", "127.0.0.1:29999", "--node-rank", "0"], {},
         ["--rdzv-endpoint needs --rdzv-id", "--node-rank"]),
        ([*MULTI, "--node-rank", "0"], {}, ["needs a secret", "--token-file", "XMIG_SECRET"]),
        ([*MULTI, "--node-rank", "0"], {"XMIG_SECRET": "short"}, ["too short"]),
        ([*MULTI, "--node-rank", "3", "--nnodes", "2:3"], {"XMIG_SECRET": "s" * 32},
         ["--node-rank must be 0..2", "got 3"]),
        ([*MULTI, "--node-rank", "0", "--nnodes", "2:3", "--spare-nodes", "1"], {},
         ["names the spare hosts already"]),
        ([*MULTI, "--node-rank", "0", "--simulate-hosts"], {"XMIG_SECRET": "s" * 32},
         ["--simulate-hosts", "does not go with --rdzv-endpoint"]),
        (["run", "--rdzv-endpoint", "nowhere", "--rdzv-id", "j", "--node-rank", "0"],
         {"XMIG_SECRET": "s" * 32}, ["--rdzv-endpoint must be HOST:PORT"]),
        (["run", "--rdzv-endpoint", "h:1", "--rdzv-id", "a/b", "--node-rank", "0"],
         {"XMIG_SECRET": "s" * 32}, ["--rdzv-id must be"]),
        (["run", "--node-rank", "1"], {}, ["go with --rdzv-endpoint"]),
        ([*MULTI, "--node-rank", "0", "--rdzv-backend", "etcd"], {}, ["--rdzv-backend"]),
    ],
)  # fmt: skip
def test_bad_multi_host_options(args, env, needles, monkeypatch):
    monkeypatch.delenv("XMIG_SECRET", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _one_line_error(xmig(*args, str(DEMO)), *needles)


def test_a_token_file_others_can_read_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o644)
    proc = xmig(*MULTI, "--node-rank", "0", "--token-file", str(secret), str(DEMO))
    _one_line_error(proc, f"--token-file {secret} is readable by others (mode 644)", "chmod 600")
