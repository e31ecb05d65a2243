"""Link construction details that need no second rank (the transfers themselves, including a
link that fails during one, run under mpiexec in tests/mpi_programs/comm_checks.py)."""

from __future__ import annotations

import datetime
import os
import types

import pytest

from rlinf_hpc.comm import links


def test_nccl_link_groups_report_errors_instead_of_tearing_the_process_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An NCCL link is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (its errors reach its work,
    which resends over MPI), and the job's own setting is restored afterwards."""
    seen = {}

    class Options:
        _timeout = None

    class FakeNCCL:
        def __init__(self, store: object, rank: int, size: int, options: Options) -> None:
            seen["handling"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            seen["timeout"] = options._timeout

    FakeNCCL.Options = Options  # type: ignore[attr-defined]
    monkeypatch.setattr(links, "_dist", lambda: types.SimpleNamespace(ProcessGroupNCCL=FakeNCCL))
    monkeypatch.setattr(links, "pin_socket_interfaces", lambda: None)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    links._make_group(links.NCCL, object(), 0, datetime.timedelta(seconds=7))
    assert seen == {"handling": "2", "timeout": datetime.timedelta(seconds=7)}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    links._make_group(links.NCCL, object(), 1, datetime.timedelta(seconds=7))
    assert seen["handling"] == "2" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


def test_a_resent_transfer_lands_in_a_tensor_like_the_link_buffer() -> None:
    """The bytes of a resend become a tensor of the link buffer's dtype and shape."""
    import torch

    from rlinf_hpc.comm.linkwork import from_resend
    from rlinf_hpc.comm.packing import pack

    for value in (torch.arange(12, dtype=torch.float16).reshape(3, 4), torch.tensor([True, False, True])):
        data = bytearray(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        node = pack(value)[0]
        got = from_resend(node, torch.empty_like(value), data)
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
