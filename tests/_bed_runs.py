"""Running a job on a namespace test bed, for tests: the package's launcher
(`adaptipe.runtime.bedrun`)."""

from __future__ import annotations

from adaptipe.runtime.bedrun import start_manager, torchrun_stage, wait_marked

__all__ = ["start_manager", "torchrun_stage", "wait_marked"]
