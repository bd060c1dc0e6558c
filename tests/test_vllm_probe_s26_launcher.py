"""The vLLM launcher's start-up failures, without starting vLLM: a model folder that is not
there, and a server whose engine dies with the reason far above its log's last lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chunkcache.core import vllm_server as module
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.model_files import ModelLoadError
from chunkcache.core.vllm_server import VllmServerConfig, vllm_server


def test_a_model_folder_that_is_not_there_is_refused_before_vllm_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM took ~10 s to fail, with huggingface_hub's 'Repo id must be in the form ...'."""

    def no_popen(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("vllm serve was started")

    monkeypatch.setattr(module.subprocess, "Popen", no_popen)
    missing = tmp_path / "no-such-model"
    with (
        pytest.raises(ModelLoadError, match=f"no model at {missing}"),
        vllm_server(VllmServerConfig(model=missing)),
    ):
        pass


# The shape of vLLM 0.32's log when the engine fails to start (a KV cache larger than the
# memory): the worker's error, then hundreds of lines of the engine's and the API server's
# tracebacks, ending in "See root cause above".
_ROOT_CAUSE = (
    "ValueError: Available memory on node 0 (18.12/20.84 GiB) on kv cache allocation is "
    "less than requested memory for kv (500.0 GiB)."
)
_LOG = [
    "(APIServer pid=1) INFO 11-25 09:40:39 [api_utils.py:347] version 0.32.0",
    "(APIServer pid=1) WARNING 11-25 09:40:39 [system_utils.py:255] Found ulimit of 20000: "
    "this can cause fd limit errors like `OSError: [Errno 24] Too many open files`.",
    "(Worker pid=3) ERROR 11-25 09:41:02 [multiproc_executor.py:1063]     raise ValueError(",
    f"(Worker pid=3) ERROR 11-25 09:41:02 [multiproc_executor.py:1063] {_ROOT_CAUSE}",
    *[f'  File "vllm/v1/engine/core.py", line {n}, in run' for n in range(200)],
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
    "proc(s): {'EngineCore': 1}",
]


def test_a_server_dying_at_start_up_is_reported_with_the_root_cause(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(_LOG) + "\n")
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    dead.wait()
    with pytest.raises(ChunkCacheError) as raised:
        module._wait_healthy("http://127.0.0.1:9", dead, log, timeout_s=30)
    message = str(raised.value)
    assert message.startswith("vllm serve exited with 1: ")
    assert _ROOT_CAUSE in message.splitlines()[0]  # the reason, first
    assert "OSError" not in message  # a warning that mentions an error is not one
    assert message.rstrip().endswith("Failed core proc(s): {'EngineCore': 1}")  # the last lines


def test_a_log_without_a_python_error_is_its_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("".join(f"line {n}\n" for n in range(100)))
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(ChunkCacheError) as raised:
        module._wait_healthy("http://127.0.0.1:9", dead, log, timeout_s=30)
    lines = str(raised.value).splitlines()
    assert lines[0] == "vllm serve exited with 3; its last lines:"
    assert lines[1:] == [f"line {n}" for n in range(60, 100)]
