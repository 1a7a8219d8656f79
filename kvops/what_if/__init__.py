"""What if: an engine's recent jobs replayed through the capacity simulator under its own
configuration and an operator's alternative."""
