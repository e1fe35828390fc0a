"""Finding the MPI launcher (``mpiexec``/``mpirun``) a command should use."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ggpipe.errors import ConfigError


def find_launcher(name: str = "mpiexec") -> str:
    """The launcher's path: ``name`` itself if it is a path, else the first
    on ``PATH``, else the one beside the running Python (where ``pip install
    "ggpipe[mpich]"`` puts it in a virtual environment that is not activated).

    Raises:
        ConfigError: none found (one line saying where it looked).
    """
    if os.sep in name:
        if os.access(name, os.X_OK):
            return name
        raise ConfigError(f"the MPI launcher {name} does not exist or is not executable")
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK):
        return str(beside)
    raise ConfigError(f"{name} not found on PATH or beside {sys.executable}: install an MPI "
                      f"(pip install \"ggpipe[mpich]\") or put its bin directory on PATH")
