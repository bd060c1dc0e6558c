"""chunkcache.core: chunk ids, access table, prefix tree, ledger, registry and metrics.

Importing it needs neither torch nor any RAG framework.
"""

from chunkcache.core.access_table import AccessTable
from chunkcache.core.cache import Arrangement, ChunkCache, default_cache
from chunkcache.core.chunk_ids import chunk_id, normalize_text
from chunkcache.core.errors import (
    ChunkCacheError,
    InvalidChunkError,
    InvalidConversationIdError,
    InvalidTextError,
    PromptTooLongError,
)
from chunkcache.core.escaped_chunks import EscapedChunksWarning
from chunkcache.core.ledger import ConversationLedger
from chunkcache.core.metrics import prefix_metric, total_metric
from chunkcache.core.ordering import order_chunks, tree_guided_order
from chunkcache.core.prefix_tree import ChunkPrefixTree, PrefixNode
from chunkcache.core.registry import ChunkRegistry

__all__ = [
    "AccessTable",
    "Arrangement",
    "ChunkCache",
    "ChunkCacheError",
    "ChunkPrefixTree",
    "ChunkRegistry",
    "ConversationLedger",
    "EscapedChunksWarning",
    "InvalidChunkError",
    "InvalidConversationIdError",
    "InvalidTextError",
    "PrefixNode",
    "PromptTooLongError",
    "chunk_id",
    "default_cache",
    "normalize_text",
    "order_chunks",
    "prefix_metric",
    "total_metric",
    "tree_guided_order",
]
