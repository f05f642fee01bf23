"""A prefill replica for tests and drills: the prefill service with test hooks from its command line.

    python -m bench.drill_prefill [--inject-faults fail=0.05,stall=0.02[,seed=1]]
        [--kv-message-delay-s S] [--step-delay-s S] PREFILL FLAGS...

The flags named above build a FaultInjector (prefill_service/fault_injection.py: break or stall
that share of handoffs after their first KV message; also a Delays: sleep S before each KV message,
or after each worker step); every other flag is the prefill service's own (`python -m
prefill_service --help`). The service itself has no such flags: hooks are objects handed to
PrefillService (prefill_service/hooks.py), and this entry point is the one place that makes them
from a command line (bench/chaos_soak.py, tests/test_faults.py, tests/test_prefill_replicas.py).
"""

from __future__ import annotations

import argparse

from prefill_service.__main__ import main as prefill_main  # first: it sets the OpenMP defaults before torch
from prefill_service.fault_injection import FaultInjector, FaultPlan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.drill_prefill", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    p.add_argument(
        "--inject-faults", default=None, help="fail=P,stall=P[,seed=N]: break or stall that share of handoffs"
    )
    p.add_argument("--kv-message-delay-s", type=float, default=0.0, help="sleep before each KV message")
    p.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each worker step")
    return p


def main(argv=None) -> None:
    p = parser()
    args, rest = p.parse_known_args(argv)
    try:
        plan = FaultPlan.parse(args.inject_faults)
    except ValueError as e:
        p.error(str(e))
    prefill_main(rest, FaultInjector(plan, step_s=args.step_delay_s, kv_message_s=args.kv_message_delay_s))


if __name__ == "__main__":
    main()
