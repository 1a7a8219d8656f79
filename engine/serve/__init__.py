"""The engine core process and the commands it answers."""
