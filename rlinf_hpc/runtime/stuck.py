"""Stuck waits: a rank whose main thread waits in a receive, a collective or a barrier that
cannot finish, named with the ranks missing from the operation.

The heartbeat thread keeps beating while the main thread is stuck in MPI, so liveness alone
cannot see this hang; the data plane records what the main thread waits on and for whom
(`rlinf_hpc.comm.waiting.current_wait`), every heartbeat carries it, and rank 0's watchdog
(`runtime.watchdog`) asks `stuck_waits` about the records it read.
"""

from __future__ import annotations

from typing import Any


def _state_of(record: dict[str, Any] | None, now: float) -> tuple[str, str, float]:
    """(``state``, what it does, for how long): ``state`` is waiting, computing or idle."""
    if record is None:
        return "unknown", "no heartbeat", 0.0
    wait = record.get("wait")
    if wait:
        return "waiting", f"waiting in {wait['op']}", now - float(wait["since"])
    activity = record.get("activity") or "idle"
    state = "idle" if activity in ("idle", "coordinating", "starting") else "computing"
    return state, activity, now - float(record.get("since", now))


def stuck_waits(
    records: dict[int, dict[str, Any]], now: float, hang_timeout_s: float
) -> list[dict[str, Any]]:
    """Ranks stuck in a collective or receive: waiting longer than ``hang_timeout_s`` while none
    of the ranks the operation needs is working. Each is named with the members missing from the
    operation (idle, or waiting in another one) — a deadlock or a rank that never arrived; a
    long wait on a peer that computes is no problem.

    >>> records = {1: {"wait": {"op": "broadcast #1 over ranks [1, 2]", "peers": [1, 2], "since": 0.0},
    ...                "roles": "alpha"},
    ...            2: {"activity": "idle", "since": 0.0, "roles": "alpha"}}
    >>> [p["detail"] for p in stuck_waits(records, 200.0, 120.0)]
    ['waits in broadcast #1 over ranks [1, 2] for 200 s; missing from it: rank 2 (alpha): idle for 200 s']
    >>> records[2] = {"activity": "alpha.train", "since": 0.0}  # the peer works: a long wait, fine
    >>> stuck_waits(records, 200.0, 120.0)
    []
    """
    problems, reported_ops = [], set()
    for rank, record in sorted(records.items()):
        wait = record.get("wait")
        if not wait or now - float(wait["since"]) <= hang_timeout_s or wait["op"] in reported_ops:
            continue
        missing, working = [], False
        for peer in wait["peers"]:
            if peer == rank:
                continue
            state, doing, age = _state_of(records.get(peer), now)
            peer_wait = (records.get(peer) or {}).get("wait") or {}
            if state == "computing":
                working = True
            elif state == "waiting" and peer_wait.get("op") == wait["op"]:
                continue  # it is in the operation too
            else:
                roles = (records.get(peer) or {}).get("roles") or "-"
                missing.append(f"rank {peer} ({roles}): {doing} for {age:.0f} s")
        if working:
            continue
        age = now - float(wait["since"])
        detail = f"waits in {wait['op']} for {age:.0f} s; " + (
            f"missing from it: {'; '.join(missing)}" if missing
            else "every member is in it, yet nothing moved (mismatched tags or sizes?)"
        )  # fmt: skip
        reported_ops.add(wait["op"])
        problems.append({"rank": rank, "kind": "stuck", "age_s": age, "record": record, "detail": detail})
    return problems
