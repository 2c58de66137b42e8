"""Gymnasium environments backed by the pipeline simulator: not implemented yet."""
