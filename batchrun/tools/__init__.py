"""Tools that build test and demo assets locally: a BPE tokenizer and tiny random checkpoints."""
