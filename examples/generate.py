"""Generate a GRPO group with the rollout server and print the tokens as they stream.

Uses only the stubs generated from ``proto/routereplay/v1``. Each finished sample's record
(tokens, log-probs, routes) is already in the route cache when its final message arrives;
``examples/fetch_batch.py`` reads it back::

    python examples/generate.py --target localhost:50052 --n 4 "Write a haiku about experts"
"""

from __future__ import annotations

import argparse

import grpc
import numpy as np

from routereplay.v1 import rollout_pb2, rollout_pb2_grpc


def generate_group(channel: grpc.Channel, prompt: str, n: int, max_tokens: int, metadata=()):
    """Stream one prompt's ``n`` samples; yield ``(sample_id, event)`` per message."""
    stub = rollout_pb2_grpc.RolloutStub(channel)
    request = rollout_pb2.GenerateBatchRequest(
        prompts=[rollout_pb2.Prompt(text=prompt)],
        n=n,
        sampling=rollout_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens),
    )
    for response in stub.GenerateBatch(request, timeout=300, metadata=metadata):
        yield response.sample_id, response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50052", help="rollout server host:port")
    parser.add_argument("--n", type=int, default=4, help="samples in the group")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--token-file", help="file holding the bearer token the server expects")
    parser.add_argument("prompt")
    args = parser.parse_args()
    metadata = ()
    if args.token_file:
        with open(args.token_file) as f:
            metadata = (("authorization", f"Bearer {f.read().strip()}"),)
    with grpc.insecure_channel(args.target) as channel:
        stream = generate_group(channel, args.prompt, args.n, args.max_tokens, metadata)
        for sample_id, response in stream:
            event = response.WhichOneof("event")
            if event == "delta":
                ids = np.frombuffer(response.delta.token_ids, "<i4")
                print(f"{sample_id} +{ids.size} tokens: {response.delta.text!r}")
            elif event == "done":
                done = response.done
                print(
                    f"{sample_id} done ({done.finish_reason}): {done.generated_tokens} "
                    f"generated, group {done.group_id}, stored={done.stored}"
                )
            else:
                print(f"{sample_id} failed: {response.error.code} {response.error.message}")


if __name__ == "__main__":
    main()
