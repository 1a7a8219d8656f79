"""The capacity planner and what-if replay: traces through the real scheduler and KV manager."""
