"""Checks of a caller's input, each failure an InvalidArgument naming the field."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_server.engine import Engine
from routereplay.domain.rollout import SamplingOptions
from routereplay.errors import InvalidArgument


def prompt_token_ids(engine: Engine, prompt: str | Sequence[int], name: str) -> list[int]:
    """The prompt as token ids: text goes through the engine's tokenizer.

    Raises:
        InvalidArgument: An empty prompt, or a token id outside the vocabulary.
    """
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise InvalidArgument(f"{name} is empty")
    vocab = engine.vocab_size
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidArgument(
                f"{name}.token_ids[{i}] is {token}; the vocabulary has {vocab} tokens"
            )
    return ids


def check_sampling(engine: Engine, options: SamplingOptions, prompt_len: int, name: str) -> None:
    """Refuse settings the engine cannot honour for a prompt of ``prompt_len`` tokens.

    ``prompt_len`` is everything the engine reads: for a later turn, the whole conversation.
    """
    context = engine.max_model_len
    if options.max_tokens < 1:
        raise InvalidArgument(f"{name}.max_tokens is {options.max_tokens}; it must be >= 1")
    if prompt_len >= context:
        raise InvalidArgument(
            f"the prompt has {prompt_len} tokens; the model's context is {context} tokens "
            "and must also hold the generated ones"
        )
    if prompt_len + options.max_tokens > context:
        raise InvalidArgument(
            f"{name}.max_tokens is {options.max_tokens}: past the model's context of {context} "
            f"tokens after a {prompt_len}-token prompt (at most {context - prompt_len})"
        )
    # vLLM refuses NaN, inf and temperatures above 2 itself, which the client would see as
    # INTERNAL; the comparison is False for NaN.
    if not 0 <= options.temperature <= 2:
        raise InvalidArgument(f"{name}.temperature is {options.temperature}; it must be in [0, 2]")
    if not 0 < options.top_p <= 1:
        raise InvalidArgument(f"{name}.top_p is {options.top_p}; it must be in (0, 1]")
    if options.top_k < -1:
        raise InvalidArgument(f"{name}.top_k is {options.top_k}; it must be >= -1 (0 or -1: off)")
    for i, stop in enumerate(options.stop):
        if not stop:  # vLLM refuses it too, which the client would see as INTERNAL
            raise InvalidArgument(f"{name}.stop[{i}] is empty; a stop string needs a character")
    if options.seed is not None and not engine.seed_allowed:
        raise InvalidArgument(
            f"{name}.seed is not supported by this engine: a per-request seed with chunked "
            "prefill crashes vLLM's CPU build; leave it unset, or run the server with "
            "--no-enable-chunked-prefill"
        )


def check_range(value: int, low: int, high: int, name: str) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{name} is {value}; it must be in [{low}, {high}]")
