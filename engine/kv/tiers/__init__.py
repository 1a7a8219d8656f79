"""Tiers of the prefix cache below the GPU pool: CPU memory and disk."""
