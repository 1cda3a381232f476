"""The EngineCore side: the scheduler adapter over the block ledger, the pool's start-up check."""
