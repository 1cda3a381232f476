"""The server's eviction metrics: scrape ``/metrics`` and print the ``vllm:obcache_*`` series.

    .venv/bin/python examples/metrics.py [--url http://127.0.0.1:8000]

The same text Prometheus scrapes; every metric is described on the Monitoring page.
"""

from __future__ import annotations

import argparse
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    with urllib.request.urlopen(f"{args.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:obcache_"):
            print(line)


if __name__ == "__main__":
    main()
