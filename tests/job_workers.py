"""Workers and flows used by the multi-rank tests (imported on every rank via PYTHONPATH)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.apps.embodied import APP as EMBODIED_APP
from rlinf_hpc.apps.math import APP as MATH_APP
from rlinf_hpc.errors import UserError
from rlinf_hpc.scheduler import Coordinator
from rlinf_hpc.workers import Worker


class ProbeWorker(Worker):
    """Methods that let tests see what happened on the rank."""

    def setup(self, marker: str = "") -> None:
        self.marker = marker
        self.calls = 0

    def echo(self, value: Any) -> Any:
        self.calls += 1
        return {"rank": self.rank, "value": value, "calls": self.calls, "marker": self.marker}

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def fail_on(self, world_rank: int, message: str) -> None:
        """Raise on world rank ``world_rank`` only (the others return)."""
        if self.rank == world_rank:
            raise ValueError(message)

    def sleep(self, seconds: float) -> float:
        start = time.process_time()
        time.sleep(seconds)
        return time.process_time() - start

    def cpu_seconds(self) -> float:
        """CPU time (user+sys) this rank's process has used so far."""
        times = os.times()
        return times.user + times.system

    def group_broadcast(self, value: Any) -> Any:
        """A broadcast from group rank 0 over this component (every member must call it)."""
        return self.comm.broadcast(value, (self.component, 0), self.component)

    def sleep_then_send(self, seconds: float, value: Any) -> None:
        time.sleep(seconds)
        self.comm.send(value, (self.component, 1), tag="late")

    def receive_late(self) -> Any:
        return self.comm.recv((self.component, 0), tag="late")

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def pid(self) -> int:
        return os.getpid()

    def segfault(self) -> None:
        """Crash below Python, as a buggy C extension does."""
        import ctypes

        ctypes.string_at(0)

    def hold_memory(self, cgroup: str, megabytes: int, hold_s: float) -> int:
        """Move into the memory cgroup ``cgroup``, hold ``megabytes`` of touched memory for
        ``hold_s`` seconds, let it go."""
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
        held = bytearray(b"\x01") * (megabytes << 20)
        time.sleep(hold_s)
        return len(held) >> 20

    def exhaust_memory(self, cgroup: str, settle_s: float) -> None:
        """Move into the memory cgroup ``cgroup`` (the test made it, with a small limit), let a
        heartbeat or two record it, then allocate until the kernel's OOM killer ends this rank."""
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
        time.sleep(settle_s)
        hoard = []
        while True:
            hoard.append(bytearray(b"\x01") * (16 << 20))  # touched: every page is charged


def _cpu_of_all(coordinator: Coordinator) -> float:
    own = os.times().user + os.times().system
    workers = sum(
        sum(coordinator.group(name).call("cpu_seconds").result()) for name in coordinator.placement.groups
    )
    return own + workers


def idle_flow(coordinator: Coordinator) -> dict[str, float]:
    """One worker sleeps 3 s; everyone else idles. Returns the CPU share used meanwhile."""
    first = next(iter(coordinator.placement.groups))
    before = _cpu_of_all(coordinator)
    start = time.monotonic()
    coordinator.group(first).subset([0]).call("sleep", 3.0).result()
    wall = time.monotonic() - start
    used = _cpu_of_all(coordinator) - before
    print(f"IDLE_CPU_FRACTION {used / wall:.4f}", flush=True)
    return {"cpu_fraction": used / wall}


def oom_flow(coordinator: Coordinator) -> None:
    """Alpha's rank runs out of its memory cgroup's limit (RLINF_TEST_OOM_CGROUP)."""
    cgroup = coordinator.group("beta").call("getenv", "RLINF_TEST_OOM_CGROUP").result()[0]
    coordinator.group("alpha").call("exhaust_memory", cgroup, 1.0).result(timeout=120)


def crash_flow(coordinator: Coordinator) -> None:
    """Alpha's rank crashes below Python (SIGSEGV)."""
    coordinator.group("alpha").call("segfault").result(timeout=120)


def memory_pressure_flow(coordinator: Coordinator) -> int:
    """Alpha's rank holds 170 MB of its memory cgroup's 200 MB (RLINF_TEST_OOM_CGROUP) a while."""
    cgroup = coordinator.group("beta").call("getenv", "RLINF_TEST_OOM_CGROUP").result()[0]
    return coordinator.group("alpha").call("hold_memory", cgroup, 170, 2.0).result(timeout=120)[0]


