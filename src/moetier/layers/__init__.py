"""Building blocks of model families: attention, rotary, norms, dense MLP, MoE."""
