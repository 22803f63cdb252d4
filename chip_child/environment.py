"""A cpu chip-child's process environment, in a module without torch: a child started ahead of its
spec (l3worker/worker/early_child.py) gets it before anything imports torch."""
from __future__ import annotations

# How long (libgomp spin iterations) a cpu child's idle OpenMP thread spins before it sleeps.
# libgomp's default, 300000, is several milliseconds: a team that spins that long collapses
# when anything else wants one of its cores, each thread burning its time slice waiting for a
# descheduled one (a 2-core box with one other busy process: 19-26 ms per token instead of 0.5).
# 4000 cost nothing measurable on a quiet box and ran 1.5-1.8 ms per token under that load;
# 1000 ran 1.0 there but 7% slower when quiet (scripts/bench_cpu.py --contend 1).
CHILD_GOMP_SPINCOUNT = 4000
OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """The environment of a cpu child: `env` with a short OpenMP spin, unless `env` already says
    how OpenMP threads wait (the user's choice wins)."""
    if any(name in env for name in OMP_WAIT_VARIABLES):
        return env
    return {**env, "GOMP_SPINCOUNT": str(CHILD_GOMP_SPINCOUNT)}
