"""Context switching: bit-for-bit offload/onload in every mode, of raw states and of a model
with its optimizer mid-training."""

from __future__ import annotations

import copy

import pytest
import torch

from rlinf_hpc.scheduler.offload import ModuleSwitch, OffloadOptions, StateOffloader

MODES = ["none", "plain", "byte_planes", "delta"]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(300, 70, generator=g),
        "w16": torch.randn(500, generator=g).half(),
        "bf16": torch.randn(64, 33, generator=g).bfloat16(),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


@pytest.mark.parametrize("mode", MODES)
def test_offload_onload_is_bitwise_identical(mode: str) -> None:
    original = state()
    offloader = StateOffloader(OffloadOptions(mode=mode, threads=0))
    for step in range(3):  # delta mode: the 2nd and 3rd snapshots are XORs against the previous
        current = {k: (v + 0.001 * step if v.is_floating_point() else v) for k, v in original.items()}
        snapshot = offloader.offload(current)
        out = {k: torch.empty_like(v) for k, v in current.items()}
        restored = offloader.onload(snapshot, out=out)
        for name, tensor in current.items():
            assert restored[name] is out[name]
            assert torch.equal(bits(restored[name]), bits(tensor)), (mode, step, name)


def test_delta_compresses_small_changes_far_better_than_plain() -> None:
    weights = {"w": torch.randn(2_000_000).bfloat16()}
    nudged = {"w": (weights["w"].float() * (1 + 1e-3)).bfloat16()}
    plain = StateOffloader(OffloadOptions(mode="plain", threads=0))
    delta = StateOffloader(OffloadOptions(mode="delta", threads=0))
    delta.offload(weights)
    assert delta.offload(nudged).ratio > 2 * plain.offload(nudged).ratio


def test_module_and_optimizer_switch_mid_training() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(32, 8)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(data).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    step()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    twin, twin_optimizer = copy.deepcopy((model, optimizer))  # one copy keeps param <-> state links
    switch = ModuleSwitch(model, optimizer, OffloadOptions(mode="byte_planes", threads=0))
    snapshot = switch.offload()
    assert all(p.numel() == 0 for p in model.parameters())  # released
    assert all(p.grad is None for p in model.parameters())
    assert snapshot.raw_bytes > 0
    switch.onload()
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
    for p, grad in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, grad)
    # training continues exactly as if the switch had never happened
    losses = []
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.zero_grad()
        loss = m(data).pow(2).mean()
        loss.backward()
        o.step()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_switch_misuse_is_an_error() -> None:
    switch = ModuleSwitch(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="is not offloaded"):
        switch.onload()
    switch.offload()
    with pytest.raises(RuntimeError, match="is offloaded already"):
        switch.offload()
    with pytest.raises(ValueError, match="offload mode must be"):
        OffloadOptions(mode="lz4")  # type: ignore[arg-type]


def test_a_component_left_alone_on_its_rank_comes_back_from_the_host() -> None:
    """After a re-partition moved its neighbour away, a switched-out component is the only one
    on its rank: its next command must still switch it back in (it once kept empty weights)."""
    from rlinf_hpc.runtime.timeline import Timeline
    from rlinf_hpc.workers import Worker
    from rlinf_hpc.workers.timeshare import DeviceTimeShare

    class Holder(Worker):
        def __init__(self) -> None:
            self.model = torch.nn.Linear(4, 4)

        def switch_state(self) -> torch.nn.Module:
            return self.model

    a, b = Holder(), Holder()
    before = b.model.weight.detach().clone()
    share = DeviceTimeShare(Timeline(1))
    share.activate("a", {"a": a, "b": b}, "full", "none")  # b switched out
    assert b.model.weight.numel() == 0
    share.activate("b", {"b": b}, "full", "none")  # a left the rank
    assert torch.equal(b.model.weight, before)


def test_a_worker_that_moves_its_own_state_is_switched_out_and_back_in() -> None:
    """`Worker.switch_out`/`switch_in` (an engine's own sleep mode, an emulated device): called
    once per switch, the bytes it reports counted, and it is back before its next command."""
    from rlinf_hpc.runtime.timeline import Timeline
    from rlinf_hpc.workers import Worker
    from rlinf_hpc.workers.timeshare import DeviceTimeShare

    class Engine(Worker):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def switch_out(self) -> int:
            self.calls.append("out")
            return 1000

        def switch_in(self) -> None:
            self.calls.append("in")

    a, b = Engine(), Engine()
    share = DeviceTimeShare(Timeline(1))
    workers = {"a": a, "b": b}
    assert share.activate("a", workers, "full", "none") > 0  # b goes out
    share.activate("a", workers, "full", "none")  # nothing to do: b stays out, a stays in
    share.activate("b", workers, "full", "none")  # a out, b back in
    assert a.calls == ["out"] and b.calls == ["out", "in"]
    assert [(name, moved) for name, _, moved, _ in share.history] == [("a", 1000), ("b", 1000)]
    share.activate("a", workers, "light", "none")  # light: nobody moves
    assert a.calls == ["out", "in"] and b.calls == ["out", "in"]
