"""Klotski's planner: profile data, the profiler that measures it, the inequalities and the roofline bound."""
