"""numba, where it is importable (the project's environment has it through vLLM), for the
kernels that must run at memory speed: the expert-id check (``idcheck``) and the
layer-major swap of a block (``codec.swap_first_axes``). Each keeps a numpy path for
environments without it, or with ``ROUTEREPLAY_NO_NUMBA`` set."""

from __future__ import annotations

import os

try:  # pragma: no cover - exercised through both paths in the tests
    if os.environ.get("ROUTEREPLAY_NO_NUMBA"):
        raise ImportError("disabled by ROUTEREPLAY_NO_NUMBA")
    import numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    numba = None
    HAVE_NUMBA = False
