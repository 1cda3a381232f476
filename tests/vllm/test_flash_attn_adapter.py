"""The FLASH_ATTN adapter against vLLM 0.32's real objects, on CPU (no GPU, no engine).

* The layout views the pure-torch checks use ARE vLLM's: same strides as
  ``create_kv_cache_views`` for every ``KVCacheLayout``, and the view reads vLLM's views the way
  FlashAttention addresses them.
* vLLM's own ``FlashAttentionMetadataBuilder.build`` runs on CPU (FA2 settings: no FA version,
  no AOT scheduler, no CUDA graphs): the metadata it returns reads the SHIFTED persistent
  buffers, shifted in place once per step, with an exact ``max_seq_len``.
* The refusals, the CUDA install (backend override keeps the name, V1 runner factory) and the
  pinned CUDA seams. Not covered here (needs a GPU): FA's kernels themselves, the real runner.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from support.engine_config import engine_config

from obcache_vllm import admission
from obcache_vllm.admission import parse_kv_options
from obcache_vllm.eviction.step import RequestKvState, RowPlan, StepPlan
from obcache_vllm.evidence.kernel_checks.paged import read_slots
from obcache_vllm.vllm_ext import seams
from obcache_vllm.vllm_ext.worker.backends import flash_attn as fa
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    LAYOUT_ORDERS,
    FlashAttnKvView,
    layer_cache_views,
)

BS, HKV, D = 16, 3, 64


def _vllm_views(layout_name: str, num_layers=3, num_blocks=7, dtype=torch.float16):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheLayout,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=dtype)
    # As kv_cache_utils.get_kv_cache_config_from_groups places one group's layers.
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * num_layers,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


def test_layout_orders_mirror_vllm():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert LAYOUT_ORDERS == {m.name: m.value for m in KVCacheLayout}


@pytest.mark.parametrize("layout", [pytest.param(n, id=n) for n in LAYOUT_ORDERS])
def test_views_are_vllms_and_the_view_reads_them_as_fa_does(layout):
    theirs = _vllm_views(layout)
    ours = layer_cache_views(3, 7, HKV, BS, D, layout, torch.float16)
    for a, b in zip(theirs, ours, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
    cache = theirs[1]
    cache.copy_(torch.randn(cache.shape).half())
    view = FlashAttnKvView(cache, D)
    row = torch.tensor([5, 1, 6], dtype=torch.int32)
    keys, values = (t[0] for t in view.gather(row[None], 40))  # [Hkv, 40, D]
    ref_k, ref_v = read_slots(cache, row, 40)
    assert torch.equal(keys.float(), ref_k) and torch.equal(values.float(), ref_v)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # FlashAttentionImpl's
    assert torch.equal(value_cache[6, 7], values[:, 2 * BS + 7])  # block 6, slot 7 = token 39


@pytest.fixture(scope="module")
def vllm_config(model_path):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_path), max_model_len=512, block_size=32, dtype="float32",
        enforce_eager=True,
    ).create_engine_config()  # fmt: skip


def _builder(vllm_config, block_size=BS):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HKV, head_size=D, dtype=torch.half)
    with set_current_vllm_config(vllm_config):
        return fa.OBCacheFlashAttnMetadataBuilder(
            spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu")
        )


def _row(row: int, logical_len: int, dead: int) -> RowPlan:
    options = parse_kv_options({"kv_budget": 32}, 200, 512)
    state = RequestKvState.create(options)
    state.dead = dead
    return RowPlan(row, f"r{row}", BS, state, row, row + 1, logical_len, 100, False, None)


def _common_metadata(table_buf, seq_buf, lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rows = len(lens)
    qsl = torch.arange(rows + 1, dtype=torch.int32)  # one decode token per row
    seq_buf[:rows] = torch.tensor(lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_buf[:rows],
        num_reqs=rows, num_actual_tokens=rows, max_query_len=1, max_seq_len=max(lens),
        block_table_tensor=table_buf[:rows], slot_mapping=torch.zeros(rows, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(lens, dtype=torch.int32),
    )  # fmt: skip


def test_builder_reads_the_shifted_persistent_buffers(vllm_config):
    builder = _builder(vllm_config)
    logical = torch.arange(1, 41, dtype=torch.int32).view(4, 10)  # the runner's CPU table
    table_buf = logical.clone()  # its device buffer (max_num_reqs=4 rows, 3 used)
    seq_buf = torch.zeros(4, dtype=torch.int32)
    lens = [100, 37, 70]
    cm = _common_metadata(table_buf, seq_buf, lens)
    plan = StepPlan(dead=(2, 0, 4), rows=(_row(0, 100, 2), _row(2, 70, 4)), block_size=BS)
    builder.obcache_plan = plan
    md = builder.build(0, cm)
    assert md.block_table.data_ptr() == table_buf.data_ptr()  # in place, no new tensor
    assert md.seq_lens.data_ptr() == seq_buf.data_ptr()
    assert md.block_table.tolist() == [
        [3, 4, 5, 6, 7, 8, 9, 10, 0, 0], logical[1].tolist(), [25, 26, 27, 28, 29, 30, 0, 0, 0, 0]
    ]
    assert md.seq_lens.tolist() == [100 - 32, 37, 70 - 64]
    assert md.max_seq_len == 68  # exact after the shift (FA's max_seqlen_k), not 100
    assert md.obcache_plan is plan and plan.read_block_table is cm.block_table_tensor
    # A second build of the same step (another attention group) must not shift again.
    md2 = builder.build(0, cm)
    assert md2.seq_lens.tolist() == [68, 37, 6] and md2.max_seq_len == 68
    # The next step's commit_block_table restores the logical rows.
    table_buf[:3].copy_(logical[:3])
    assert torch.equal(table_buf, logical)


def test_builder_refuses_kernel_blocks_smaller_than_the_managers(vllm_config):
    builder = _builder(vllm_config, block_size=2 * BS)  # kernel 32 vs manager 16
    table_buf, seq_buf = torch.arange(1, 21, dtype=torch.int32).view(2, 10), torch.zeros(2)
    cm = _common_metadata(table_buf, seq_buf.int(), [50, 20])
    plan = StepPlan(dead=(0, 0), rows=(_row(0, 50, 0),), block_size=BS)
    builder.obcache_plan = plan
    md = builder.build(0, cm)
    assert md.obcache_plan is None and plan.read_block_table is None
    assert plan.rows[0].outcome.failure[:2] == ("schedule", "unsupported")


def _config(**over):
    """A CUDA engine configuration FLASH_ATTN serves (piecewise graphs), with ``over``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return engine_config(**{"attention_config.backend": AttentionBackendEnum.FLASH_ATTN,
                            "compilation_config.cudagraph_mode": CUDAGraphMode.PIECEWISE,
                            **over})  # fmt: skip


