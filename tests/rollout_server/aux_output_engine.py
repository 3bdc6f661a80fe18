"""Engine steps played around vLLM's own AuxOutput bookkeeping (loaded by ``vllm_wheels``).

vLLM's scheduler connector, worker connector, row buffer and block store run unchanged. What
surrounds them in vLLM needs a GPU or is the scheduler's own large machinery, and is stood in
for here, each piece calling vLLM's code in the order vLLM 0.33/0.34 do (read from
``v1/core/sched/scheduler.py``, ``v1/worker/gpu/model_runner.py``, ``async_utils.py`` and
``v1/engine/output_processor.py``), synchronously (one batch in flight):

- ``StandInKVManager``: the KV manager's prefix cache (hashed full blocks, LRU) and the hit
  lookup, capped by the connector's ``max_cache_hit`` as vLLM's scheduler caps it.
- ``StandInRequest``: the fields of ``vllm.v1.request.Request`` the connector reads; block
  hashes chain SHA-256 over full blocks, as vLLM's do (not byte-equal to vLLM's).
- ``StepPlayer.step``: the scheduler (admission, chunked prefill under a token budget,
  preemption, speculative drafts), the model runner (``begin_step``, the stand-in forward
  pass writing the capture buffer, ``prepare_output``, the CPU copy with sampled and rejected
  counts, ``process_output``) and the scheduler's update (rejected drafts un-computed,
  ``take_output``, ``request_finished``), then the output processor's join of the chunks.
- The forward pass's routing is ``route_rows``: a pure function of the policy version and the
  tokens so far, so an oracle recomputes every row from a stored record's own tokens.
- ``StandInAsyncLLM``: the ``AsyncLLM`` calls ``rollout_server.engine.VLLMEngine`` makes, over
  the player; its final output carries ``routed_experts`` as vLLM's ``CompletionOutput`` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections import OrderedDict, deque
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from routereplay.families.model_geometry import MoEGeometry

BLOCK = 4  # tokens per KV block (and per hash block, one KV group)


def route_rows(version: int, context: np.ndarray, moe_geometry: MoEGeometry) -> np.ndarray:
    """The routing of the last token of ``context`` (all tokens so far) under policy
    ``version``, ``[num_hidden_layers, topk]``: distinct ids on MoE layers, zeros on dense
    layers, as vLLM returns them."""
    digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng([version, int.from_bytes(digest, "little")])
    geometry = moe_geometry.record
    row = np.zeros((moe_geometry.num_hidden_layers, geometry.topk), np.int32)
    for layer in geometry.moe_layers:
        row[layer] = rng.choice(geometry.num_experts, geometry.topk, replace=False)
    return row


def next_token(version: int, context: list[int], vocab: int) -> int:
    """The stand-in model's greedy choice after ``context``."""
    digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + version) % vocab


