"""GPU catalog, sampler pools, throughput model, cost-aware scheduling and cost reports."""
