"""The engine worker: its start and context, the output processor, the live view's publisher."""