def failing_flow(coordinator: Coordinator) -> None:
    """A worker method raises; the flow does not catch it."""
    coordinator.group("beta").call("fail", "boom from the test").result()


def hanging_flow(coordinator: Coordinator) -> None:
    """A worker runs far longer than job.call_timeout_s allows."""
    coordinator.group("alpha").call("sleep", 120.0).result()


def signal_flow(coordinator: Coordinator) -> None:
    """Print every pid, then wait forever in a worker call (the test sends a signal)."""
    pids = [os.getpid()]
    for name in coordinator.placement.groups:
        pids += coordinator.group(name).call("pid").result()
    busy = coordinator.group("alpha").call("sleep", 120.0)  # sent before the test may signal
    print("PIDS " + " ".join(map(str, pids)), flush=True)
    busy.result(timeout=300)


def fault_flow(coordinator: Coordinator) -> None:
    """`signal_flow`, with the fault PROBE_FAULT names done by the job itself: ``raise:N`` (rank
    N's worker raises in a call; rank 0: the flow raises)."""
    fault = os.environ.get("PROBE_FAULT", "")
    if not fault.startswith("raise:"):
        return signal_flow(coordinator)
    pids = [os.getpid()]
    for name in coordinator.placement.groups:
        pids += coordinator.group(name).call("pid").result()
    print("PIDS " + " ".join(map(str, pids)), flush=True)
    rank = int(fault.split(":")[1])
    if rank == 0:
        raise RuntimeError("boom on the coordinator, from the test")
    name = next(n for n, ranks in coordinator.placement.groups.items() if rank in ranks)
    coordinator.group(name).call("fail_on", rank, "boom from the test").result(timeout=120)
    return None


def repartition_flow(coordinator: Coordinator) -> dict[str, Any]:
    """Move a rank from beta to alpha and check both groups' new communicators work."""
    before = {
        name: coordinator.group(name).call("group_check").result() for name in coordinator.placement.groups
    }
    coordinator.group("alpha").call("echo", 1).result()
    alpha, beta = coordinator.placement.ranks_of("alpha"), coordinator.placement.ranks_of("beta")
    moved = beta[-1]
    coordinator.repartition({"alpha": alpha + [moved], "beta": beta[:-1]})
    after = {
        name: coordinator.group(name).call("group_check").result() for name in coordinator.placement.groups
    }
    echoes = coordinator.group("alpha").call("echo", 2).result()
    result = {
        "before": before,
        "after": after,
        "echoes": echoes,
        "moved": moved,
        "placement": coordinator.placement.groups,
    }
    print("REPARTITION " + repr(result), flush=True)
    return result


def check_flow(coordinator: Coordinator) -> dict[str, Any]:
    """Every group runs its communicator check; the result is printed as one line."""
    result = {
        name: coordinator.group(name).call("group_check").result() for name in coordinator.placement.groups
    }
    print("CHECK " + repr(result), flush=True)
    return result


class PeerWorker(ProbeWorker):
    """Talks to other workers directly through the data plane."""

    def send_to(self, component: str, group_rank: int, payload: Any, tag: str = "peer") -> int:
        self.comm.send({"from": self.rank, "payload": payload}, (component, group_rank), tag=tag)
        return self.rank

    def receive_from(self, component: str, group_rank: int, tag: str = "peer") -> Any:
        return self.comm.recv((component, group_rank), tag=tag, timeout=60)

    def ring_sum(self, value: int) -> int:
        """Sum over the group with the data plane's collectives (members by component name)."""
        values = self.comm.gather(value, (self.component, 0), self.component, timeout=60)
        total = sum(values) if values is not None else None
        return self.comm.broadcast(total, (self.component, 0), self.component, timeout=60)


def peer_flow(coordinator: Coordinator) -> dict[str, Any]:
    """alpha:0 sends a tensor to beta:0 by address; then ranks move and talk again."""
    import torch

    alpha, beta = coordinator.group("alpha"), coordinator.group("beta")
    receiving = beta.subset([0]).call("receive_from", "alpha", 0)
    alpha.subset([0]).call("send_to", "beta", 0, torch.arange(6).reshape(2, 3)).result()
    first = receiving.result()[0]
    sums = beta.call("ring_sum", 1).result()
    moved = coordinator.placement.ranks_of("beta")[-1]
    coordinator.repartition(
        {
            "alpha": coordinator.placement.ranks_of("alpha") + [moved],
            "beta": coordinator.placement.ranks_of("beta")[:-1],
        }
    )
    # the moved rank is now alpha:1 and talks to beta:0 under its new address
    receiving = beta.subset([0]).call("receive_from", "alpha", 1, "after")
    alpha.subset([1]).call("send_to", "beta", 0, "hello from a new member", "after").result()
    second = receiving.result()[0]
    to_coordinator = alpha.subset([0]).call("send_to", "coordinator-check", 0, 1)
    try:
        to_coordinator.result()
        gone = "no error"
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        gone = str(exc)
    result = {
        "first": {"from": first["from"], "payload": first["payload"].tolist()},
        "sums": sums,
        "second": second,
        "moved": moved,
        "gone": gone,
        "alpha": coordinator.placement.ranks_of("alpha"),
    }
    print("PEER " + repr(result), flush=True)
    return result


