"""The CUDA checkpoint wrapper against a stand-in for ``cuda.bindings.driver`` (CI has no GPU):
the calls, their order, the GPU remapping and the errors; and which GPUs a simulated host
gets."""

import ctypes
import enum
import os
import sys
import types

import pytest

from xmig.coord.migration import gpu_conflict
from xmig.launch import hosts
from xmig.migrate import cuda

OLD = "GPU-075fc761-bcbf-6992-6301-3b581fdabe69"
NEW = "GPU-d2adea56-112a-60fd-af33-00fb5be551fd"


class CUresult(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_ILLEGAL_STATE = 401


class _Struct:
    def __init__(self):
        self.__dict__["fields"] = {}

    def __setattr__(self, name, value):
        self.fields[name] = value

    def __getattr__(self, name):
        return self.__dict__["fields"].get(name)


class _Uuid:
    """Like cuda-bindings' CUuuid: made over an address (or zeroed), ``bytes`` read-only."""

    def __init__(self, address=0):
        self._bytes = ctypes.string_at(address, 16) if address else bytes(16)

    @property
    def bytes(self):
        return self._bytes


def fake_driver(calls, fail=None):
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = CUresult
    for name in ("CUcheckpointLockArgs", "CUcheckpointRestoreArgs", "CUcheckpointGpuPair"):
        setattr(driver, name, type(name, (_Struct,), {}))
    driver.CUuuid = _Uuid

    def call(name):
        def run(*args):
            if name == "cuInit":  # what the driver would read then
                args = (os.environ.get("CUDA_VISIBLE_DEVICES"),)
            calls.append((name, args))
            return (CUresult.CUDA_ERROR_ILLEGAL_STATE if name == fail else CUresult.CUDA_SUCCESS,)

        return run

    for name in ("cuInit", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                 "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"):  # fmt: skip
        setattr(driver, name, call(name))
    driver.cuDeviceGet = lambda ordinal: (CUresult.CUDA_SUCCESS, ordinal)
    uuids = {i: types.SimpleNamespace(bytes=bytes.fromhex(u[4:].replace("-", "")))
             for i, u in enumerate([OLD, NEW])}  # fmt: skip
    driver.cuDeviceGetUuid = lambda device: (CUresult.CUDA_SUCCESS, uuids[device])
    driver.cuDeviceGetCount = lambda: (CUresult.CUDA_SUCCESS, len(uuids))
    return driver


@pytest.fixture
def driver(monkeypatch):
    calls = []

    def install(fail=None):
        module = fake_driver(calls, fail)
        bindings = types.ModuleType("cuda.bindings")
        bindings.driver = module
        monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", module)
        return calls

    return install


def _api_calls(calls):
    return [(name, args[0]) for name, args in calls if name != "cuInit"]


def test_save_locks_then_checkpoints(driver):
    calls = driver()
    checkpoint = cuda.GpuCheckpoint(4242)
    seconds = checkpoint.save()
    assert _api_calls(calls) == [("cuCheckpointProcessLock", 4242),
                                 ("cuCheckpointProcessCheckpoint", 4242)]  # fmt: skip
    lock_args = next(args[1] for name, args in calls if name == "cuCheckpointProcessLock")
    assert lock_args.timeoutMs == cuda.LOCK_TIMEOUT_MS
    assert set(checkpoint.times) == {"lock", "checkpoint"} and seconds >= 0


def test_load_remaps_onto_another_gpu_then_unlocks(driver):
    calls = driver()
    cuda.GpuCheckpoint(4242).load({OLD: NEW})
    assert _api_calls(calls) == [("cuCheckpointProcessRestore", 4242),
                                 ("cuCheckpointProcessUnlock", 4242)]  # fmt: skip
    args = next(args[1] for name, args in calls if name == "cuCheckpointProcessRestore")
    assert args.gpuPairsCount == 1
    (pair,) = args.gpuPairs
    assert pair.oldUuid.bytes.hex() == OLD[4:].replace("-", "")
    assert pair.newUuid.bytes.hex() == NEW[4:].replace("-", "")


def test_load_onto_the_same_gpu_passes_no_pairs(driver):
    calls = driver()
    cuda.GpuCheckpoint(7).load({OLD: OLD})
    args = next(args[1] for name, args in calls if name == "cuCheckpointProcessRestore")
    assert args is None


def test_a_failing_call_names_itself(driver):
    driver(fail="cuCheckpointProcessCheckpoint")
    with pytest.raises(cuda.GpuCheckpointError, match="checkpoint of PID 9 failed"):
        cuda.GpuCheckpoint(9).save()


def test_device_uuid_is_formatted_like_nvidia_smi(driver, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    driver()
    assert cuda.device_uuid(1) == NEW


def test_device_uuid_follows_the_nodes_visible_devices_while_the_driver_sees_all(
    driver, monkeypatch
):
    """An agent numbers its node's GPUs as its workers do, but its own driver sees every GPU
    (a restore names the GPU the process left, which may be another node's)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    calls = driver()
    assert cuda.device_uuid(0) == NEW and cuda.device_uuid(1) == OLD
    assert ("cuInit", (None,)) in calls
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0"  # put back for the workers it starts
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{OLD.lower()}")
    assert cuda.device_uuid(0) == OLD
    with pytest.raises(cuda.GpuCheckpointError, match="no CUDA device 1"):
        cuda.device_uuid(1)


def test_restore_arguments_carry_the_uuid_pair_in_the_real_bindings(monkeypatch):
    """cuda-bindings' own structures (they load without a GPU): the UUIDs reach the pair."""
    real = pytest.importorskip("cuda.bindings.driver")
    if not hasattr(real, "CUcheckpointGpuPair"):
        pytest.skip("this cuda-bindings has no checkpoint API")
    pair = real.CUcheckpointGpuPair()
    cuda._set_uuid(real, pair, "oldUuid", OLD)
    cuda._set_uuid(real, pair, "newUuid", NEW.removeprefix("GPU-"))
    args = real.CUcheckpointRestoreArgs()
    args.gpuPairs = [pair]
    assert cuda.canonical_uuid(bytes(args.gpuPairs[0].oldUuid.bytes).hex()) == OLD
    assert cuda.canonical_uuid(bytes(args.gpuPairs[0].newUuid.bytes).hex()) == NEW


def test_machine_gpus_lists_every_gpu(driver, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    driver()
    assert cuda.machine_gpus() == [OLD, NEW]


def _gpu(i):
    return f"GPU-{i:08x}-0000-0000-0000-000000000000"


def test_restore_pairs_are_one_to_one_and_cover_every_gpu_the_process_knew():
    four = [_gpu(i) for i in range(4)]
    # same machine, GPU 1 -> GPU 2: the two swap, the others stay (measured: the driver wants
    # a pair for every GPU, and refuses a single pair)
    assert cuda.restore_pairs(four[1], four[2], four, four) == {
        four[1]: four[2],
        four[0]: four[0],
        four[2]: four[1],
        four[3]: four[3],
    }
    assert cuda.restore_pairs(four[1], four[1], four, four) == {}  # no move: no pairs
    # another machine with other GPUs: one each, in order
    other = [_gpu(10 + i) for i in range(4)]
    pairs = cuda.restore_pairs(four[3], other[0], four, other)
    assert pairs[four[3]] == other[0] and sorted(pairs.values()) == sorted(other)
    assert set(pairs) == set(four)
    # torch's UUID form is accepted; an unknown list means the process knew its GPU only
    assert cuda.restore_pairs(four[1][4:], four[2], [], four) == {four[1]: four[2]}
    with pytest.raises(cuda.GpuCheckpointError, match="too few GPUs"):
        cuda.restore_pairs(four[0], other[0], four, other[:2])


def test_node_gpus_follow_the_visible_devices(driver, monkeypatch, tmp_path):
    monkeypatch.setattr(cuda, "NVIDIA_GPUS_DIR", tmp_path / "absent")
    assert cuda.node_gpus() == []  # no driver: no GPUs, and no CUDA call
    monkeypatch.setattr(cuda, "NVIDIA_GPUS_DIR", tmp_path)
    driver()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda.node_gpus() == [OLD, NEW]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert cuda.node_gpus() == [NEW]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{OLD},7,0")  # CUDA stops at a bad entry
    assert cuda.node_gpus() == [OLD]


def test_a_migration_onto_a_gpu_another_rank_holds_is_refused():
    gpus = {0: [_gpu(0)], 1: [_gpu(1)], 2: [_gpu(2)], 3: [_gpu(0)]}
    nodes = {0: 0, 1: 1}
    assert gpu_conflict(1, 2, nodes, gpus, 1) is None  # an idle GPU
    problem = gpu_conflict(1, 3, nodes, gpus, 1)  # node 3 shares GPU 0 with rank 0
    assert "in use by rank 0" in problem and _gpu(0) in problem
    assert gpu_conflict(1, 2, nodes, {}, 1) is None  # a CPU job: nothing to check
    # two ranks a node: rank 3 (local 1) onto node 2's second GPU, which rank 1 holds
    two = {0: [_gpu(0), _gpu(1)], 1: [_gpu(2), _gpu(3)], 2: [_gpu(4), _gpu(1)]}
    assert "rank 1" in gpu_conflict(3, 2, {0: 0, 1: 0, 2: 1, 3: 1}, two, 2)
    assert gpu_conflict(2, 2, {0: 0, 1: 0, 2: 1, 3: 1}, two, 2) is None


def test_uuids_from_pytorch_and_nvidia_smi_are_one_form():
    torch_form = NEW.removeprefix("GPU-")  # str(torch.cuda.get_device_properties(i).uuid)
    assert cuda.canonical_uuid(torch_form) == NEW == cuda.canonical_uuid(NEW)
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cuda.canonical_uuid("GPU-1234")


def test_missing_cuda_bindings_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(cuda.GpuCheckpointError, match="cuda-bindings is not installed"):
        cuda.GpuCheckpoint(1).save()


def test_simulated_hosts_split_the_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hosts, "gpu_count", lambda: 2)
    sim = hosts.SimulatedHosts("job", count=3, gpus_per_node=1)
    assert [sim.environment(n)["CUDA_VISIBLE_DEVICES"] for n in range(3)] == ["0", "1", "0"]
    two = hosts.SimulatedHosts("job", count=2, gpus_per_node=2)
    assert two.environment(1)["CUDA_VISIBLE_DEVICES"] == "0,1"
    # one GPU, a job of one node and a spare one: the spare node has the same GPU, which a
    # rank migrated there finds free once it was checkpointed (measured on one H200:
    # bench/results/gpu-speed.md)
    monkeypatch.setattr(hosts, "gpu_count", lambda: 1)
    one = hosts.SimulatedHosts("job", count=2, gpus_per_node=1)
    assert [one.environment(n)["CUDA_VISIBLE_DEVICES"] for n in range(2)] == ["0", "0"]
    monkeypatch.setattr(hosts, "gpu_count", lambda: 2)
    # each node is a host of its own to NCCL (its same-host transports need one namespace)
    assert len({sim.environment(n)["NCCL_HOSTID"] for n in range(3)}) == 3
    assert sim.environment(0)["NCCL_IB_DISABLE"] == "1"
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")
    assert "NCCL_IB_DISABLE" not in sim.environment(0)
    monkeypatch.setattr(hosts, "gpu_count", lambda: 0)
    assert "CUDA_VISIBLE_DEVICES" not in sim.environment(0)
    monkeypatch.setattr(hosts, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the user's choice stands
    assert "CUDA_VISIBLE_DEVICES" not in sim.environment(0)


def test_nvml_is_initialised_once_for_every_query(monkeypatch):
    """Each move asks NVML what the moving process holds; NVML starts once per process (its
    start and shutdown around every query cost a move about 40 ms) and is never shut down."""
    calls = []

    class NVMLError(Exception):
        pass

    proc = types.SimpleNamespace(pid=42, usedGpuMemory=7 << 20)
    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(f"handle {uuid}") or uuid,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [proc],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(cuda, "_nvml", None)
    gpu = "GPU-00000000-0000-0000-0000-000000000001"
    assert cuda.process_gpu_bytes(42, gpu) == 7 << 20
    assert cuda.process_gpu_bytes(43, gpu) == 0  # holds nothing there
    assert calls == ["init", f"handle {gpu}", f"handle {gpu}"]

    def broken(handle):
        raise NVMLError("gone")

    fake.nvmlDeviceGetComputeRunningProcesses = broken
    assert cuda.process_gpu_bytes(42, gpu) is None  # an error is "cannot tell", not a failure
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    monkeypatch.setattr(cuda, "_nvml", None)
    assert cuda.process_gpu_bytes(42, gpu) is None
