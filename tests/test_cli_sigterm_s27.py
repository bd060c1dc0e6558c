"""SIGTERM to a ``chunkcache`` command unwinds it like Ctrl-C: its clean-up runs (a vLLM or
Redis server it started in a session of its own is stopped) and it exits with 143."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from chunkcache.core import cli

# A command that holds a resource until it is told to stop, run through cli.main.
SCRIPT = textwrap.dedent(
    """
    import time
    from chunkcache.core import cli

    def hold(argv):
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            print("cleaned up", flush=True)

    cli._run = hold
    cli.main([])
    """
)


def test_sigterm_runs_the_commands_clean_up_and_exits_143() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert "cleaned up" in out, err
    assert proc.returncode == 143
    assert "Traceback" not in err


def test_the_sigterm_handler_before_main_is_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        cli.main(["models", "--help"])
    assert signal.getsignal(signal.SIGTERM) is before
