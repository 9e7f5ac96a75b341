"""``plan``'s speed model: bytes read per decoded token and tok/s (``bandwidth``), the predicted
speed of each serve profile (``speed_plan``), and the split across several nodes
(``multinode_plan``).
"""
