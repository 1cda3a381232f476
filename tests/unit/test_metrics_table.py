"""The README's metrics table is exactly obcache_vllm.metrics (names, types, labels, help)."""

from __future__ import annotations

import re
from pathlib import Path

from obcache_vllm import metrics

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `(vllm:obcache_[a-z_]+)` \| (\w+) \| ([^|]*) \| ([^|]+) \|$")


def _readme_rows() -> list[tuple[str, str, tuple[str, ...], str]]:
    rows = []
    for line in README.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line.strip())
        if match:
            name, kind, labels, help_text = match.groups()
            label_names = tuple(re.findall(r"`(\w+)`", labels))
            rows.append((name, kind, label_names, help_text.strip()))
    return rows


def test_readme_metrics_table_matches_the_metric_definitions() -> None:
    expected = [(m.exposed, m.kind, m.labels, m.help) for m in metrics.METRICS]
    assert _readme_rows() == expected


def test_metric_names_are_unique_and_prefixed() -> None:
    names = [m.name for m in metrics.METRICS]
    assert len(set(names)) == len(names)
    assert all(n.startswith("vllm:obcache_") and not n.endswith("_total") for n in names)
    assert all(m.kind in ("counter", "histogram") for m in metrics.METRICS)
    assert all((m.buckets is not None) == (m.kind == "histogram") for m in metrics.METRICS)
