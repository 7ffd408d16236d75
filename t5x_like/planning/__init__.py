"""Hardware catalogue, memory model and the layout planner."""
