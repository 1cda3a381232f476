"""A model-free harness of the scheduler side: vLLM's real ``Scheduler`` (or obcache-vllm's
``OBCacheScheduler``), its real ``KVCacheManager``, ``BlockPool`` and prefix cache, fed by a
symbolic worker instead of a model. Thousands of steps per second, so that every feature can
be interleaved with every other one, step by step, by property-based tests.

The pieces::

    ops (ops.py)  add / turn / step / abort / reset / stream, as data: a sequence of them is
        |         a test case, drawn by gen.py (per-case option profiles), shrunk by shrink.py
        |         (a shrunk one is pasted as a named regression)
        v
    Sim (engine.py)  the front end's admission (``admit_engine_request``) -> Request ->
        |            scheduler.schedule() -> worker -> scheduler.update_from_output()
        v
    SymbolicWorker (worker.py)  vLLM's worker as the scheduler sees it: block tables, block
        |            copies, a forward pass that writes and reads every KV slot, compactions;
        |            obcache-vllm's own ``WorkerEviction`` (plan, commit, report, KV oracle)
        v
    checks (checks.py)  after every step: safety (every slot a request attends to holds what
                 it must), agreement of scheduler and worker, reference counts, registered
                 blocks, liveness; at the end: no leak, everything drained

KV as symbols. A slot's "KV" is an integer: the KV of token ``t`` at position ``p`` computed on
a cache whose resident contents fold to ``sig`` is ``content(sig, t, p)``, and ``sig`` folds
in every content written after it. A stock cache is thus a pure function of its tokens (two
requests with the same prefix compute the same contents, as a model does), and a compressed
cache of what it kept. Each request carries its *expected* cache (its shadow), built by the
harness alone from its tokens, the kept sets it chose and the snapshots of the entries it
adopted; the forward pass compares every slot it reads through the request's block table
with the shadow. A block handed out by the pool is poisoned first (vLLM guarantees nothing of
its contents), the null block is poison: reading anything not written for you is seen.

Compaction keeps a deterministic, content-based selection (sinks, recent, then a hash of the
content and the options' shape), so a recompute of the same tokens with the same options
keeps the same set: the oracle of exact reuse.
"""
