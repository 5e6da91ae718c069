"""Model building blocks: tensor-parallel linear layers, RMSNorm, rotary embeddings, activations."""
