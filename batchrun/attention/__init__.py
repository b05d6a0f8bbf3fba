"""Attention backends behind one interface (base.py): the torch reference and Triton."""
