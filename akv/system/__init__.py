"""AKV server side: the engine-agnostic context core, the cache core, kernels and the SGLang build."""
