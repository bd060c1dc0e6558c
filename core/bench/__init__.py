"""Benchmarks and evaluation: RAG prompts, quality against full prefill, speed side by side."""
