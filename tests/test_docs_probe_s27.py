"""Claims of the user docs that no other test held them to: figures quoted from the published
benchmark reports, the vLLM launch command, what ``cache_read`` counts, the hand-built
store's defaults, links between the docs, and the docstring examples of the public modules.

A report re-run with other figures, or code that changes what a doc describes, fails here
naming the doc.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from tiny_models import tiny_lm, tiny_tokenizer

import chunkcache.core.vllm_server as vllm_server
from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.store.tiered import TieredKVStore
from chunkcache.integrations.langchain import ChunkCacheLLM

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/engine.md", "docs/serve.md", "docs/store.md")


def read(doc: str) -> str:
    return (ROOT / doc).read_text()


def flat(doc: str) -> str:
    """``doc`` with its line breaks as spaces, so a phrase may wrap anywhere."""
    return re.sub(r"\s*\n\s*", " ", read(doc))


def report(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ROOT / "docs/benchmarks" / f"{name}.json").read_text())
    return loaded


ENGINE = report("engine")


def ttft_ratio(policy: str) -> str:
    """A policy's median per-prompt prefill time over ``full``'s, as the report prints it."""
    return f"{ENGINE['speed']['summary'][policy]['ratio_to_full']['median']:.2f}x"


def tf_kl(policy: str) -> str:
    return f"{ENGINE['quality']['summary'][policy]['tf_kl']['mean']:.3f}"


def speed_ms(policy: str) -> int:
    return round(ENGINE["speed"]["summary"][policy]["ms"]["median"])


def test_readme_policy_choice_quotes_the_engine_report() -> None:
    readme = flat("README.md")
    quoted = [
        f"`cacheblend` at 0.15 took {ttft_ratio('cacheblend-0.15')} `full`'s time with a KL "
        f"of {tf_kl('cacheblend-0.15')}",
        f"lowers the KL to {tf_kl('cacheblend-0.30')} at {ttft_ratio('cacheblend-0.30')}",
        f"`cachecraft` took {ttft_ratio('cachecraft')} at {tf_kl('cachecraft')}",
        f"fastest at {ttft_ratio('reuse')}, with a KL of {tf_kl('reuse')}",
    ]
    for claim in quoted:
        assert claim in readme, f"README.md should say: {claim}"


def test_engine_doc_quotes_the_published_speed_run() -> None:
    engine_doc = flat("docs/engine.md")
    commit = ENGINE["speed"]["environment"]["commit"]
    craft, blend = speed_ms("cachecraft"), speed_ms("cacheblend-0.15")
    claim = f"{craft} and {blend} ms in the published report, re-run at {commit}"
    assert claim in engine_doc, f"docs/engine.md should say: {claim}"
    rows = read("docs/engine.md").splitlines()
    row = next(line for line in rows if line.startswith("|") and f"at {commit}" in line)
    cells = [int(cell.split()[0]) for cell in row.strip("|").split("|")[1:]]
    policies = ["full", "prefix", "reuse", "cacheblend-0.15", "cachecraft", "hf forward"]
    assert cells == [speed_ms(policy) for policy in policies], row


def test_store_doc_quotes_the_published_pipelined_read() -> None:
    ratio = report("store")["ttft"]["configs"]["disk, pipelined"]["ratio_to_disk"]
    claim = f"{ratio:.2f}x in the published report"
    assert claim in flat("docs/store.md"), f"docs/store.md should say: {claim}"


def test_store_doc_gives_a_hand_built_stores_defaults() -> None:
    defaults = inspect.signature(TieredKVStore).parameters
    assert defaults["write_through"].default is False
    assert defaults["policy"].default == "lru"
    doc = flat("docs/store.md")
    assert "built by hand has it off unless given `write_through=True`" in doc
    assert "its `policy` defaults to `lru`" in doc


def vllm_command() -> list[str]:
    """The README's command that starts a vLLM server, as words."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", read("README.md"), re.M | re.S)
    found = [b.replace("\\\n", " ") for b in blocks if "vllm.entrypoints" in b]
    assert len(found) == 1, "README.md should show one command that starts vLLM"
    return shlex.split(found[0])