class ChannelWorker(ProbeWorker):
    """Produces numbered items into channel 'work', or consumes them."""

    def produce(self, start: int, stop: int, close: bool = False, name: str = "work") -> int:
        channel = self.channel(name)
        for i in range(start, stop):
            channel.put({"i": i}, weight=1 + i % 3)
        if close:
            channel.close()
        return stop - start

    def consume(self, count: int) -> list[int]:
        channel = self.channel("work")
        return [channel.get(timeout=60)["i"] for _ in range(count)]

    def make_channel(self, name: str, producers: str, consumers: str, count: int) -> int | str:
        """Declare a channel from inside this method, fill it and close it."""
        try:
            channel = self.create_channel(name, producers, consumers)
        except UserError as exc:
            return str(exc)
        for i in range(count):
            channel.put({"i": i})
        channel.close()
        return count

    def double(self, batch: list[int]) -> list[int]:
        """A pipeline stage: each item times two."""
        return [2 * x for x in batch]

    def drain(self, name: str = "work") -> list[int]:
        from rlinf_hpc.channel import EndOfStream

        channel = self.channel(name)
        taken = []
        while True:
            try:
                taken.append(channel.get(timeout=60)["i"])
            except EndOfStream:
                return taken


def worker_channel_flow(coordinator: Coordinator) -> dict[str, Any]:
    """A worker declares a channel while it runs; the consumers use it in their next call."""
    producer, consumer = coordinator.group("producer"), coordinator.group("consumer")
    bad = producer.call("make_channel", "dyn", "nobody", "consumer", 0).result()[0]
    made = producer.call("make_channel", "dyn", "producer", "consumer", 30).result()[0]
    again = producer.call("make_channel", "dyn", "producer", "consumer", 0).result()[0]
    taken = sorted(i for part in consumer.call("drain", "dyn").result() for i in part)
    result = {"bad": bad, "made": made, "again": again, "taken": taken}
    print("DYN " + repr(result), flush=True)
    return result


def busy_consumer_flow(coordinator: Coordinator) -> dict[str, Any]:
    """Three pipeline steps whose streams reach a consumer rank busy with another command: the
    producer's items arrive before that rank has taken the step's stream declarations (sent
    without waiting), so they wait in its data plane until its stage asks for them."""
    from rlinf_hpc.scheduler import Pipeline

    pipe = Pipeline(coordinator, "busy").stage("producer", "double").stage("consumer", "double")
    outputs, seconds = [], []
    for step in range(3):
        busy = coordinator.group("consumer").call("sleep", 0.5)  # queued before the declarations
        result = pipe.run(list(range(step * 50, (step + 1) * 50)))
        busy.result()
        outputs.append(sorted(result.outputs))
        seconds.append(result.seconds)
    pipe.close()
    report = {"outputs": outputs, "seconds": seconds}
    print("BUSY " + repr(report), flush=True)
    return report


def lost_in_background_flow(coordinator: Coordinator) -> dict[str, Any]:
    """A channel removed without waiting while items sent into it were never taken: the ranks'
    failure to take the update (`LostItemsError`) must fail the job, though every call the flow
    waits for afterwards succeeds."""
    coordinator.create_channel("leftover", "producer", "consumer")
    coordinator.group("producer").call("produce", 0, 5, False, "leftover").result()
    coordinator.update_channels({}, remove=["leftover"], wait=False)
    coordinator.group("consumer").call("echo", 1).result()
    return {"done": True}


