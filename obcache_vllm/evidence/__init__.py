"""Evidence tooling: accuracy grids, perplexity, the HF reference, kernel checks.

Nothing a server runs imports this wing (an import-linter contract); the ``obcache-vllm eval``
and ``obcache-vllm ppl`` commands load it lazily. It may import the runtime packages.
"""
