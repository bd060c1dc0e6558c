"""chunkcache.core: chunk ids, access table, prefix tree, ledgers, registry and metrics."""
