"""The ``xmig`` command line."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import click
import typer

from xmig import __version__, jobenv, logs
from xmig.faults.spec import FaultSpecError, parse_faults
from xmig.jobspec import (
    DEFAULT_AGENT_CONNECT_TIMEOUT_S,
    DEFAULT_COORDINATOR_RESTARTS,
    DEFAULT_GPU_GATE,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_HOST_JOIN_TIMEOUT_S,
    DEFAULT_HOT_SPARES,
    DEFAULT_KEEP_LOG,
    DEFAULT_LOG_LEVEL,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_MAX_RECOVERIES,
    DEFAULT_NNODES,
    DEFAULT_NPROC_PER_NODE,
    DEFAULT_RECOVERY_TIMEOUT_S,
    DEFAULT_REJOIN_TIMEOUT_S,
    DEFAULT_SIMULATE_HOSTS,
    DEFAULT_SPARE_NODES,
    DEFAULT_STOP_GRACE_S,
    DEFAULT_STRICT,
    JobSpec,
    JobSpecError,
)
from xmig.launch.check import CheckError, run_check
from xmig.launch.doctor import run_doctor
from xmig.launch.hosts import HostSetupError, check_can_simulate, gpu_count
from xmig.launch.launcher import Launcher, LaunchError, find_job
from xmig.paths import job_folder
from xmig.wire import AuthError, Client, RemoteError, WireError, format_address, parse_address

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="xmig: keep distributed PyTorch jobs running through GPU, process and node faults.",
)


def _version(value: bool) -> None:
    if value:
        print(f"xmig {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    pass


@app.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run(
    script: Annotated[str, typer.Argument(help="The training script (run with this Python).")],
    script_args: Annotated[
        list[str] | None, typer.Argument(help="Arguments passed to the script.")
    ] = None,
    nnodes: Annotated[
        str,
        typer.Option(
            metavar="N|MIN:MAX",
            help="Number of nodes (agents). With --rdzv-endpoint, MIN:MAX means MIN nodes "
            "with workers and MAX-MIN spare hosts that join idle and take over a lost one.",
        ),
    ] = str(DEFAULT_NNODES),
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank",
            "--node_rank",
            help="With --rdzv-endpoint: this host's node (0..MAX-1); node 0 hosts the coordinator.",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            metavar="HOST:PORT",
            help="One launcher per host: the coordinator's address, on node 0's host; every "
            "host runs the same command with its own --node-rank.",
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None,
        typer.Option(
            "--rdzv-id",
            "--rdzv_id",
            metavar="JOB",
            help="With --rdzv-endpoint: the job's id, the same on every host.",
        ),
    ] = None,
    rdzv_backend: Annotated[
        str,
        typer.Option(
            "--rdzv-backend",
            "--rdzv_backend",
            metavar="NAME",
            help="Accepted as torchrun's (c10d or static): xmig's coordinator is the "
            "rendezvous either way.",
        ),
    ] = "c10d",
    token_file: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="With --rdzv-endpoint: an owner-only file holding a secret every host "
            "of the job has (or XMIG_SECRET); the job's token is derived from it and "
            "the job's id.",
        ),
    ] = None,
    coordinator_restarts: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Start the coordinator again this many times if it dies: it takes "
            "the job up from its last snapshot, its agents rejoin, the workers go on "
            "(0: a lost coordinator stops the job, every rank's state saved).",
        ),
    ] = DEFAULT_COORDINATOR_RESTARTS,
    rejoin_timeout: Annotated[
        float,
        typer.Option(
            metavar="S",
            help="How long agents wait for a coordinator that died to come back, and "
            "a restarted one for its agents.",
        ),
    ] = DEFAULT_REJOIN_TIMEOUT_S,
    control_plane: Annotated[
        str | None,
        typer.Option(
            metavar="etcd://HOST:PORT,...",
            help="An HA control plane: the job's state in this etcd cluster, and "
            "--coordinators coordinators of which one leads; a standby takes over "
            "when the leader dies.",
        ),
    ] = None,
    coordinators: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Coordinators campaigning for the lead (default 2 with --control-plane, else 1).",
        ),
    ] = None,
    join_timeout: Annotated[
        float | None,
        typer.Option(
            metavar="S",
            help="Seconds the job waits for every node's agent to join (default 60; "
            "600 with --rdzv-endpoint); a host waits as long for the coordinator.",
        ),
    ] = None,
    standalone: Annotated[
        bool,
        typer.Option(
            "--standalone",
            help="As torchrun's: one node with a local store, which is what xmig does anyway.",
        ),
    ] = False,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", "--nproc_per_node", help="Workers (ranks) per node.")
    ] = DEFAULT_NPROC_PER_NODE,
    master_addr: Annotated[
        str,
        typer.Option("--master-addr", "--master_addr", help="Address of the coordinator's store."),
    ] = DEFAULT_MASTER_ADDR,
    master_port: Annotated[
        int,
        typer.Option(
            "--master-port",
            "--master_port",
            help="Port of the coordinator's c10d store; 0 picks a free one.",
        ),
    ] = DEFAULT_MASTER_PORT,
    inject: Annotated[
        list[str] | None,
        typer.Option(
            help="Inject a fault: KIND:rank=R:step=S[:at=forward|backward|optimizer|boundary"
            "|pause|collective=K|completion=K], KIND one of kill, exit, raise, hang, node (the "
            "rank's whole node is lost); pause: paused at step S's start for a migration or a "
            "resize; completion=K (raise only): the K-th collective fails after its launch; "
            "or at a phase of a peer's recovery the rank takes part in while "
            "parked in step S: at=park|rebuild|pull|replay|checkpoint. Planned events the "
            "same way: migrate:rank=R:step=S[:to=N], resize:world=N:step=S, add-node:step=S "
            "(one more node started as the job reaches step S). Repeatable."
        ),
    ] = None,
    summary: Annotated[
        Path | None, typer.Option(help="Write the run summary (JSON) to this file.")
    ] = None,
    heartbeat_interval: Annotated[
        float, typer.Option(help="Seconds between a worker's heartbeats.")
    ] = DEFAULT_HEARTBEAT_INTERVAL_S,
    heartbeat_timeout: Annotated[
        float, typer.Option(help="Seconds without a heartbeat before a rank counts as hung.")
    ] = DEFAULT_HEARTBEAT_TIMEOUT_S,
    stop_grace: Annotated[
        float, typer.Option(help="Seconds a worker gets to exit on stop before SIGKILL.")
    ] = DEFAULT_STOP_GRACE_S,
    no_replay_log: Annotated[
        bool,
        typer.Option(
            "--no-replay-log",
            help="Do not keep copies of the step's collective inputs (saves memory); a fault "
            "then rolls the step back on every rank instead of replaying it.",
        ),
    ] = not DEFAULT_KEEP_LOG,
    gpu_gate: Annotated[
        bool,
        typer.Option(
            "--gpu-gate/--no-gpu-gate",
            help="(Experimental) On GPUs, complete a bucket all-reduce's future at once behind "
            "a gate on the GPU that opens there once the all-reduce has ended (a recovery "
            "closes it first), so the CPU runs ahead as with plain DDP (a step at gpt350m "
            "takes about 0.5 % less), and its replay log copies the bucket all-reduces' inputs "
            "into pinned host memory through the copy engines (XMIG_LOG_ROUTE). Its workers load "
            "every CUDA module at start (CUDA_MODULE_LOADING=EAGER: a lazy load waits for a "
            "shut gate). Not yet run with a peer on GPUs. Not for optimizers that read GPU "
            "values on the host inside step().",
        ),
    ] = DEFAULT_GPU_GATE,
    recovery_timeout: Annotated[
        float, typer.Option(help="Seconds a recovery may take before the job stops.")
    ] = DEFAULT_RECOVERY_TIMEOUT_S,
    max_recoveries: Annotated[
        int, typer.Option(help="Recoveries allowed in one job before a fault stops it.")
    ] = DEFAULT_MAX_RECOVERIES,
    hot_spares: Annotated[
        int,
        typer.Option(
            help="Pre-started interpreters per node (torch loaded) that become replacement "
            "ranks in milliseconds; 0 starts replacements from scratch."
        ),
    ] = DEFAULT_HOT_SPARES,
    spare_nodes: Annotated[
        int,
        typer.Option(help="Idle nodes (agents without workers) that take over a lost node."),
    ] = DEFAULT_SPARE_NODES,
    on_no_spare: Annotated[
        str,
        typer.Option(
            help="When a lost node's ranks have no spare node: stop (with a just-in-time "
            "checkpoint) or shrink (go on without them, as `xmig scale` would)."
        ),
    ] = "stop",
    min_world_size: Annotated[
        int, typer.Option(help="With --on-no-spare shrink: the fewest ranks to go on with.")
    ] = 1,
    simulate_hosts: Annotated[
        bool,
        typer.Option(
            "--simulate-hosts",
            help="Run every node in a network namespace of its own, with its own address "
            "(root only): several hosts on one machine.",
        ),
    ] = DEFAULT_SIMULATE_HOSTS,
    log_level: Annotated[
        str,
        typer.Option(
            metavar="LEVEL",
            help="Logging detail of xmig's processes: DEBUG, INFO, WARNING or ERROR.",
        ),
    ] = DEFAULT_LOG_LEVEL,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Stop the job when a recovery is shown not to be bit-identical (its replayed "
            "collectives come out different), instead of going on with a warning.",
        ),
    ] = DEFAULT_STRICT,
    trace_dir: Annotated[
        Path | None,
        typer.Option(hidden=True, help="Write what every rank issues here (xmig check)."),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Where a just-in-time checkpoint goes when a fault cannot be recovered "
            "(default: the job's folder, ~/.xmig/jobs/JOB_ID).",
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Resume from a just-in-time checkpoint: the same script, arguments and "
            "world layout as the job that wrote it.",
        ),
    ] = None,
    container: Annotated[
        Path | None,
        typer.Option(
            metavar="ROOTFS",
            help="Run every worker (and hot spare) in a runc container of this root "
            "filesystem (root only; make one with scripts/make-rootfs.sh): the project "
            "mounted read-only, in its node's network namespace; a move checkpoints the "
            "container.",
        ),
    ] = None,
    container_mount: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATH[:ro]",
            help="With --container: one more host folder (data, outputs) mounted at its path "
            "in every container, writable unless :ro. Repeatable.",
        ),
    ] = None,
) -> None:
    """Run SCRIPT on NNODES x NPROC_PER_NODE ranks with fault detection (like torchrun)."""
    if not Path(script).is_file():
        if script.startswith("-"):  # an option we do not know, taken for the script's name
            raise click.UsageError(f"no such option: {script}")
        raise click.UsageError(f"script not found: {script}")
    nodes, most = _parse_nnodes(nnodes, elastic=rdzv_endpoint is not None)
    if standalone and most > 1:
        raise click.UsageError(f"--standalone means one node; it cannot go with --nnodes {nnodes}")
    if most > nodes:
        if spare_nodes:
            raise click.UsageError(f"--nnodes {nnodes} names the spare hosts already: give "
                                   "no --spare-nodes with it")  # fmt: skip
        spare_nodes = most - nodes
    if rdzv_backend not in ("c10d", "static", "xmig"):
        raise click.UsageError(f"--rdzv-backend must be c10d or static, got {rdzv_backend!r}")
    try:  # read by the workers, which inherit this environment: refused here, before any starts
        jobenv.log_route_for(os.environ.get(jobenv.LOG_ROUTE), gpu_gate)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    token = None
    host: dict[str, Any] = {}
    if join_timeout is None:
        join_timeout = (DEFAULT_HOST_JOIN_TIMEOUT_S if rdzv_endpoint is not None
                        else DEFAULT_AGENT_CONNECT_TIMEOUT_S)  # fmt: skip
    if join_timeout <= 0:
        raise click.UsageError(f"--join-timeout must be positive, got {join_timeout}")
    if control_plane is not None:
        from xmig.coord.etcd import parse_url

        try:
            parse_url(control_plane)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    if rdzv_endpoint is not None:
        token, host = _multi_host(rdzv_endpoint, rdzv_id, node_rank, token_file,
                                  simulate_hosts, master_addr, nodes + spare_nodes,
                                  join_timeout)  # fmt: skip
        if control_plane is not None and node_rank:
            # this host's own coordinator (if it runs one) listens on its own address
            from xmig.coord.etcd import parse_url
            from xmig.launch.multihost import MultiHostError, address_towards

            try:
                first = parse_url(control_plane)[0]
                host.update(master_addr=address_towards(*first), coord_port=0)
            except (ValueError, MultiHostError) as exc:
                raise click.UsageError(str(exc)) from None
        master_addr = host["master_addr"]
    elif node_rank is not None or rdzv_id is not None or token_file is not None:
        raise click.UsageError("--node-rank, --rdzv-id and --token-file go with "
                               "--rdzv-endpoint (one launcher per host)")  # fmt: skip
    # the spec checks every number (JobSpecError); the faults come after the hosts' checks
    job_id = host.get("job_id") or time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex()
    spec = _job_spec(
        JobSpec,
        job_id=job_id,
        script=str(Path(script).resolve()),
        args=list(script_args or []),
        cwd=os.getcwd(),
        nnodes=nodes,
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        stop_grace=stop_grace,
        keep_log=not no_replay_log,
        gpu_gate=gpu_gate,
        recovery_timeout=recovery_timeout,
        max_recoveries=max_recoveries,
        hot_spares=hot_spares,
        spare_nodes=spare_nodes,
        on_no_spare=on_no_spare,
        min_world_size=min_world_size,
        simulate_hosts=simulate_hosts,
        log_level=log_level.upper(),
        strict=strict,
        trace_dir=str(trace_dir.resolve()) if trace_dir is not None else None,
        checkpoint_dir=str((checkpoint_dir or job_folder(job_id)).resolve()),
        resume=str(resume.resolve()) if resume is not None else None,
        agent_connect_timeout=join_timeout,
        coordinator_restarts=coordinator_restarts,
        rejoin_timeout=rejoin_timeout,
        control_plane=control_plane,
        coordinators=coordinators if coordinators is not None else (2 if control_plane else 1),
        multi_host=bool(host),
        coord_port=host.get("coord_port", 0),
        container=str(container.resolve()) if container is not None else None,
        container_mounts=list(container_mount or []),
    )
    if simulate_hosts:
        if master_addr != DEFAULT_MASTER_ADDR:
            raise click.UsageError("--simulate-hosts picks the coordinator's address itself")
        try:
            check_can_simulate()
        except HostSetupError as exc:
            raise click.UsageError(str(exc)) from None
    try:
        faults = parse_faults(inject or [], spec.world_size)
    except FaultSpecError as exc:
        raise click.UsageError(f"bad --inject: {exc}") from None
    spec = _job_spec(replace, spec, faults=[f.to_json() for f in faults])  # checks their nodes
    logs.setup(spec.log_level)
    if spec.resume is not None:
        _check_resume(spec)
    if spec.container is not None:
        _check_container(spec)
    try:
        code = Launcher(spec, summary, argv=_ARGV, token=token, node_rank=node_rank).run()
    except LaunchError as exc:
        raise click.UsageError(str(exc)) from None
    raise typer.Exit(code)


def _check_resume(spec: JobSpec) -> None:
    """Refuse, before anything starts, a checkpoint this run cannot resume from."""
    from xmig.state.checkpoint import CheckpointError, check_resumable

    assert spec.resume is not None

    def progress(line: str) -> None:
        print(f"xmig: {line}", file=sys.stderr, flush=True)

    try:
        manifest = check_resumable(Path(spec.resume), spec.world_size, spec.nnodes,
                                   spec.nproc_per_node, spec.script_path, list(spec.args),
                                   progress=progress)  # fmt: skip
    except CheckpointError as exc:
        raise click.UsageError(f"cannot resume: {exc}") from None
    progress(f"resuming from {spec.resume}: step {manifest.step} of job {manifest.job_id}, "
             f"{len(manifest.shards)} shard(s)")  # fmt: skip


def _check_container(spec: JobSpec) -> None:
    """Refuse, before anything starts, containers that cannot run here (one line)."""
    from xmig.agent.containers import ContainerError, check_can_run

    assert spec.container is not None
    started = time.monotonic()
    try:
        python = check_can_run(spec)
    except ContainerError as exc:
        raise click.UsageError(str(exc)) from None
    print(f"xmig: containers of {spec.container} ({python}; checked in "
          f"{time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    gpus = gpu_count()
    if gpus:  # torch in a container sees none of them: the job would train on its CPUs
        print(f"xmig: warning: this machine has {gpus} GPU(s), and --container passes none "
              "into the containers yet: the workers run on CPU (gloo); for GPUs run bare "
              "workers, or xmig inside the GPU image (README, \"Containers\")",
              file=sys.stderr, flush=True)  # fmt: skip


def _job_spec(make: Callable[..., JobSpec], *args: Any, **fields: Any) -> JobSpec:
    """A job spec made by ``make`` (``JobSpec`` or ``dataclasses.replace``); what it refuses
    is the user's error."""
    try:
        return make(*args, **fields)
    except JobSpecError as exc:
        raise click.UsageError(str(exc)) from None


