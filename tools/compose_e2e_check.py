"""What tools/compose_e2e.sh checks from outside the containers, through the services' own
gRPC on the host's published ports.

  python tools/compose_e2e_check.py records HOST:PORT TOKEN_FILE SAMPLE_ID...
      reads each sample's record back from the route cache; prints one line per record and
      exits 1 unless every id has a record with tokens and routes
  python tools/compose_e2e_check.py status HOST:PORT TOKEN_FILE [--min-version N]
      the rollout server's GetStatus; exits 1 if its policy version is below N
"""

from __future__ import annotations

import argparse
import sys

import grpc

from routereplay.rpc.client import RouteCacheClient
from routereplay.rpc.security import ClientSecurity
from routereplay.v1 import rollout_pb2, rollout_pb2_grpc


def records(target: str, token_file: str, sample_ids: list[str]) -> int:
    security = ClientSecurity(token_file=token_file)
    with RouteCacheClient(target, security=security) as client:
        found = list(client.read_batch(sample_ids))
    bad = 0
    for sample_id, record in zip(sample_ids, found, strict=True):
        routes = getattr(record, "routes", None)
        tokens = getattr(record, "token_ids", None)
        ok = routes is not None and routes.size > 0 and tokens is not None and len(tokens) > 0
        bad += not ok
        shape = tuple(routes.shape) if routes is not None else None
        print(f"{sample_id}: {len(tokens) if tokens is not None else 0} tokens, routes {shape}")
    print(f"{len(found) - bad} of {len(sample_ids)} records read back with tokens and routes")
    return 1 if bad or len(found) != len(sample_ids) else 0


def status(target: str, token_file: str, min_version: int) -> int:
    with open(token_file) as f:
        metadata = (("authorization", f"Bearer {f.read().strip()}"),)
    with grpc.insecure_channel(target) as channel:
        reply = rollout_pb2_grpc.RolloutStub(channel).GetStatus(
            rollout_pb2.GetStatusRequest(), timeout=10, metadata=metadata
        )
    print(f"policy_version={reply.policy_version} running={reply.running}")
    return 0 if reply.policy_version >= min_version else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("records")
    p.add_argument("target")
    p.add_argument("token_file")
    p.add_argument("sample_ids", nargs="+")
    p = sub.add_parser("status")
    p.add_argument("target")
    p.add_argument("token_file")
    p.add_argument("--min-version", type=int, default=0)
    args = parser.parse_args()
    if args.command == "records":
        return records(args.target, args.token_file, args.sample_ids)
    return status(args.target, args.token_file, args.min_version)


if __name__ == "__main__":
    sys.exit(main())
