"""Component-level analyses (heads, directions, attention vs MLP), run as probes by name."""
