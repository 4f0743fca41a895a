"""Model building blocks; each parallel layer shards its own weights in a weight_loader."""
