"""A forward's inputs and how they reach the device: the batch of one forward (forward_batch.py), host <->
device copies that never sync the host (host_copy.py), the intra-op thread count a forward keeps
(intra_op.py). Below the attention backends, the models and the engine, which all read them."""
