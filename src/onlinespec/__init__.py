"""onlinespec: online speculative decoding (Liu et al., ICML 2024)."""
