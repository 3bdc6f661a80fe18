"""examples/generate.py, the stubs-only Generate client, against the real rollout server: the
tokens it prints as they stream are the ones stored, and every sample of the group is stored."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "generate.py"


def test_generate_example_streams_a_stored_group(rollout, cache_reader, loop):
    server, _ = rollout

    async def run() -> str:
        # A child process: this process's event loop must keep running to serve it.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(EXAMPLE),
            "--target",
            f"127.0.0.1:{server.port}",
            "--n",
            "3",
            "--max-tokens",
            "6",
            "The experts of layer one",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0
        return out.decode()

    out = loop.run_until_complete(run())
    streamed = Counter()
    for sample_id, count in re.findall(r"^(\S+) \+(\d+) tokens", out, re.M):
        streamed[sample_id] += int(count)
    done = re.findall(
        r"^(\S+) done \((stop|length)\): (\d+) generated, group (\S+), "
        r"stored=(\w+)$",
        out,
        re.M,
    )
    assert len(done) == 3 and len({group for *_, group, _ in done}) == 1
    for sample_id, _, generated, group, stored in done:
        assert stored == "True" and streamed[sample_id] == int(generated) > 0
        record = cache_reader.read(sample_id)
        assert record.group_id == group
        turn = record.turns[0]
        assert turn.token_end - turn.generated_start == int(generated)
        assert record.routes.shape[0] == record.token_ids.size - 1