class StandInRequest:
    """What vLLM's scheduler connector reads of ``vllm.v1.request.Request``."""

    def __init__(self, request_id: str, prompt: list[int], max_tokens: int, prompt_start: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.sampling_params = SimpleNamespace(routed_experts_prompt_start=prompt_start)
        self.block_hashes: list[bytes] = []
        self.max_tokens = max_tokens
        self.finished = False
        self.num_cached_tokens: int | None = None
        self.routed_experts_chunks: list[np.ndarray] = []  # the output processor's list
        self.done: asyncio.Future | None = None
        self.update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def is_finished(self) -> bool:
        return self.finished

    def update_block_hashes(self) -> None:
        tokens = self.all_token_ids
        while (len(self.block_hashes) + 1) * BLOCK <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else b"root"
            block = np.asarray(tokens[i * BLOCK : (i + 1) * BLOCK], np.int64).tobytes()
            self.block_hashes.append(hashlib.sha256(parent + block).digest())


class StandInKVManager:
    """vLLM's KV cache manager as the AuxOutput scheduler connector sees it: one full-attention
    group whose block pool answers ``get_cached_block`` from a prefix cache of hashed blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.block_size = self.hash_block_size = BLOCK
        self.block_pool = self
        self.coordinator = SimpleNamespace(full_attention_group_id=0, single_type_managers=[self])
        self.kv_cache_config = SimpleNamespace(num_blocks=num_blocks, block_size=BLOCK)
        self._cached: OrderedDict[bytes, None] = OrderedDict()
        self._num_blocks = num_blocks

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]):
        return [block_hash] if block_hash in self._cached else None

    def cache_computed_blocks(self, request: StandInRequest) -> None:
        for block_hash in request.block_hashes[: request.num_computed_tokens // BLOCK]:
            self._cached[block_hash] = None
            self._cached.move_to_end(block_hash)
        while len(self._cached) > self._num_blocks:
            self._cached.popitem(last=False)

    def longest_hit(self, request: StandInRequest, max_length: int) -> int:
        """Tokens of ``request`` served from the prefix cache: whole cached blocks from the
        start, at most ``max_length`` (the connector's cap, as vLLM's scheduler passes it)."""
        blocks = 0
        for block_hash in request.block_hashes:
            if block_hash not in self._cached:
                break
            blocks += 1
        return min(blocks * BLOCK, max_length) // BLOCK * BLOCK

    def reset(self) -> None:
        self._cached.clear()


class StepPlayer:
    """vLLM's AuxOutput connectors driven by stand-in engine steps (see the module docstring).

    Args:
        aux: The wheel's modules (``vllm_wheels.load_aux_output``).
        moe_geometry: The served model's geometry (the capture's width).
        vocab: Vocabulary size of the stand-in model.
        max_num_batched_tokens: Token budget per step (longer prompts prefill in chunks).
        store_bytes: ``aux_output_config.max_bytes`` (None: sized from the KV cache).
        spec_tokens: Draft tokens proposed per decode step (0: no speculative decoding).
        accepted: Drafts accepted per step, cycled.
        trim_rejected: Report rejected drafts to the worker connector, as vLLM's model runner
            does (False only to show the test catches it).
    """

    def __init__(
        self,
        aux: SimpleNamespace,
        moe_geometry: MoEGeometry,
        vocab: int,
        *,
        max_num_batched_tokens: int = 16,
        max_num_seqs: int = 8,
        num_blocks: int = 256,
        store_bytes: int | None = None,
        spec_tokens: int = 0,
        accepted: tuple[int, ...] = (0,),
        trim_rejected: bool = True,
    ) -> None:
        self.moe_geometry = moe_geometry
        self.vocab = vocab
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv = StandInKVManager(num_blocks)
        self.scheduler = aux.connector.AuxOutputSchedulerConnector(self.kv)
        geometry = moe_geometry.record
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
            ),
            max_concurrent_batches=1,
            aux_output_config=SimpleNamespace(max_bytes=store_bytes),
            model_config=SimpleNamespace(
                get_total_num_hidden_layers=lambda: moe_geometry.num_hidden_layers,
                get_num_experts=lambda: geometry.num_experts,
                get_num_experts_per_tok=lambda: geometry.topk,
            ),
            capturers=[],
        )
        make = aux.worker.get_aux_output_connector
        if "kv_cache_config" in inspect.signature(make).parameters:  # 0.33: storage at init
            kv_cache_config = self.kv.kv_cache_config
            self.worker = make(model=None, vllm_config=config, kv_cache_config=kv_cache_config)
        else:  # 0.34: storage once the KV cache layout is known
            self.worker = make(model=None, vllm_config=config)
            self.worker.initialize_output_storage(self.kv.kv_cache_config)
        self.capturer = config.capturers[0]
        self.requests: dict[str, StandInRequest] = {}
        self.waiting: deque[StandInRequest] = deque()
        self.running: list[StandInRequest] = []
        self.version = 0
        self.spec_tokens = spec_tokens
        self.accepted = accepted
        self.trim_rejected = trim_rejected
        # Request id prefix -> when to preempt that request (once).
        self.preempt_when: dict[str, Callable[[StandInRequest], bool]] = {}
        self.counts = {"steps": 0, "preempted": 0, "drafts_rejected": 0, "prefix_hit_tokens": 0}
        self._spec_steps = 0

    # ---------------------------------------------------------------- requests

    def add(self, request_id: str, prompt: list[int], max_tokens: int, prompt_start: int):
        request = StandInRequest(request_id, prompt, max_tokens, prompt_start)
        request.done = asyncio.get_running_loop().create_future()
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> None:
        """The scheduler's ``reset_prefix_cache`` with nothing running (a weight update)."""
        assert not self.busy
        self.kv.reset()
        self.scheduler.reset()

    def run(self) -> None:
        """Steps until every request finished, then one more: the terminal events reach the
        worker connector with the next step's metadata."""
        while self.busy:
            self.step()
            assert self.counts["steps"] < 10_000
        self.step()

    # ---------------------------------------------------------------- one engine step

    def step(self) -> None:
        self.counts["steps"] += 1
        preempted_now = set()
        for request in list(self.running):
            for prefix, rule in list(self.preempt_when.items()):
                if request.request_id.startswith(prefix) and rule(request):
                    del self.preempt_when[prefix]
                    self._preempt(request)
                    preempted_now.add(request.request_id)
        budget, plans = self.budget, {}
        for request in self.running:
            if budget:
                plans[request.request_id] = self._plan(request, budget)
                budget -= len(plans[request.request_id][1])
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in preempted_now:
                break
            if request.num_computed_tokens == 0:
                cap = self.scheduler.max_cache_hit(request)
                request.num_computed_tokens = self.kv.longest_hit(request, cap)
                self.counts["prefix_hit_tokens"] += request.num_computed_tokens
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = request.num_computed_tokens
            self.running.append(self.waiting.popleft())
            plans[request.request_id] = self._plan(request, budget)
            budget -= len(plans[request.request_id][1])

        # The scheduler: connector metadata first, then the computed counts advance.
        scheduled = {rid: len(plan[1]) for rid, plan in plans.items()}
        metadata = self.scheduler.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=scheduled), self.requests
        )
        starts = {rid: self.requests[rid].num_computed_tokens for rid in plans}
        for rid, count in scheduled.items():
            self.requests[rid].num_computed_tokens += count
        # The model runner.
        self.worker.begin_step(metadata)
        if not plans:
            return
        query_start_loc = [0]
        for rid, (context, tokens, _, _) in plans.items():
            start = starts[rid]
            for i in range(len(tokens)):
                row = route_rows(
                    self.version, np.asarray(context[: start + i + 1]), self.moe_geometry
                )
                self.capturer.device_buffer[query_start_loc[-1] + i] = _tensor(row)
            query_start_loc.append(query_start_loc[-1] + len(tokens))
        batch = SimpleNamespace(
            req_ids=list(plans),
            query_start_loc_np=np.asarray(query_start_loc, np.int32),
            num_computed_tokens_np=np.asarray([starts[rid] for rid in plans], np.int32),
        )
        pending = self.worker.prepare_output(batch)
        sampled = [len(plan[2]) for plan in plans.values()]
        rejected = [plan[3] for plan in plans.values()]
        self.counts["drafts_rejected"] += sum(rejected)
        told_rejected = rejected if self.trim_rejected else [0] * len(rejected)
        pending.enqueue_cpu_copy(np.asarray(sampled, np.int32), np.asarray(told_rejected))
        output = pending.process_output()
        # The scheduler's update from the output.
        for rid, (_, _, new_tokens, num_rejected) in plans.items():
            request = self.requests[rid]
            request.num_computed_tokens -= num_rejected
            request.output_token_ids += new_tokens
            request.update_block_hashes()
            self.kv.cache_computed_blocks(request)
            stopped = request.num_output_tokens >= request.max_tokens
            if stopped:
                request.finished = True
            if new_tokens or stopped:
                rows = self.scheduler.take_output(request, output)
                if rows is not None:
                    request.routed_experts_chunks.append(rows)
            if stopped:
                self.running.remove(request)
                self.scheduler.request_finished(request)
                chunks = request.routed_experts_chunks  # joined as vLLM's output processor does
                request.done.set_result(np.concatenate(chunks) if chunks else None)

    def _plan(self, request: StandInRequest, budget: int):
        """(context, this step's input tokens, the tokens it samples, drafts rejected)."""
        context = request.all_token_ids
        start = request.num_computed_tokens
        remaining = request.num_tokens - start
        if remaining > 1 or not request.output_token_ids:
            count = min(remaining, budget)
            done = start + count == request.num_tokens
            new = [next_token(self.version, context, self.vocab)] if done else []
            return context, context[start : start + count], new, 0
        # Decoding: the last token, and drafts when speculating, the first `accept` right.
        drafts = min(self.spec_tokens, request.max_tokens - request.num_output_tokens - 1)
        drafts = max(0, min(drafts, budget - 1))
        accept = min(drafts, self.accepted[self._spec_steps % len(self.accepted)]) if drafts else 0
        self._spec_steps += bool(drafts)
        proposed = list(context)
        for i in range(drafts):
            right = next_token(self.version, proposed, self.vocab)
            proposed.append(right if i < accept else (right + 1) % self.vocab)
        kept = proposed[: len(context) + accept]
        new = proposed[len(context) : len(kept)] + [next_token(self.version, kept, self.vocab)]
        return proposed, proposed[start:], new, drafts - accept

    def _preempt(self, request: StandInRequest) -> None:
        """The scheduler's ``_preempt_request``: the connector hears of it first, the KV blocks
        are freed (they stay in the prefix cache), the request recomputes from the start."""
        self.counts["preempted"] += 1
        self.scheduler.request_finished(request)
        request.num_computed_tokens = 0
        self.running.remove(request)
        self.waiting.appendleft(request)


