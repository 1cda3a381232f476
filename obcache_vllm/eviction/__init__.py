"""The eviction engine, free of vLLM: block arithmetic, the block ledger, per-layer eviction.

Everything here takes plain Python values and tensors; an import-linter contract forbids vLLM
(``pyproject.toml``), so every piece is unit-tested on plain tensors and fakes. The vLLM
adapters (:mod:`obcache_vllm.vllm_ext`) translate vLLM's objects into these calls:

* :mod:`.planning` - the block rule: when an order can free a whole block, worst-case peaks.
* :mod:`.messages` - the frozen messages between scheduler and worker.
* :mod:`.ledger` - a budgeted request's block accounting on the scheduler side.
* :mod:`.step` - the worker's per-request state and the per-step plan.
* :mod:`.layer` - one attention layer's eviction over a paged cache view.
* :mod:`.paged` - the read shift of a compressed row on a block table.
* :mod:`.faults` - test-only fault injection, off unless asked for.
"""
