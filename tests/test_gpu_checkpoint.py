"""The CUDA checkpoint wrapper against a stand-in for ``cuda.bindings.driver`` (CI has no GPU):
the calls, their order, the GPU remapping and the errors; and which GPUs a simulated host
gets."""

import enum
import sys
import types

import pytest

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


def fake_driver(calls, fail=None):
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = CUresult
    for name in ("CUcheckpointLockArgs", "CUcheckpointRestoreArgs", "CUcheckpointGpuPair",
                 "CUuuid"):  # fmt: skip
        setattr(driver, name, type(name, (_Struct,), {}))

    def call(name):
        def run(*args):
            calls.append((name, args))
            return (CUresult.CUDA_ERROR_ILLEGAL_STATE if name == fail else CUresult.CUDA_SUCCESS,)

        return run

    for name in ("cuInit", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                 "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"):  # fmt: skip
        setattr(driver, name, call(name))
    driver.cuDeviceGet = lambda ordinal: (CUresult.CUDA_SUCCESS, ordinal)
    uuid = types.SimpleNamespace(bytes=bytes.fromhex(NEW[4:].replace("-", "")))
    driver.cuDeviceGetUuid = lambda _device: (CUresult.CUDA_SUCCESS, uuid)
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


def test_device_uuid_is_formatted_like_nvidia_smi(driver):
    driver()
    assert cuda.device_uuid(1) == NEW


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
    monkeypatch.setattr(hosts, "gpu_count", lambda: 0)
    assert "CUDA_VISIBLE_DEVICES" not in sim.environment(0)
    monkeypatch.setattr(hosts, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the user's choice stands
    assert "CUDA_VISIBLE_DEVICES" not in sim.environment(0)