def _tensor(row: np.ndarray):
    import torch

    return torch.from_numpy(row)


class StandInAsyncLLM:
    """The calls ``VLLMEngine`` makes of vLLM's ``AsyncLLM``, over a ``StepPlayer``.

    ``generate`` queues the request and waits for the player (the test runs its steps); its
    one final output is shaped like vLLM's: ``outputs[0].routed_experts`` is the output
    processor's join of the chunks the scheduler connector took. A weight update bumps the
    player's policy version and resets the prefix cache and the connector's namespace.
    """

    errored = False

    def __init__(self, player: StepPlayer, max_model_len: int, vocab: int) -> None:
        self.player = player
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: vocab),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        )

    def get_tokenizer(self):
        return None  # the test sends token ids

    async def generate(self, prompt, params, request_id):
        request = self.player.add(
            request_id,
            list(prompt["prompt_token_ids"]),
            params.max_tokens,
            params.routed_experts_prompt_start,
        )
        routes = await request.done
        completion = SimpleNamespace(
            token_ids=list(request.output_token_ids),
            text="",
            logprobs=None,
            routed_experts=routes,
            finish_reason="length",
        )
        yield SimpleNamespace(
            outputs=[completion], finished=True, num_cached_tokens=request.num_cached_tokens
        )

    async def abort(self, request_id: str) -> None:
        raise AssertionError(f"request {request_id} aborted: the played engine step failed")

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        if clear_cache:
            self.player.reset_prefix_cache()

    async def collective_rpc(self, method: str, args=()) -> None:
        assert method == "reload_moe_weights", method
        self.player.version += 1

    async def reset_prefix_cache(self) -> None:
        self.player.reset_prefix_cache()

    async def resume_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