def late_channel_flow(coordinator: Coordinator) -> dict[str, Any]:
    """A channel declared by the flow while the job runs; bad declarations are refused."""
    errors = []
    for bad in (
        {"producers": "nobody", "consumers": "consumer"},
        {"producers": "producer", "consumers": "consumer", "capacity": 0},
    ):
        try:
            coordinator.create_channel("bad", **bad)
        except UserError as exc:
            errors.append(str(exc))
    coordinator.create_channel("late", "producer", "consumer", policy="shortest_queue")
    producer, consumer = coordinator.group("producer"), coordinator.group("consumer")
    drained = consumer.call("drain", "late")
    producer.call("produce", 0, 40, True, "late").result()
    taken = sorted(i for part in drained.result() for i in part)
    result = {"taken": taken, "errors": errors}
    print("LATE " + repr(result), flush=True)
    return result


def channel_flow(coordinator: Coordinator) -> dict[str, Any]:
    """Items flow producer -> 3 consumers; a consumer leaves mid-stream; nothing is lost."""
    producer, consumer = coordinator.group("producer"), coordinator.group("consumer")
    first = producer.call("produce", 0, 150)
    taken = consumer.call("consume", 20)
    first.result()
    consumed = [i for part in taken.result() for i in part]
    leaving = coordinator.placement.ranks_of("consumer")[-1]
    coordinator.repartition(
        {
            "consumer": coordinator.placement.ranks_of("consumer")[:-1],
            "spare": coordinator.placement.ranks_of("spare") + [leaving],
        }
    )
    second = producer.call("produce", 150, 300, True)
    drained = consumer.call("drain")
    second.result()
    consumed += [i for part in drained.result() for i in part]
    spare_index = coordinator.placement.ranks_of("spare").index(leaving)
    handed_over = coordinator.group("spare").subset([spare_index]).call("channel_stats", "work").result()[0]
    result = {
        "count": len(consumed),
        "unique": len(set(consumed)),
        "min": min(consumed),
        "max": max(consumed),
        "leaving": leaving,
        "forwarded": handed_over["forwarded_items"],
        "producer": producer.call("channel_stats", "work").result()[0],
    }
    coordinator.record("channel_stats", **result["producer"])
    print("CHANNEL " + repr(result), flush=True)
    return result


_MODELS: dict[str, Any] = {}  # every model of this rank, to see who is resident while one runs


class ModelWorker(ProbeWorker):
    """A small model + optimizer that context switches move off the device and back."""

    def setup(self, marker: str = "") -> None:
        import torch

        super().setup(marker)
        torch.manual_seed(self.rank_seed() + len(self.component))
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.caches_released = 0
        _MODELS[self.component] = self.model

    def switch_state(self) -> Any:
        return self.model, self.optimizer

    def release_caches(self) -> None:
        self.caches_released += 1

    def train_step(self) -> dict[str, Any]:
        import torch

        self.optimizer.zero_grad()
        loss = self.model(torch.ones(8, 64)).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        return self.resident()

    def fingerprint(self) -> dict[str, Any]:
        import hashlib

        digest = hashlib.sha256()
        for param in self.model.parameters():
            digest.update(param.detach().numpy().tobytes())
        for state in self.optimizer.state.values():
            for value in state.values():
                digest.update(value.detach().numpy().tobytes())
        return {"sha": digest.hexdigest(), **self.resident()}

    def resident(self) -> dict[str, Any]:
        return {
            "numel": {name: sum(p.numel() for p in m.parameters()) for name, m in _MODELS.items()},
            "caches_released": self.caches_released,
        }


def switch_flow(coordinator: Coordinator) -> dict[str, Any]:
    """alpha and beta share rank 1: each call makes its component resident, the other leaves."""
    alpha, beta = coordinator.group("alpha"), coordinator.group("beta")
    alpha.call("train_step").result()
    before = alpha.call("fingerprint").result()[0]
    during_beta = beta.call("train_step").result()[0]
    after = alpha.call("fingerprint").result()[0]
    result = {"before": before, "during_beta": during_beta, "after": after}
    print("SWITCH " + repr(result), flush=True)
    return result


def grpo_digest_flow(coordinator: Coordinator) -> Any:
    """The math GRPO flow, then every policy holder's parameter digest."""
    from rlinf_hpc.apps.math.flow import math_grpo_flow

    result = math_grpo_flow(coordinator)
    _print_digests(coordinator)
    return result


def _print_digests(coordinator: Coordinator) -> None:
    import json

    digests = {
        n: coordinator.group(n).call("parameter_digest").result() for n in ("actor", "rollout", "inference")
    }
    print("DIGESTS " + json.dumps(digests), flush=True)


