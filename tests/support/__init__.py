"""Helpers shared by the test tiers (not tests): the in-process engine's internals and driver
(:mod:`.engine`), a real server process (:mod:`.server`), seeded texts (:mod:`.texts`), and the
scripts the tests run in subprocesses (``probes/``)."""
