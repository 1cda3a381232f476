"""Load generator for OpenAI-compatible servers (obcache-vllm, stock vLLM, any other).

    python -m loadtest run loadtest/scenarios/mix.yaml --url http://127.0.0.1:8000
    python -m loadtest run loadtest/scenarios/soak.yaml --launch      # start the server too
    python -m loadtest compare loadtest/scenarios/compare.yaml --out results/loadtest/compare

Data flow::

    scenario.py   YAML -> Scenario (validated, frozen) -> make_plan -> [RequestPlan]
    runner.py     issue the plan (closed loop or Poisson), poll /metrics (scrape.py)
    client.py     one request: RequestFuncOutput timed as vllm bench serve times it
    report.py     vLLM's calculate_metrics + counts + server figures -> JSON, Markdown, PNG
    checks.py     end-of-run assertions (healthy, idle, no 5xx, usage.obcache vs counters)
    compare.py    stock vLLM / plugin without budgets / plugin with the mix, ratios
    launch.py     start and stop an `obcache-vllm serve` for a run

Runs in the project's venv (it reuses vLLM's benchmark code for the metric definitions);
sends traffic to loopback addresses unless --allow-remote is given.
"""
