"""The docs' metrics table (docs/deploying/monitoring.md) is exactly obcache_vllm.metrics."""

from __future__ import annotations

import re
from pathlib import Path

from obcache_vllm import metrics

TABLE = Path(__file__).resolve().parents[2] / "docs" / "deploying" / "monitoring.md"
ROW = re.compile(r"^\| `(vllm:obcache_[a-z_]+)` \| (\w+) \| ([^|]*) \| ([^|]+) \|$")


def _table_rows() -> list[tuple[str, str, tuple[str, ...], str]]:
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line.strip())
        if match:
            name, kind, labels, help_text = match.groups()
            label_names = tuple(re.findall(r"`(\w+)`", labels))
            rows.append((name, kind, label_names, help_text.strip()))
    return rows


def test_docs_metrics_table_matches_the_metric_definitions() -> None:
    expected = [(m.exposed, m.kind, m.labels, m.help) for m in metrics.METRICS]
    assert _table_rows() == expected


def test_metric_names_are_unique_and_prefixed() -> None:
    names = [m.name for m in metrics.METRICS]
    assert len(set(names)) == len(names)
    assert all(n.startswith("vllm:obcache_") and not n.endswith("_total") for n in names)
    assert all(m.kind in ("counter", "histogram", "gauge") for m in metrics.METRICS)
    assert all((m.buckets is not None) == (m.kind == "histogram") for m in metrics.METRICS)
