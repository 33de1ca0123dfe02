"""Expert parallelism folded into the sequence mesh: each MoE layer's routed experts split over ``ep`` of the ranks
that hold different tokens, tokens dispatched to them and back by two uneven all-to-alls (dropless, exact)."""
