"""How an engine's state is laid out, for `engine.py`: learned from the model by one abstract
trace (discover.py), and read and built in the logical layout that checkpoints hold
(logical.py). The shape maths of the layout itself (logical <-> padded flat shards) is
partition.py's.
"""