def test_readme_starts_vllm_as_chunkcache_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module and options are the ones chunkcache's own launcher runs (the slow vLLM tests
    start it), serving the name and port the README's ``vllm`` backend connects to."""
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: Path("python"))
    ours = vllm_server.server_args(vllm_server.VllmServerConfig(), Path("model"), 8001)
    words = vllm_command()
    assert words[0] == "VLLM_CPU_KVCACHE_SPACE=4"  # the variable vLLM sizes its KV cache by
    assert words[1] == ".venv-vllm/bin/python"  # where `make vllm` installs it
    assert words[2:4] == ours[1:3]  # -m <the server module>
    options = [word for word in words if word.startswith("--")]
    assert set(options) <= set(ours)
    for needed in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert needed in options
    served = words[words.index("--served-model-name") + 1]
    port = words[words.index("--port") + 1]
    backend = f'ChunkCache(backend="vllm", base_url="http://127.0.0.1:{port}", model="{served}")'
    assert backend in read("README.md")
    assert Path(words[words.index("--model") + 1]).name == served


def chat_lm() -> LoadedModel:
    """The tiny model with a chat template that writes each message's text."""
    lm, tokenizer = tiny_lm(), tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return LoadedModel(lm.hf, tokenizer, lm.spec, lm.rope, lm.fingerprint)


def test_cache_read_counts_the_reused_tokens_only() -> None:
    """README: ``cache_read`` is ``reused_tokens``; recomputed and computed tokens are not in
    it, and the three add up to the prompt."""
    cache = ChunkCache(backend=LocalBackend(ChunkEngine(chat_lm())))
    texts = [" ".join(f"w{i}" for i in range(start, start + 20)) for start in (10, 40)]
    chunks = [Document(page_content=text) for text in texts]
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=2, recompute_ratio=0.5)
    prompt = ChatPromptTemplate.from_messages([("system", "{context}"), ("human", "{question}")])
    llm.invoke(prompt.invoke({"context": "\n\n".join(texts), "question": "w1"}), chunks=chunks)
    moved = "\n\n".join(reversed(texts))  # the chunks' KV reused at new places, some recomputed
    answer = llm.invoke(prompt.invoke({"context": moved, "question": "w1"}), chunks=chunks)
    stats = answer.response_metadata["chunkcache"]
    assert stats["chunk_hits"] == 2
    assert stats["recomputed_tokens"] > 0 and stats["reused_tokens"] > 0
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_token_details"]["cache_read"] == stats["reused_tokens"]
    parts = ("reused_tokens", "recomputed_tokens", "computed_tokens")
    assert sum(stats[part] for part in parts) == stats["prompt_tokens"]


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of ``doc``."""
    headings = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


LINKS = sorted(
    {
        (doc, target)
        for doc in (*DOCS, "docs/benchmarks/README.md")
        for target in re.findall(r"\]\(([^)\s]+)\)", read(doc))
        if not target.startswith(("http://", "https://"))
    }
)


def test_the_docs_link_at_all() -> None:
    assert len(LINKS) >= 10


@pytest.mark.parametrize(("doc", "target"), LINKS, ids=[f"{d} -> {t}" for d, t in LINKS])
def test_link_resolves(doc: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    linked = (ROOT / doc).parent / path if path else ROOT / doc
    assert linked.exists(), f"{doc} links to {target}, which is not there"
    if anchor:
        assert anchor in anchors(linked), f"{doc} links to {target}: no such heading"


# The modules whose docstrings show the public API (the brief's list), and every other module
# with an example that runs (not skipped).
PUBLIC = (
    "core.cache",
    "integrations.langchain",
    "integrations.langchain_llm",
    "integrations.llama_index",
    "integrations.llama_index_llm",
)


def modules_with_examples() -> list[str]:
    found = []
    for folder in ("core", "integrations", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if name not in PUBLIC and re.search(r">>> (?!.*doctest: \+SKIP)", path.read_text()):
                found.append(name)
    return found


EXAMPLES = [*PUBLIC, *modules_with_examples()]


@pytest.mark.parametrize("module", EXAMPLES)
def test_docstring_examples_run(module: str) -> None:
    imported = importlib.import_module(f"chunkcache.{module}")
    failures, _ = doctest.testmod(imported, optionflags=doctest.ELLIPSIS, report=True)
    assert failures == 0, f"{module}: {failures} docstring examples fail"
