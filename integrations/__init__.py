"""Framework integrations: LangChain, LlamaIndex and vLLM."""
