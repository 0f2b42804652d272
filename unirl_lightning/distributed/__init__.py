"""Training-rank plumbing: parameter sharding across ranks, building a model on the meta device for the
ranks that receive rank 0's weights, and the cross-rank abort that ends every rank together."""