def _parse_nnodes(text: str, elastic: bool) -> tuple[int, int]:
    """``--nnodes``: N, or torchrun's MIN:MAX (MIN < MAX only with one launcher per host,
    ``elastic``: the hosts beyond MIN are spares)."""
    parts = text.split(":")
    try:
        least, most = int(parts[0]), int(parts[-1])
    except ValueError:
        least, most = 0, -1
    if len(parts) > 2 or most < least:
        raise click.UsageError(f"--nnodes must be N or MIN:MAX, got {text!r}")
    if least < 1:
        raise click.UsageError(f"--nnodes must be at least 1, got {text}")
    if least != most and not elastic:
        raise click.UsageError(
            f"--nnodes {text}: a range MIN:MAX (spare hosts beyond MIN) needs one launcher per "
            "host (--rdzv-endpoint); on one machine give N and --spare-nodes"
        )
    return least, most


def _multi_host(endpoint: str, rdzv_id: str | None, node_rank: int | None,
                token_file: Path | None, simulate_hosts: bool, master_addr: str,
                all_nodes: int, join_timeout: float) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """The token and the spec's fields of a job with one launcher per host."""
    from xmig.launch.multihost import (
        MultiHostError,
        check_rdzv_id,
        job_token,
        parse_endpoint,
        read_secret,
    )

    if rdzv_id is None or node_rank is None:
        raise click.UsageError("--rdzv-endpoint needs --rdzv-id (the job's id) and "
                               "--node-rank (this host's node) on every host")  # fmt: skip
    if simulate_hosts:
        raise click.UsageError("--simulate-hosts starts every node from one launcher; it does "
                               "not go with --rdzv-endpoint")  # fmt: skip
    if master_addr != DEFAULT_MASTER_ADDR:
        raise click.UsageError("with --rdzv-endpoint the store is on the coordinator's host: "
                               "give no --master-addr")  # fmt: skip
    if not 0 <= node_rank < all_nodes:
        raise click.UsageError(f"--node-rank must be 0..{all_nodes - 1} for --nnodes with "
                               f"{all_nodes} host(s), got {node_rank}")  # fmt: skip
    try:
        job_id = check_rdzv_id(rdzv_id)
        # node 0 must be the host the name stands for; another may start before it has one
        address, port = parse_endpoint(endpoint, within=join_timeout if node_rank else 0.0)
        token = job_token(read_secret(token_file), job_id)
    except MultiHostError as exc:
        raise click.UsageError(str(exc)) from None
    return token, {"job_id": job_id, "master_addr": address, "coord_port": port}


