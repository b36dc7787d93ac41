"""Small pure functions of the worker side."""

import pytest

from xmig.session import is_sticky_cuda_error


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: an illegal memory access was encountered",
        "RuntimeError: CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
    ],
)
def test_sticky_cuda_errors_need_a_new_process(text):
    assert is_sticky_cuda_error(text)


@pytest.mark.parametrize(
    "text",
    [
        "NCCL error in: ProcessGroupNCCL.cpp, remote process exited or there was a network error",
        "Connection reset by peer",
        "injected communication error in allreduce on rank 1 (simulated ncclRemoteError)",
        "Watchdog caught collective operation timeout",
    ],
)
def test_communication_errors_are_retried_in_place(text):
    assert not is_sticky_cuda_error(text)
