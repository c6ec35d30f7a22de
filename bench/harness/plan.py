"""The workloads of issue 6 and their sizes, full and ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Workload:
    """One workload: its id, what it measures, and the arguments of a contestant script."""

    id: str
    title: str
    args: dict[str, object] = field(default_factory=dict)
    #: The whole run of one contestant's script, in seconds; the script waits for its work until a
    #: minute before it (a 20,000-job drain at 25 jobs/s still gets measured).
    timeout: float = 900.0
    env: dict[str, str] = field(default_factory=dict)


#: A soak shows bloat only if finished jobs are pruned within it: keep succeeded jobs one minute.
SOAK_ENV = {"RELAY_RETENTION_SUCCEEDED": "60"}


def workloads(quick: bool, soak: bool) -> list[Workload]:
    """W1-W5 (and W6 with ``soak``) at full or tiny sizes."""
    if quick:
        plan = [
            Workload("W1", "drain no-op jobs, concurrency 8", {"jobs": 2000}, 60),
            Workload("W2", "enqueues, one transaction each", {"jobs": 200}, 60),
            Workload("W3", "one bulk enqueue", {"jobs": 2000}, 60),
            Workload("W4", "enqueue-to-start latency into idle workers", {"jobs": 50, "rate": 100}, 60),
            Workload("W5", "time per job vs table size", {"jobs": 200, "sizes": "2000,10000", "reps": 1}, 120),
        ]
        if soak:
            plan.append(Workload("W6", "soak", {"duration": 20, "window": 5, "rate": 100}, 120, SOAK_ENV))
        return plan
    plan = [
        Workload("W1", "drain 20,000 no-op jobs, concurrency 8", {"jobs": 20000}),
        Workload("W2", "2,000 enqueues, one transaction each", {"jobs": 2000}),
        Workload("W3", "bulk enqueue of 20,000", {"jobs": 20000}),
        Workload("W4", "enqueue-to-start latency, 500 jobs at 100/s", {"jobs": 500, "rate": 100}),
        Workload(
            "W5",
            "time per job draining 1,000 from 10k / 100k / 1M rows",
            {"jobs": 1000, "sizes": "10000,100000,1000000", "reps": 3},
            1800,
        ),
    ]
    if soak:
        soak_args = {"duration": 600, "window": 30, "rate": 200}
        plan.append(Workload("W6", "10-minute soak at 200 jobs/s", soak_args, 900, SOAK_ENV))
    return plan


#: Workloads measured in every round; the others run once per contestant.
ROUNDED = ("W1", "W2", "W3", "W4")