def _connect(job: str | None, coord: str | None, token: str | None) -> Client:
    if coord is not None:
        token = token or os.environ.get("XMIG_TOKEN")
        if not token:
            raise click.UsageError("--coord needs the job token: --token or XMIG_TOKEN")
        try:
            address = parse_address(coord)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    else:
        try:
            found = find_job(job)
        except LaunchError as exc:
            raise click.UsageError(str(exc)) from None
        address, token = parse_address(found.coordinator), token or found.token
    try:
        return Client(address, token, info={"role": "client"}, connect_timeout=5.0)
    except AuthError as exc:
        raise click.UsageError(f"the coordinator refused the connection: {exc}") from None
    except (WireError, OSError) as exc:
        where = format_address(address)
        raise click.UsageError(f"cannot talk to the coordinator at {where}: {exc}") from None


def _request(
    job: str | None, coord: str | None, token: str | None, refused: str, op: str, **fields: Any
) -> dict[str, Any]:
    """One request to a running job's coordinator; its refusal is the user's error."""
    client = _connect(job, coord, token)
    try:
        return client.call(op, timeout=10.0, **fields)
    except RemoteError as exc:
        raise click.UsageError(f"{refused}: {exc}") from None
    except WireError:  # the coordinator ends its connections when the job ends
        raise click.UsageError(
            f"the coordinator closed the connection before answering {op!r}: has the job ended?"
        ) from None
    finally:
        client.close()


