"""The engine: scheduler, KV cache, model runner, sampler, and the step loop."""
