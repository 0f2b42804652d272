"""Comparisons with peers: the same workload, weights and machine under TRL's GRPOTrainer and ours."""
