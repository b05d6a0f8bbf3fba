"""DFlash drafting: the method's registry entry (method.py), the speculator, its inputs built
on the device, the sliding layers' rings and the draft's CUDA graphs."""