JobOpt = Annotated[str | None, typer.Option(help="Job id (default: the only running job).")]
CoordOpt = Annotated[
    str | None, typer.Option(help="Coordinator address host:port (instead of --job).")
]
TokenOpt = Annotated[str | None, typer.Option(help="The job token (default: from the job).")]


@app.command("inject")
def inject_cmd(
    spec: Annotated[
        str, typer.Argument(help="KIND:rank=R[:step=S][:at=POINT]; without step: the next step.")
    ],
    job: JobOpt = None,
    coord: CoordOpt = None,
    token: TokenOpt = None,
) -> None:
    """Inject a fault into a running job."""
    reply = _request(job, coord, token, "fault refused", "inject", spec=spec)
    print(f"xmig: fault {reply['fault']} queued")


@app.command("migrate")
def migrate_cmd(
    rank: Annotated[int, typer.Option(help="The rank to move.")],
    to: Annotated[
        int | None, typer.Option(help="The node to move it to (default: an idle node).")
    ] = None,
    job: JobOpt = None,
    coord: CoordOpt = None,
    token: TokenOpt = None,
) -> None:
    """Move a rank's process to another node at the next step boundary (CRIU): it keeps
    its PID and its state; the other ranks only pause."""
    reply = _request(job, coord, token, "migration refused", "migrate", rank=rank, to=to)
    print(f"xmig: {reply['migration']}")


