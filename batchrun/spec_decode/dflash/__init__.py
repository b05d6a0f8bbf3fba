"""DFlash drafting: the speculator, its inputs built on the device, the sliding layers' rings,
the verify-width policy and the draft's CUDA graphs."""
