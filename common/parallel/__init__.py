"""Tensor parallelism: the process group (tp_group.py) and the model's split across it (tp_shard.py;
mixtures of experts, with or without expert parallelism, in moe_shard.py)."""
