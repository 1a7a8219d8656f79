"""The scheduler: which requests run each step and with which blocks."""
