"""obcache-vllm: OBCache KV-cache eviction inside vLLM.

Importing this package defines names only: no vLLM import, no patching, no logging setup.
The vLLM integration is activated by the ``obcache`` entry point of ``vllm.general_plugins``.
"""

__version__ = "0.1.0"
