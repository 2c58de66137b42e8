"""Learned controllers and their baselines (AutoPipe, DynPipe): not implemented yet."""
