"""The job spec: its defaults in one place, what it refuses, its JSON form, its immutability."""

import dataclasses

import pytest
import typer

from xmig import jobspec
from xmig.coord.job import JobSpec as CoordJobSpec
from xmig.jobenv import LOG_LEVEL, WorkerEnv
from xmig.jobspec import JobSpec, JobSpecError
from xmig.launch.cli import app


def _spec(**fields):
    return JobSpec(job_id="j1", script="/s.py", args=["--steps", "3"], cwd="/", **fields)


def _cli_defaults():
    command = typer.main.get_command(app).commands["run"]
    return {param.name: param.default for param in command.params}


def _field_default(name):
    return {f.name: f.default for f in dataclasses.fields(JobSpec)}[name]


@pytest.mark.parametrize(
    ("name", "constant"),
    [
        ("recovery_timeout", jobspec.DEFAULT_RECOVERY_TIMEOUT_S),
        ("hot_spares", jobspec.DEFAULT_HOT_SPARES),
        ("heartbeat_interval", jobspec.DEFAULT_HEARTBEAT_INTERVAL_S),
        ("heartbeat_timeout", jobspec.DEFAULT_HEARTBEAT_TIMEOUT_S),
        ("stop_grace", jobspec.DEFAULT_STOP_GRACE_S),
        ("max_recoveries", jobspec.DEFAULT_MAX_RECOVERIES),
        ("spare_nodes", jobspec.DEFAULT_SPARE_NODES),
        ("nproc_per_node", jobspec.DEFAULT_NPROC_PER_NODE),
        ("master_addr", jobspec.DEFAULT_MASTER_ADDR),
        ("master_port", jobspec.DEFAULT_MASTER_PORT),
        ("log_level", jobspec.DEFAULT_LOG_LEVEL),
    ],
)
def test_the_cli_uses_the_specs_defaults(name, constant):
    assert _field_default(name) == constant
    assert _cli_defaults()[name] == constant
    assert getattr(_spec(), name) == constant


def test_the_cli_spells_the_other_defaults_from_the_spec():
    defaults = _cli_defaults()
    assert defaults["nnodes"] == str(jobspec.DEFAULT_NNODES)
    assert defaults["no_replay_log"] is (not jobspec.DEFAULT_KEEP_LOG)
    assert defaults["gpu_gate"] is jobspec.DEFAULT_GPU_GATE is False  # experimental: opt-in


@pytest.mark.parametrize("name", ["recovery_timeout", "heartbeat_interval", "keep_log", "gpu_gate"])
def test_the_worker_environment_uses_the_specs_defaults(name):
    bare = WorkerEnv(rank=0, local_rank=0, world_size=1, master_addr="h", master_port=1)
    assert getattr(bare, name) == _field_default(name)
    # and so does a worker that finds nothing in its environment
    assert getattr(WorkerEnv.from_environ({}), name) == _field_default(name)


def test_the_worker_environment_is_built_from_the_spec():
    faults = [
        {"kind": "kill", "rank": 3, "step": 2, "at": "backward", "code": 1, "to": None},
        {"kind": "hang", "rank": 3, "step": 5, "at": "forward", "code": 1, "to": None},
        {"kind": "migrate", "rank": 3, "step": 4, "at": "boundary", "code": 1, "to": 0},
        {"kind": "kill", "rank": 1, "step": 2, "at": "backward", "code": 1, "to": None},
    ]
    spec = _spec(nnodes=2, nproc_per_node=2, master_port=29500, faults=faults,
                 recovery_timeout=30.0, keep_log=False, log_level="DEBUG")  # fmt: skip
    env = WorkerEnv.for_rank(spec, 3, 1, node_rank=1, token="t", agent_addr="127.0.0.1:5",
                             attempt=2, generation=4, fired=[faults[0]])  # fmt: skip
    assert (env.rank, env.local_rank, env.world_size, env.nnodes, env.local_world_size) == (
        3, 1, 4, 2, 2
    )  # fmt: skip
    assert (env.master_port, env.job_id, env.attempt, env.generation) == (29500, "j1", 2, 4)
    assert (env.recovery_timeout, env.keep_log, env.log_level) == (30.0, False, "DEBUG")
    # its own faults, less the fired one and the migration (the coordinator's to carry out)
    assert [f.kind for f in env.faults] == ["hang"]
    environ = env.to_environ()
    assert environ[LOG_LEVEL] == "DEBUG"
    assert WorkerEnv.from_environ(environ) == env


