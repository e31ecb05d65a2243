"""Model-side engines: tokenizers, model building/loading, generation, log-probs, data parallelism."""
