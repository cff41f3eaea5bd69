"""Old name of :mod:`helpers.ckpt` (tests/helpers/ckpt.py), kept importable."""

from helpers.ckpt import (  # noqa: F401
    REPO,
    WORKER,
    child_env,
    cli,
    run_group,
)
