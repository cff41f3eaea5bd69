"""Old name of :mod:`helpers.launch` (tests/helpers/launch.py), kept importable."""

from helpers.launch import (  # noqa: F401
    _TRACEBACK,
    ECHO,
    REPO,
    REPORT_ENV,
    SCRIPTS,
    alive,
    assert_one_line_error,
    elapsed,
    node_ids,
    processes_with,
    reports,
    run_cli,
    wait_agents,
    worker_lines,
)
