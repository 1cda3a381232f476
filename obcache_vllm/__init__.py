"""obcache-vllm: OBCache KV-cache eviction inside vLLM.

Importing this package defines names only: no vLLM import, no patching, no logging setup.
The vLLM integration is activated by the ``obcache`` entry point of ``vllm.general_plugins``
(:mod:`obcache_vllm.plugin`, which runs :func:`obcache_vllm.vllm_ext.install.install` in every
vLLM process).

One request's ``kv_budget``, from the HTTP body to the freed blocks::

  API server (vllm_ext/frontend)        EngineCore (vllm_ext/engine)     worker (vllm_ext/worker)
  to_sampling_params: kv_* fields +     add_request: decode the wire,
    the server policy -> admission.parse  open it in the BlockLedger
    (Requested, parsed once)              (eviction/ledger.py)
  AsyncLLM.generate: Admission.admit    _get_local_prefix_cache_hit:
    on the rendered prompt                exact hit or compressed entry
  process_inputs: the admitted            (prefix.py; copy-on-write of
    options as a versioned wire tuple     hit blocks it writes: blocks.py)
    in extra_args["obcache"]            schedule: the ledger's orders    execute_model: states,
                                          (compress point, kv_decode,      StepPlan (eviction/step)
                                          pressure.py) on the output --->  after each layer:
                                                                           score, select, compact
                                                                           (eviction/layer.py)
                                        update_from_output: report   <--- ModelRunnerOutput report
                                          committed; dead head blocks
                                          back to vLLM's pool
  usage.obcache, vllm:obcache_*     <-- outcomes on EngineCoreOutput, counters in SchedulerStats

Every decision about a request (defaults, refusals, resolution, capacity) is
:mod:`obcache_vllm.admission`'s. The packages: :mod:`obcache_vllm.scoring` (the scores, pure
torch), :mod:`obcache_vllm.eviction` (the vLLM-free eviction engine),
:mod:`obcache_vllm.vllm_ext` (every vLLM adapter, laid out by process),
:mod:`obcache_vllm.evidence` (evaluation tooling, never imported by a server).
"""

__version__ = "0.1.0"
