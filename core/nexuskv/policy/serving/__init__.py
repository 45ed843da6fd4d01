"""Which policy revision serves: hot reload and watching of a directory, fleet rollout channels."""
