"""The controller: block table, policy, planner, cost model (no Ray or torch here but actor.py)."""