@app.command("scale")
def scale_cmd(
    world_size: Annotated[
        int | None, typer.Option(help="The number of ranks to go on with.")
    ] = None,
    add_node: Annotated[
        bool,
        typer.Option(
            "--add-node",
            help="Start one more node: the world grows onto it back toward its size (the "
            "launch's, or the last --world-size asked for) if a lost node shrank it; "
            "otherwise it waits as a spare node.",
        ),
    ] = False,
    job: JobOpt = None,
    coord: CoordOpt = None,
    token: TokenOpt = None,
) -> None:
    """Change the number of data-parallel ranks at the next step boundary. Smaller: the
    highest ranks leave, the others go on with their state (nothing is pulled or replayed).
    Larger: new ranks start on idle nodes and pull the state from the others. The script
    must draw its data through session.shards()."""
    if (world_size is None) == (not add_node):
        raise typer.BadParameter("give either --world-size N or --add-node")
    if world_size is not None and world_size < 1:
        raise typer.BadParameter(f"--world-size must be at least 1, got {world_size}")
    reply = _request(job, coord, token, "resize refused", "scale",
                     world_size=world_size or 0, add_node=add_node)  # fmt: skip
    print(f"xmig: {reply['resize']}")


@app.command("stop")
def stop_cmd(
    reason: Annotated[str, typer.Option(help="Why, for the job's outcome.")] = "stopped by request",
    job: JobOpt = None,
    coord: CoordOpt = None,
    token: TokenOpt = None,
) -> None:
    """Stop a running job: its workers get --stop-grace seconds, then SIGKILL; the job ends
    as failed with REASON."""
    reply = _request(job, coord, token, "stop refused", "stop", reason=reason)
    print("xmig: stopping the job" if reply.get("stopping") else "xmig: the job is already ending")


