"""Who holds what: the parallel plan (presets, rank maps, the subset rule), the shard layout with its
phase views and the collective interface the modules see, and the process groups of a plan.

May import `engine.checkpoint` only.
"""
