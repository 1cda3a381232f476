"""Long prompts for engine tests: the package's seeded generator (offline, deterministic)."""

from obcache_vllm.textgen import haystack, needle_parts, needle_prompt

__all__ = ["haystack", "needle_parts", "needle_prompt"]
