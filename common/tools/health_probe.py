"""Exit 0 if a gRPC server reports SERVING (grpc.health.v1), else 1. Used by compose health checks.

python -m common.tools.health_probe HOST:PORT [SERVICE] [--timeout S]
"""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.health_probe")
    p.add_argument("address")
    p.add_argument("service", nargs="?", default="")
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