def test_a_worker_after_a_resize_has_the_world_of_now_and_its_launch_rank_faults():
    faults = [
        {"kind": "kill", "rank": 2, "step": 6, "at": "backward", "code": 1, "to": None},
        {"kind": "kill", "rank": 1, "step": 9, "at": "backward", "code": 1, "to": None},
    ]
    spec = _spec(nnodes=3, nproc_per_node=1, faults=faults)
    # rank 1 of a world shrunk to 2, launched as rank 2: rank 2's faults, not rank 1's
    env = WorkerEnv.for_rank(spec, 1, 0, node_rank=2, attempt=1, world_size=2, launched_as=2)
    assert env.world_size == 2 and [f.step for f in env.faults] == [6]
    # a rank a grow added carries none
    added = WorkerEnv.for_rank(spec, 2, 0, node_rank=3, attempt=1, world_size=3, launched_as=-1)
    assert added.world_size == 3 and added.faults == [] and added.replacement


MIGRATE_TO_3 = {"kind": "migrate", "rank": 1, "step": 2, "at": "boundary", "to": 3}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 0}, "--nnodes must be at least 1, got 0"),
        ({"nproc_per_node": 0}, "--nproc-per-node must be at least 1, got 0"),
        ({"master_port": 65536}, "--master-port must be 0..65535, got 65536"),
        ({"master_port": -1}, "--master-port must be 0..65535, got -1"),
        ({"heartbeat_interval": 0.0}, "need 0 < --heartbeat-interval < --heartbeat-timeout"),
        (
            {"heartbeat_interval": 2.0, "heartbeat_timeout": 1.0},
            "need 0 < --heartbeat-interval < --heartbeat-timeout",
        ),
        ({"stop_grace": -0.1}, "--stop-grace must not be negative"),
        ({"recovery_timeout": 0.0}, "--recovery-timeout must be positive"),
        ({"max_recoveries": -1}, "--max-recoveries must not be negative"),
        ({"on_no_spare": "wait"}, "--on-no-spare must be stop or shrink, got 'wait'"),
        ({"min_world_size": 3}, "--min-world-size must be 1..2 (the world size), got 3"),
        ({"hot_spares": -1}, "--hot-spares must not be negative"),
        ({"spare_nodes": -1}, "--spare-nodes must not be negative"),
        ({"agent_connect_timeout": 0.0}, "the agents' connect timeout must be positive"),
        (
            {"log_level": "VERBOSE"},
            "--log-level must be one of DEBUG, INFO, WARNING, ERROR, got 'VERBOSE'",
        ),
        (
            {"faults": [{"kind": "kill", "rank": 2, "step": 1, "at": "backward"}]},
            "bad --inject: rank 2 does not exist in 'kill:rank=2:step=1:at=backward' "
            "(world size 2)",
        ),
        (
            {"faults": [MIGRATE_TO_3], "spare_nodes": 1},
            "bad --inject: node 3 does not exist in migrate:rank=1:step=2:at=boundary:to=3 "
            "(nodes 0..2)",
        ),
        ({"faults": [{"kind": "kill", "colour": "red"}]}, "bad --inject: not a fault"),
    ],
)
def test_every_check(fields, message):
    fields = {"nnodes": 2, **fields}
    with pytest.raises(JobSpecError) as caught:
        _spec(**fields)
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, ValueError)


def test_a_changed_spec_is_checked_again():
    spec = _spec()
    with pytest.raises(JobSpecError, match="--hot-spares must not be negative"):
        dataclasses.replace(spec, hot_spares=-1)
    assert dataclasses.replace(spec, master_port=1234).master_port == 1234
    assert spec.master_port == jobspec.DEFAULT_MASTER_PORT


def test_frozen():
    spec = _spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.master_port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.hot_spares = 0  # type: ignore[misc]
    # its sequences cannot be changed either
    assert isinstance(spec.args, tuple) and isinstance(spec.faults, tuple)
    with pytest.raises(AttributeError):
        spec.args.append("more")  # type: ignore[attr-defined]


def test_json_round_trip():
    faults = [{"kind": "kill", "rank": 1, "step": 2, "at": "backward", "code": 1, "to": None}]
    spec = _spec(nnodes=2, nproc_per_node=2, faults=faults, spare_nodes=1, hot_spares=0,
                 keep_log=False, log_level="WARNING", simulate_hosts=True)  # fmt: skip
    data = spec.to_json()
    assert data["world_size"] == 4
    assert data["args"] == ["--steps", "3"] and data["faults"] == faults
    assert JobSpec.from_json(data) == spec
    assert JobSpec.from_json(_spec().to_json()) == _spec()


def test_from_json_rejects_unknown_and_missing_fields():
    data = _spec().to_json()
    with pytest.raises(JobSpecError, match="unknown job spec field.*: colour, flavour"):
        JobSpec.from_json({**data, "flavour": 1, "colour": 2})
    del data["cwd"]
    with pytest.raises(JobSpecError, match="missing job spec field.*: cwd"):
        JobSpec.from_json(data)


def test_the_coordinator_imports_the_same_spec():
    assert CoordJobSpec is JobSpec
