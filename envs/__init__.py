"""Gymnasium environments backed by the pipeline simulator, and the traces they run on
(`adaptipe.envs.trace`)."""