def _mode(name):
    from vllm.config.compilation import CUDAGraphMode

    return CUDAGraphMode[name]


@pytest.mark.parametrize(
    "override, match",
    [
        pytest.param({}, None, id="piecewise-ok"),
        pytest.param({"compilation_config.cudagraph_mode": _mode("NONE")}, None, id="eager-ok"),
        pytest.param({"attention_config.backend": None}, "--attention-backend FLASH_ATTN",
                     id="automatic-backend"),
        pytest.param({"compilation_config.cudagraph_mode": _mode("FULL_AND_PIECEWISE")},
                     "full CUDA graphs", id="full-and-piecewise"),
        pytest.param({"compilation_config.cudagraph_mode": _mode("FULL_DECODE_ONLY")},
                     "full CUDA graphs", id="full-decode-only"),
        pytest.param({"cache_config.block_size": 24}, "multiple of 16", id="block-24"),
        pytest.param({"parallel_config.decode_context_parallel_size": 2}, "context parallel",
                     id="dcp"),
        pytest.param({"parallel_config.enable_dbo": True}, "dual-batch", id="dbo"),
        pytest.param({"cache_config.kv_sharing_fast_prefill": True}, "fast prefill",
                     id="kv-sharing-fast-prefill"),
        pytest.param({"model_config.hf_text_config": SimpleNamespace(alibi=True)}, "ALiBi",
                     id="alibi"),
        pytest.param({"model_config.rswa_window": 128}, "R-SWA", id="rswa"),
        # Its view moves float pages (fp8 is served by the CPU adapter only).
        pytest.param({"cache_config.cache_dtype": "fp8"}, "quantized KV cache (fp8)", id="fp8"),
        pytest.param({"cache_config.cache_dtype": "bfloat16"}, None, id="bf16-ok"),
    ],
)  # fmt: skip
def test_unsupported_configurations_are_refused(override, match):
    reason = admission.engine_refusal(_config(**override), admission.CAPABILITIES["cuda"])
    if match is None:
        assert reason is None
    else:
        assert reason is not None and match in reason


