"""Every ```python snippet of README.md, docs/serve.md and docs/store.md runs as written, and
the shell commands those docs show parse.

A snippet is named by its file and its place there (``README.md#3`` is the README's third
python block) and run alone, given only the names it leaves to the reader (``vectorstore``,
``llm``, ...), built from small real fixtures: a Chroma store or LlamaIndex index over a few
documents with the project's MiniLM embeddings, SmolLM2 through the local backend where a
snippet generates, a real ``chunkcache serve`` where it talks to one.  Snippets that only
construct an engine get a tiny random model.  ``test_every_snippet_is_run`` fails for a
snippet no test runs, so a new one cannot be left out unnoticed.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import chromadb
import pytest
from chromadb.config import Settings
from langchain_chroma import Chroma
from langchain_core.chat_history import BaseChatMessageHistory, InMemoryChatMessageHistory
from langchain_core.prompts import ChatPromptTemplate
from llama_index.core import Document as LlamaDocument
from llama_index.core import VectorStoreIndex
from tiny_models import tiny_lm

import chunkcache.core.cache as cache_module
from chunkcache.core.cache import ChunkCache
from chunkcache.core.cli import build_parser
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import Backend
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.serve.launcher import serve_process
from chunkcache.core.serve.settings import ServeSettings
from chunkcache.core.store.settings import StoreSettings
from chunkcache.core.store.tiered import TieredKVStore
from chunkcache.integrations.embeddings import MiniLMEmbedding, MiniLMEmbeddings
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.vllm import VllmBackend

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/serve.md", "docs/store.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
CHUNK_ID = re.compile(r"[0-9a-f]{32}")

TEXTS = [
    "json.dumps serializes a Python object to a JSON formatted str.",
    "json.loads parses a JSON document from a str and returns the Python object.",
    "csv.reader returns an object that iterates over the lines of a CSV file.",
    "datetime.strptime parses a date string according to a format.",
]


def fenced_blocks(doc: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced block of ``doc``, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((ROOT / doc).read_text())]


SNIPPETS = {
    f"{doc}#{number}": body
    for doc in DOCS
    for number, body in enumerate(
        (body for info, body in fenced_blocks(doc) if info == "python"), start=1
    )
}
COVERED: set[str] = set()
_Test = TypeVar("_Test", bound=Callable[..., None])


def covers(snippet_id: str) -> Callable[[_Test], _Test]:
    """Mark the decorated test as the one that runs ``snippet_id``."""
    COVERED.add(snippet_id)
    return lambda test: test


def run(snippet_id: str, code: str | None = None, **names: Any) -> dict[str, Any]:
    """Run snippet ``snippet_id`` (or ``code``, a copy of it) with ``names`` defined; its
    namespace afterwards.  Tracebacks name the snippet."""
    namespace = dict(names)
    exec(compile(code or SNIPPETS[snippet_id], snippet_id, "exec"), namespace)
    return namespace


def test_every_snippet_is_run() -> None:
    assert len(SNIPPETS) >= 9  # the extraction found the blocks at all
    assert set(SNIPPETS) == COVERED


def use_default_cache(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> ChunkCache:
    """A fresh process-wide default cache on ``backend``, for snippets whose wrappers take
    the default (no state leaks between tests; the backend's model loads once)."""
    cache = ChunkCache(backend=backend)
    monkeypatch.setattr(cache_module, "_default_cache", cache)
    return cache


@pytest.fixture(scope="module")
def vectorstore() -> Iterator[Chroma]:
    # in-memory Chroma clients share their collections within a process: remove ours after
    client = chromadb.EphemeralClient(Settings(anonymized_telemetry=False))
    store = Chroma(
        collection_name="docs-snippets", client=client, embedding_function=MiniLMEmbeddings()
    )
    store.add_texts(TEXTS)
    yield store
    store.delete_collection()


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    documents = [LlamaDocument(text=text) for text in TEXTS]
    return VectorStoreIndex.from_documents(documents, embed_model=MiniLMEmbedding())


@pytest.fixture
def tiny_backend() -> LocalBackend:
    return LocalBackend(ChunkEngine(tiny_lm()))


@pytest.fixture(scope="module")
def smollm2() -> LocalBackend:
    """The default model on the local backend (in-memory store)."""
    return LocalBackend.default()


@pytest.fixture
def store_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """``TieredKVStore.from_settings()`` puts its disk tier here, not in the user's cache."""
    monkeypatch.setenv("CHUNKCACHE_STORE_DISK_DIR", str(tmp_path / "kv"))
    return tmp_path / "kv"


# README.md


@covers("README.md#1")
def test_readme_langchain_retriever(
    vectorstore: Chroma, tiny_backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_default_cache(monkeypatch, tiny_backend)
    docs = run("README.md#1", vectorstore=vectorstore)["docs"]
    assert len(docs) == len(TEXTS)  # k=5 over four documents
    metadata = docs[0].metadata  # the keys the comment shows
    assert CHUNK_ID.fullmatch(metadata["chunk_id"])
    assert isinstance(metadata["retriever_rank"], int)
    assert metadata["seen_in_conversation"] is False


@covers("README.md#2")
def test_readme_llama_index(
    index: VectorStoreIndex, tiny_backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = use_default_cache(monkeypatch, tiny_backend)
    namespace = run("README.md#2", index=index)
    assert namespace["nodes"]
    assert all(CHUNK_ID.fullmatch(n.node.metadata["chunk_id"]) for n in namespace["nodes"])
    assert len(cache.ledger) == 1  # the retriever's conversation, "user-42"


@pytest.mark.slow
@covers("README.md#3")
def test_readme_generation(
    vectorstore: Chroma, smollm2: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_default_cache(monkeypatch, smollm2)
    q = "Which function parses a JSON document?"
    docs = ChunkCacheRetriever(base_retriever=vectorstore.as_retriever(), k=2).invoke(q)
    # a one-word answer ends long before the snippet's max_tokens
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer in one word.\n\nContext:\n{context}"), ("human", "{question}")]
    )
    answer = run("README.md#3", prompt=prompt, q=q, docs=docs)["answer"]
    assert answer.content
    assert isinstance(answer.usage_metadata["input_token_details"]["cache_read"], int)
    stats = answer.response_metadata["chunkcache"]
    assert stats["chunk_hits"] + stats["chunk_misses"] == len(docs)  # the chunks were found
    for key in ("ttft_s", "reused_tokens", "recomputed_tokens", "computed_tokens"):
        assert key in stats


@pytest.mark.slow
@covers("README.md#4")
def test_readme_chat_history(
    vectorstore: Chroma, smollm2: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_default_cache(monkeypatch, smollm2)
    histories: dict[str, InMemoryChatMessageHistory] = {}

    def get_session_history(session_id: str) -> BaseChatMessageHistory:
        return histories.setdefault(session_id, InMemoryChatMessageHistory())

    run(
        "README.md#4",
        llm=ChunkCacheLLM(max_tokens=8),
        base=vectorstore.as_retriever(search_kwargs={"k": 2}),
        get_session_history=get_session_history,
    )
    question, answer = histories["user-42"].messages
    assert len(question.additional_kwargs["chunk_ids"]) == 2  # the turn's chunks, in its message
    assert answer.content


@pytest.mark.slow
@covers("README.md#5")
def test_readme_tiered_store(store_dir: Path) -> None:
    cache = run("README.md#5")["cache"]
    backend = cache.backend
    assert isinstance(backend, LocalBackend)
    assert isinstance(backend.engine.store, TieredKVStore)
    backend.engine.store.close()
    assert store_dir.is_dir()


@covers("README.md#6")
def test_readme_backends() -> None:
    namespace = run("README.md#6")
    assert namespace["llm"].chunk_cache is namespace["shared"]
    # made on first use, without a request; `local` is left alone (it would load the model)
    assert isinstance(namespace["shared"].backend, HttpBackend)
    vllm = namespace["vllm"].backend
    assert isinstance(vllm, VllmBackend) and vllm.model_name == "SmolLM2-135M-Instruct"


# docs/serve.md


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``chunkcache serve`` with the docs' API key; short default answers keep it quick."""
    folder = tmp_path_factory.mktemp("serve")
    env = {
        "CHUNKCACHE_SERVE_API_KEY": "s3cret",
        "CHUNKCACHE_SERVE_DEFAULT_MAX_TOKENS": "16",
        "CHUNKCACHE_STORE_DISK_DIR": str(folder / "kv"),
        "OMP_NUM_THREADS": "1",
    }
    with serve_process(env=env, log=folder / "serve.log") as (url, _):
        yield url


@pytest.mark.slow
@covers("docs/serve.md#1")
def test_serve_openai_client(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    documented = "http://127.0.0.1:8000"
    assert documented in SNIPPETS["docs/serve.md#1"]
    code = SNIPPETS["docs/serve.md#1"].replace(documented, server)
    reply = run("docs/serve.md#1", code)["reply"]
    stats = reply.usage.model_extra["chunkcache"]
    assert stats["chunk_hits"] + stats["chunk_misses"] == 1  # the named chunk was found
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"{reply.usage.prompt_tokens_details.cached_tokens} {{")
    assert printed[-1].startswith("CompletionUsage(")  # the stream's last chunk: its usage


@covers("docs/serve.md#2")
def test_serve_chunkcache_llm(vectorstore: Chroma) -> None:
    namespace = run("docs/serve.md#2", base_retriever=vectorstore.as_retriever())
    cache = namespace["cache"]
    assert namespace["retriever"].cache is cache
    assert namespace["llm"].chunk_cache is cache
    assert isinstance(cache.backend, HttpBackend)


# docs/store.md


@covers("docs/store.md#1")
def test_store_engine(store_dir: Path) -> None:
    namespace = run("docs/store.md#1", lm=tiny_lm())
    store = namespace["store"]
    assert isinstance(store, TieredKVStore)
    assert namespace["engine"].store is store
    store.close()


# Shell commands

ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")
# Folders the reader has; made in a scratch directory so the commands naming them parse.
READERS_FOLDERS = ("--folder", "--chroma", "--corpus-dir")


def fenced_commands() -> list[tuple[str, str]]:
    """``(doc, command line)`` of each command in the docs' shell blocks (``sh``, ``bash``,
    or unlabelled ones whose lines start with ``chunkcache``), continuations joined."""
    commands = []
    for doc in DOCS:
        for info, body in fenced_blocks(doc):
            if info not in ("sh", "bash", ""):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                words = [w for w in shlex.split(line, comments=True) if not ENV_ASSIGNMENT.match(w)]
                if words and (info or words[0] == "chunkcache"):
                    commands.append((doc, re.sub(r"\s+#.*", "", line).strip()))
    return commands


def inline_commands() -> list[tuple[str, str]]:
    """``(doc, command)`` of each inline `` `chunkcache ...` `` and `` `make ...` ``, once."""
    pattern = re.compile(r"`((?:chunkcache|make) [^`]*)`")
    found = (
        (doc, match.group(1))
        for doc in DOCS
        for match in pattern.finditer((ROOT / doc).read_text())
    )
    return list(dict.fromkeys(found))


FENCED = fenced_commands()
INLINE = inline_commands()


def check_make(targets: list[str]) -> None:
    """Each target is one the Makefile has (``make -n`` prints, runs nothing)."""
    result = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("doc", "line"), FENCED, ids=[f"{d}: {c}" for d, c in FENCED])
def test_fenced_command_parses(
    doc: str, line: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    words = shlex.split(line, comments=True)
    env = [word.split("=", 1) for word in words if ENV_ASSIGNMENT.match(word)]
    argv = [word for word in words if not ENV_ASSIGNMENT.match(word)]
    if argv[0] == "make":
        check_make(argv[1:])
        return
    assert argv[0] == "chunkcache", f"{doc}: not a command the tests know: {line}"
    for name, value in env:
        monkeypatch.setenv(name, value)
    if any(name.startswith("CHUNKCACHE_SERVE_") for name, _ in env):
        ServeSettings()  # refuses a variable that names no setting
    if any(name.startswith("CHUNKCACHE_STORE_") for name, _ in env):
        StoreSettings()
    monkeypatch.chdir(tmp_path)
    for option, value in itertools.pairwise(argv):
        if option in READERS_FOLDERS:
            (tmp_path / value).mkdir(parents=True, exist_ok=True)
    args = build_parser().parse_args(argv[1:])
    assert callable(args.run)


@pytest.mark.parametrize(("doc", "command"), INLINE, ids=[f"{d}: {c}" for d, c in INLINE])
def test_inline_command_exists(doc: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    program, *words = shlex.split(command)
    if program == "make":
        check_make(words)
        return
    path = [word for word in words if not word.startswith(("-", "<"))]
    options = [word for word in words if word.startswith("--")]
    assert path == words[: len(path)], f"{doc}: options before the command in {command}"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*path, "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(option in help_text for option in options), help_text
