"""Deciding: the cost model, link estimates, circuit breakers, the planner, the decision step, plan seals."""