@app.command(
    "check",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def check_cmd(
    run_args: Annotated[
        list[str],
        typer.Argument(
            metavar="[RUN OPTIONS] SCRIPT [ARGS]...",
            help="What xmig run would get: its options, the script and the script's arguments "
            "(make it short: a few steps).",
        ),
    ],
    rank: Annotated[
        int | None, typer.Option(help="The rank to replace (default: the last one).")
    ] = None,
    step: Annotated[
        list[int] | None,
        typer.Option(
            help="A step to replace it at (repeatable; default: 0, 2 after DDP's bucket "
            "rebuild, and 3)."
        ),
    ] = None,
    run_timeout: Annotated[float, typer.Option(help="Seconds one run may take.")] = 600.0,
    keep: Annotated[
        Path | None, typer.Option(help="Keep the runs' logs and traces in this folder.")
    ] = None,
) -> None:
    """Tell, before any fault, whether SCRIPT recovers bit-identically: run it without a
    fault twice, then with a rank replaced at chosen steps, and compare what the replacement
    issues with what the original rank issued. This command's options come first."""
    try:
        code = run_check(list(run_args), rank, list(step or []), keep, run_timeout)
    except CheckError as exc:
        raise click.UsageError(str(exc)) from None
    raise typer.Exit(code)


@app.command("doctor")
def doctor_cmd() -> None:
    """Check what this machine offers xmig: CRIU, network namespaces, the CUDA checkpoint API."""
    raise typer.Exit(run_doctor())


@app.command("status")
def status_cmd(job: JobOpt = None, coord: CoordOpt = None, token: TokenOpt = None) -> None:
    """Show a running job's state."""
    status = _request(job, coord, token, "status refused", "status")["status"]
    progress = ", ".join(f"rank {r}: step {s}" for r, s in status["progress"].items())
    print(
        f"job {status['job_id']}: {status['status']}, generation {status['generation']}, "
        f"{status['world_size']} ranks, {status['faults']} fault(s), "
        f"{status['spares_ready']} hot spare(s) ready; {progress or 'no steps yet'}"
    )


# newer typer raises the exceptions of a click of its own, our commands raise click's:
# catch both families (they are the same classes where typer has no click of its own)
_USER_ERRORS: tuple[type[Exception], ...] = (
    click.ClickException,
    getattr(typer, "TyperException", click.ClickException),
)
_EXITS: tuple[type[Exception], ...] = (click.exceptions.Exit, typer.Exit)
_ABORTS: tuple[type[BaseException], ...] = (click.exceptions.Abort, typer.Abort)


# the command line as given (``xmig run`` prints the command that resumes a checkpoint)
_ARGV: list[str] = []


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors in what the user typed are one line and exit code 2."""
    global _ARGV
    _ARGV = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="xmig", standalone_mode=False)
    except _EXITS as exc:
        code = getattr(exc, "exit_code", 1)
    except _USER_ERRORS as exc:
        message = getattr(exc, "format_message", exc.__str__)()
        print(f"xmig: error: {message}", file=sys.stderr)
        code = 2
    except _ABORTS:
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
