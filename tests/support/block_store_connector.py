"""A KV connector that stores a finished request's blocks under its prompt's block hashes and
gives a later request with the same prompt those blocks back: what vLLM's offloading connectors
and LMCache do (they key saved KV by the prompt's position in blocks), neither of which runs on
vLLM's CPU build. vLLM's ``ExampleConnector`` runs here, but it saves a request's KV during its
first forward, before any eviction, so it cannot show what a connector that saves later sees.

Written for ``tests/engine/test_refusals_needed.py`` from vLLM 0.32's public connector API
(``KVConnectorBase_V1``), to show why budgets refuse KV connectors: a compacted block no longer
holds the tokens its hash names.

* scheduler side: ``request_finished`` delays the free and queues a store of each block of the
  request's block table that its prompt hashes cover (block ``i`` under hash ``i``);
  ``get_num_new_matched_tokens`` counts a new request's leading hashes in the store (leaving the
  prompt's last token to compute), ``update_state_after_alloc`` queues their loads;
* worker side: the stores and loads copy whole blocks between the layers' KV caches
  (``register_kv_caches``; the CPU backend's ``[num_blocks, heads, block_size, 2 * head_size]``) and
  one ``.pt`` file per hash in ``shared_storage_path``, before the step's forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


@dataclass
class _Meta(KVConnectorMetadata):
    stores: list[tuple[str, int]] = field(default_factory=list)  # (hash hex, block id)
    loads: list[tuple[str, int]] = field(default_factory=list)
    stored_requests: list[str] = field(default_factory=list)


class BlockStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._path = self._kv_transfer_config.get_from_extra_config("shared_storage_path", "/tmp")
        os.makedirs(self._path, exist_ok=True)
        self._meta = _Meta()  # scheduler side: what the next step moves
        self._kv_caches: dict[str, torch.Tensor] = {}  # worker side
        self._sent: set[str] = set()

    def _file(self, block_hash: bytes | str) -> str:
        name = block_hash if isinstance(block_hash, str) else bytes(block_hash).hex()
        return os.path.join(self._path, f"{name}.pt")

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        last = (request.num_prompt_tokens - 1) // self._block_size  # leave a token to compute
        hit = num_computed_tokens // self._block_size
        while hit < min(last, len(request.block_hashes)):
            if not os.path.exists(self._file(request.block_hashes[hit])):
                break
            hit += 1
        return max(0, hit * self._block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens <= 0:
            return
        block_ids = self._kv_cache_manager.get_block_ids(request.request_id)[0]
        first = request.num_computed_tokens // self._block_size
        for i in range(first, first + num_external_tokens // self._block_size):
            self._meta.loads.append((bytes(request.block_hashes[i]).hex(), block_ids[i]))

    def build_connector_meta(self, scheduler_output):
        meta, self._meta = self._meta, _Meta()
        return meta

    def request_finished(self, request, block_ids):
        covered = min(len(block_ids), request.num_prompt_tokens // self._block_size,
                      len(request.block_hashes))  # fmt: skip
        stores = [(bytes(request.block_hashes[i]).hex(), block_ids[i]) for i in range(covered)]
        stores = [(h, b) for h, b in stores if not os.path.exists(self._file(h))]
        if not stores:
            return False, None
        self._meta.stores.extend(stores)
        self._meta.stored_requests.append(request.request_id)
        return True, None  # the blocks stay allocated until the worker has copied them

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for block_hash, block_id in meta.stores:
            torch.save({name: kv[block_id].clone() for name, kv in self._kv_caches.items()},
                       self._file(block_hash))  # fmt: skip
        for block_hash, block_id in meta.loads:
            saved = torch.load(self._file(block_hash))
            for name, kv in self._kv_caches.items():
                kv[block_id] = saved[name]
        self._sent.update(meta.stored_requests)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids):
        sent, self._sent = self._sent, set()
        return (sent or None), None
