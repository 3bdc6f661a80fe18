"""The rollout server's configuration (no engine needed)."""

from __future__ import annotations

import pytest

from rollout_server.config import Config, parse_config


def test_defaults_env_and_flags():
    assert parse_config([], env={}) == Config()
    env = {
        "ROLLOUT_SERVER_PORT": "6000",
        "ROLLOUT_SERVER_ENABLE_CHUNKED_PREFILL": "false",
        "ROLLOUT_SERVER_ROUTE_CACHE": "cache:50051",
        "ROLLOUT_SERVER_MAX_MESSAGE_BYTES": "99",
    }
    config = parse_config(["--port", "7000", "--max-pending-writes", "3"], env=env)
    assert config.port == 7000  # flags override the environment
    assert config.route_cache == "cache:50051" and not config.enable_chunked_prefill
    assert config.max_pending_writes == 3 and config.limits.max_message_bytes == 99


def test_engine_args_leave_zeros_to_vllm():
    args = Config(max_model_len=0, max_num_batched_tokens=0, engine_seed=0).engine_args()
    assert "max_model_len" not in args and "max_num_batched_tokens" not in args
    assert args["seed"] == 0 and args["enable_chunked_prefill"] is True
    assert Config(max_model_len=512).engine_args()["max_model_len"] == 512


def test_unknown_flag_fails():
    with pytest.raises(SystemExit):
        parse_config(["--no-such-flag"], env={})
