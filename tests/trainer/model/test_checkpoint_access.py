"""A checkpoint the trainer's uid may not read: the embedded model is built readable by every
user, and a load that is refused says "permission denied".

Both broke the trainer's container (issue 43): its image builds the model as root, safetensors
writes 0600, the container runs as uid 10001, and safetensors reported the unreadable file as
"No such file or directory".
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534
LOAD = "import sys; from trainer.model.hf_weights import load_hf_state_dict as f; f(sys.argv[1])"
CAPS = "-dac_override,-dac_read_search"
DROP_READ_ANYTHING = ["setpriv", f"--inh-caps={CAPS}", f"--bounding-set={CAPS}"]


def test_the_embedded_model_is_readable_by_every_user(tiny_model_dir):
    for path in (tiny_model_dir, *Path(tiny_model_dir).rglob("*")):
        mode = path.stat().st_mode
        wanted = stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0)
        assert mode & wanted == wanted, (path.name, oct(mode))


def test_an_unreadable_checkpoint_says_permission_denied():
    """The load runs in a second process that may not read the file. Where the tests run as
    root, the file belongs to another uid (mode 0600) and the process is root without the
    capabilities that let root read anything (util-linux's setpriv); else the file is mode 0."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="checkpoint-"))
    try:
        folder.chmod(0o755)
        weights = folder / "model.safetensors"
        save_file({"w": torch.zeros(2)}, str(weights))
        command = [sys.executable, "-c", LOAD, str(folder)]
        if os.getuid() == 0:
            os.chown(weights, NOBODY, NOBODY)
            weights.chmod(0o600)
            command = [*DROP_READ_ANYTHING, *command]
        else:
            weights.chmod(0)
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("PermissionError:") and "permission denied" in last, last
    assert "No such file" not in last
