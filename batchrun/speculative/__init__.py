"""DFlash speculative decoding: drafting a block per request, and the acceptance rule."""
