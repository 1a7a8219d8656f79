"""The engine core process, the worker's client for it, and the commands it answers."""
