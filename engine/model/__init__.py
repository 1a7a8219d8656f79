"""What computes tokens: the model runner and its model, ops and sampler; the simulator's stand-in."""
