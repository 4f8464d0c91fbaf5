"""Component-level analyses (heads, directions, attention vs MLP), run as probes by name; their common
start is :func:`kvnotes.harness.circuit.start_circuit`."""