def test_platform_dispatch_of_refusals(monkeypatch):
    from vllm.platforms import current_platform

    from obcache_vllm.vllm_ext.seams import platform_backend

    def refusal(config):  # what admission reads on this platform
        return admission.engine_refusal(config, admission.CAPABILITIES[platform_backend()])

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    full = _config(**{"compilation_config.cudagraph_mode": _mode("FULL_AND_PIECEWISE")})
    assert "full CUDA graphs" in refusal(full)
    assert refusal(_config()) is None
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
    assert "CPU and CUDA" in refusal(_config())


@pytest.fixture
def cuda_install(monkeypatch):
    """The registry's cuda rows applied on this CPU process, undone afterwards."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker import gpu_worker

    original = gpu_worker.Worker._make_model_runner
    monkeypatch.setattr(gpu_worker.Worker, "_make_model_runner", original)  # restored after
    cuda_rows = tuple(r for r in seams.REGISTRY if r.backend == "cuda")
    seams.apply(serving=False, backend="cuda", rows=cuda_rows)
    seams.apply(serving=False, backend="cuda", rows=cuda_rows)  # idempotent
    yield gpu_worker.Worker, original
    AttentionBackendEnum.FLASH_ATTN.clear_override()


def test_cuda_install_overrides_flash_attn_keeping_its_name(cuda_install):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.FLASH_ATTN.get_class()
    assert backend is fa.OBCacheFlashAttnBackend and backend.get_name() == "FLASH_ATTN"
    assert backend.get_builder_cls() is fa.OBCacheFlashAttnMetadataBuilder
    assert backend.get_impl_cls() is fa.OBCacheFlashAttnImpl
    assert backend.forward_includes_kv_cache_update is False  # the cache write is before forward


def test_cuda_install_builds_the_obcache_runner_on_the_v1_path(cuda_install, monkeypatch):
    worker_cls, original = cuda_install
    assert worker_cls._make_model_runner.__wrapped__ is original  # wrapped once
    built = []
    monkeypatch.setattr(fa, "OBCacheGPUModelRunner", lambda cfg, dev: built.append((cfg, dev)))
    fake = SimpleNamespace(use_v2_model_runner=False, vllm_config="cfg", device="cuda:0")
    worker_cls._make_model_runner(fake)
    assert built == [("cfg", "cuda:0")]
    v2 = SimpleNamespace(use_v2_model_runner=True)
    wrapped = fa._wrap_make_model_runner(lambda self: "V2")
    monkeypatch.setattr(worker_cls, "_make_model_runner", wrapped)
    assert worker_cls._make_model_runner(v2) == "V2"  # budgets are refused under V2 anyway


def test_runner_class_puts_the_eviction_half_before_vllms():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from obcache_vllm.vllm_ext.worker.runner import EvictingRunnerMixin

    mro = fa.OBCacheGPUModelRunner.__mro__
    assert mro.index(EvictingRunnerMixin) < mro.index(GPUModelRunner)
    # Cascade attention is a deprecated constant in 0.32; the runner refuses to start if not.
    assert "self.cascade_attn_enabled = False" in inspect.getsource(GPUModelRunner.__init__)


def test_cuda_seams_are_pinned_and_fail_loudly(monkeypatch):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    from obcache_vllm.vllm_ext.install import IncompatibleVllmError

    seams.check_compatibility(backend="cuda")
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "use_cascade_attention", lambda: True,
                        raising=False)  # fmt: skip
    with pytest.raises(IncompatibleVllmError, match="cascade"):
        seams.check_compatibility(backend="cuda")
    seams.check_compatibility(backend="cpu")  # the CPU backend does not rely on its absence
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "build", lambda self, prefix, cm: None)
    with pytest.raises(IncompatibleVllmError, match="build"):
        seams.check_compatibility(backend="cuda")