def grpo_interrupt_flow(coordinator: Coordinator) -> Any:
    """The math GRPO flow, interrupted once step ``flow.options.after_step`` finished:
    ``interrupt = "usr2"`` sends SIGUSR2 to the coordinator (the SLURM signal's path: save at
    that step boundary and stop); ``"term"`` lets the next step start and then sends SIGTERM to
    every rank, as scancel does (``checkpoint.sigterm_save_s``: saved at the next boundary);
    ``"kill"`` lets the next step start and then kills the
    ``flow.options.victim`` component's rank 0 with SIGKILL (mid-step). Prints the digests at
    the end, as `grpo_digest_flow` does."""
    import signal
    import threading

    from rlinf_hpc.apps.math.flow import math_grpo_flow
    from rlinf_hpc.runtime.checkpoint.manager import checkpoints_of

    options = coordinator.config.flow.options
    after, how = int(options["after_step"]), options["interrupt"]
    checkpoints = checkpoints_of(coordinator)
    original = checkpoints.step_finished
    victim = coordinator.group(options.get("victim", "actor")).call("describe").result()[0]["pid"]
    every_pid = sorted(  # once each: a second SIGTERM stops at once
        {os.getpid()}
        | {
            d["pid"]
            for name in coordinator.placement.groups
            for d in coordinator.group(name).call("describe").result()
        }
    )

    def step_finished(step: int, *args: Any, **kwargs: Any) -> None:
        first_run = checkpoints.resumed_step == 0
        if first_run and step == after and how == "usr2":
            os.kill(os.getpid(), signal.SIGUSR2)
        original(step, *args, **kwargs)
        if first_run and step == after and how == "kill":
            threading.Timer(float(options.get("delay_s", 0.05)), os.kill, (victim, signal.SIGKILL)).start()
        if first_run and step == after and how == "term":
            threading.Timer(float(options.get("delay_s", 0.05)), _terminate, (every_pid,)).start()

    def _terminate(pids: list[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)

    checkpoints.step_finished = step_finished  # type: ignore[method-assign]
    force = options.get("force_auto")
    if force in ("disaggregated", "revert"):  # the tiny job would mostly stay collocated
        from rlinf_hpc.scheduler import autoplace

        def forced(measured: Any) -> Any:
            def predict(*args: Any, **kwargs: Any) -> Any:
                prediction = measured(*args, **kwargs)
                return dataclasses.replace(prediction, collocated=2 * prediction.disaggregated + 1.0)

            return predict

        autoplace.predict = forced(autoplace.predict)  # type: ignore[assignment]
        autoplace.predict_ahead = forced(autoplace.predict_ahead)  # type: ignore[assignment]
        if force == "revert":  # and measured slower than the warm-up: auto moves back
            verify = autoplace.AutoPlacement._verify

            def slower(self: Any, members: Any) -> None:
                self.warmup_s = 0.0
                verify(self, members)

            autoplace.AutoPlacement._verify = slower  # type: ignore[method-assign]
    result = math_grpo_flow(coordinator)
    _print_digests(coordinator)
    return result


# The math app with a test's flow around its own: same sections, checks and checkpoint keys
# (how a user extends an app: `dataclasses.replace` of its App).
GRPO_DIGEST = dataclasses.replace(MATH_APP, name="grpo_digest", flow="job_workers:grpo_digest_flow")
GRPO_INTERRUPT = dataclasses.replace(MATH_APP, name="grpo_interrupt", flow="job_workers:grpo_interrupt_flow")


class LeakyWorker(ProbeWorker):
    """A stage that keeps ``leak_mb`` MB (written, so resident) per call: a leak of known rate."""

    def setup(self, marker: str = "", leak_mb: float = 0.0) -> None:
        super().setup(marker)
        self.kept: list[bytes] = []
        self.leak_mb = leak_mb

    def leak(self, batch: list[Any]) -> list[Any]:
        self.kept.append(b"\x01" * int(self.leak_mb * 2**20))
        time.sleep(0.25)  # longer than a heartbeat: every step sees a fresh figure
        return batch


def leak_flow(coordinator: Coordinator) -> dict[str, Any]:
    """30 one-item pipeline steps through alpha's `leak`."""
    from rlinf_hpc.scheduler import Pipeline

    pipe = Pipeline(coordinator, "leak")
    pipe.stage("alpha", "leak")
    for step in range(30):
        pipe.run([step])
    pipe.close()
    return {"steps": 30}


class SlowWorker(ProbeWorker):
    """A stage that sleeps ``delay`` s per item, ``factor`` times longer on group rank 1."""

    def setup(self, marker: str = "", delay: float = 0.01, factor: float = 3.0) -> None:
        super().setup(marker)
        self.delay = delay * (factor if self.group_rank == 1 else 1.0)

    def work(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.delay * len(batch))
        return batch


def straggler_flow(coordinator: Coordinator) -> dict[str, Any]:
    """12 steps of 8 items through alpha's `work` (two ranks, one slow)."""
    from rlinf_hpc.scheduler import Pipeline

    pipe = Pipeline(coordinator, "work")
    pipe.stage("alpha", "work")
    for step in range(12):
        pipe.run(list(range(8 * step, 8 * step + 8)))
    pipe.close()
    return {"steps": 12}


def embodied_interrupt_flow(coordinator: Coordinator) -> Any:
    """The embodied PPO flow; the first run sends SIGUSR2 to the coordinator once iteration
    ``flow.options.after_step`` finished (save at that boundary and stop)."""
    import signal

    from rlinf_hpc.apps.embodied.flow import embodied_ppo_flow
    from rlinf_hpc.runtime.checkpoint.manager import checkpoints_of

    after = int(coordinator.config.flow.options["after_step"])
    checkpoints = checkpoints_of(coordinator)
    original = checkpoints.step_finished

    def step_finished(step: int, *args: Any, **kwargs: Any) -> None:
        if checkpoints.resumed_step == 0 and step == after:
            os.kill(os.getpid(), signal.SIGUSR2)
        original(step, *args, **kwargs)

    checkpoints.step_finished = step_finished  # type: ignore[method-assign]
    return embodied_ppo_flow(coordinator)


EMBODIED_INTERRUPT = dataclasses.replace(
    EMBODIED_APP, name="embodied_interrupt", flow="job_workers:embodied_interrupt_flow"
)


def gpu_flow(coordinator: Coordinator) -> None:
    """test_gpu_health: start the fake NVML's story (90 °C until 4 s, XID 79 at 6 s) once the
    ranks are up, time the first call (it waits for the GPU to cool), then keep working."""
    scenario = Path(os.environ["FAKE_NVML_SCENARIO"])
    story = [[0, {"temp_c": 90}], [4, {"temp_c": 70}], [6, {"xids": [79]}]]
    scenario.write_text(json.dumps({"gpus": 1, "t0": time.time(), "changes": story}))
    time.sleep(1.5)  # the workers' guards read 90 °C (they poll every 0.5 s)
    started = time.monotonic()
    coordinator.group("alpha").call("echo", 1).result()
    first_call_s = time.monotonic() - started
    nccl_file = coordinator.group("alpha").call("getenv", "NCCL_DEBUG_FILE").result()
    record = {"first_call_s": first_call_s, "nccl_debug_file": nccl_file}
    (coordinator.run_dir / "gpu_flow.json").write_text(json.dumps(record))
    for _ in range(60):  # the XID ends the job
        coordinator.group("alpha").call("sleep", 0.5).result()


def stuck_flow(coordinator: Coordinator) -> None:
    """alpha's group rank 1 enters a broadcast that group rank 0 never calls (it stays idle)."""
    coordinator.group("alpha").subset([1]).call("group_broadcast", None).result()


def late_send_flow(coordinator: Coordinator) -> Any:
    """alpha's group rank 1 waits 4 s for a message while group rank 0 works (sleeps), then sends."""
    alpha = coordinator.group("alpha")
    receive = alpha.subset([1]).call("receive_late")
    alpha.subset([0]).call("sleep_then_send", 4.0, "late").result()
    return receive.result()


def embodied_auto_flow(coordinator: Coordinator) -> Any:
    """The embodied PPO flow with auto's comparison decided by ``flow.options.force``
    ("shared" or "split" looks twice as fast as the other), so that each way out is tested."""
    from rlinf_hpc.apps.embodied import placement
    from rlinf_hpc.apps.embodied.flow import embodied_ppo_flow

    force = coordinator.config.flow.options["force"]
    measured = placement.iteration_estimate

    def estimate(record: dict[str, Any], asynchronous: bool, shared: bool) -> float:
        seconds = measured(record, asynchronous, shared)
        return seconds if shared == (force == "shared") else 2 * seconds + 1.0

    placement.iteration_estimate = estimate  # type: ignore[assignment]
    return embodied_ppo_flow(coordinator)


EMBODIED_AUTO = dataclasses.replace(EMBODIED_APP, name="embodied_auto", flow="job_workers:embodied_auto_flow")
