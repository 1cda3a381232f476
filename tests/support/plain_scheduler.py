"""A user's own scheduler class (``--scheduler-cls plain_scheduler.PlainScheduler``): vLLM's
``Scheduler`` unchanged, not obcache's. Budgeted requests are refused on such a server."""

from vllm.v1.core.sched.scheduler import Scheduler


class PlainScheduler(Scheduler):
    pass
